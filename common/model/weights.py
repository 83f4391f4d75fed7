"""Build the model from a checkpoint folder and load its safetensors weights."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import re
from collections.abc import Hashable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open

from common.files import write_atomically
from common.model.arch import IMAGE_TEXT_TYPES, SUPPORTED_MODEL_TYPES, ModelArch, language_model_config
from common.model.llama import FUSED_PROJECTIONS, LlamaForCausalLM
from common.model.loader import FROM_2_WAY_SOFTMAX, cache_dir, classifier_from_tokens
from common.model.packed_linear import fp8_kind, int_kind, pack_values, packed_layers, to_packed_layers
from common.model.parallel import TensorParallel, shard_of, shard_rules, shard_state
from common.model.quantization import (
    QUANT_COMPRESSED_TENSORS,
    QUANT_MXFP4,
    compressed_fp8_scales,
    dequantize_fp8,
    dequantize_mxfp4,
    int_weight_layers,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "load_hf_config", "load_model", "stack_experts", "stack_projections"]

# Checkpoints that name parts their own way (a mixture's, a norm's): (pattern, this model's name), applied
# to each name in order.
_RENAMES = {
    # Mixtral: one weight per expert and projection.
    "mixtral": ((r"\.block_sparse_moe\.", ".mlp."), (r"\.w1\.", ".gate_proj."), (r"\.w3\.", ".up_proj."),
                (r"\.w2\.", ".down_proj.")),
    # Granite MoE: the experts stacked already, gate and up together; the shared expert's gate and up too.
    "granitemoe": ((r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),
                   (r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down_proj"),
                   (r"\.block_sparse_moe\.router\.(layer\.)?", ".mlp.gate."),
                   (r"\.shared_mlp\.input_linear\.", ".mlp.shared_expert.gate_up_proj."),
                   (r"\.shared_mlp\.output_linear\.", ".mlp.shared_expert.down_proj."),
                   (r"\.block_sparse_moe\.", ".mlp.")),
}
_RENAMES["granitemoeshared"] = _RENAMES["granitemoe"]
# GLM-4.5 and dots.llm1: their shared experts, one MLP, under a plural name.
_RENAMES["glm4_moe"] = ((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),)
_RENAMES["dots1"] = _RENAMES["glm4_moe"]
# DeepSeek-V2 and V3: the same.
_RENAMES["deepseek_v2"] = _RENAMES["deepseek_v3"] = _RENAMES["glm4_moe"]
# Hunyuan MoE: its router's weight one module down, its shared MLP under its own name.
_RENAMES["hunyuan_v1_moe"] = ((r"\.mlp\.gate\.wg\.", ".mlp.gate."), (r"\.mlp\.shared_mlp\.", ".mlp.shared_expert."))
# MiniMax-M2: Mixtral's names, its router's correction bias on the block.
_RENAMES["minimax_m2"] = ((r"\.block_sparse_moe\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
                            *_RENAMES["mixtral"])
# gpt-oss: its router under its own name.
_RENAMES["gpt_oss"] = ((r"\.mlp\.router\.", ".mlp.gate."),)
# ERNIE 4.5: the correction bias on the block (or, as transformers names it, in the router's statistics),
# its shared experts one MLP under a plural name.
_RENAMES["ernie4_5_moe"] = ((r"\.mlp\.(gate\.)?moe_statics\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
                            *_RENAMES["glm4_moe"])
# GLM-4: Gemma's four norms under its own names (its post_attention_layernorm is the one before the MLP).
_RENAMES["glm4"] = ((r"\.post_attention_layernorm\.", ".pre_feedforward_layernorm."),
                    (r"\.post_self_attn_layernorm\.", ".post_attention_layernorm."),
                    (r"\.post_mlp_layernorm\.", ".post_feedforward_layernorm."))
# Apertus: Llama's two norms under names of their own.
_RENAMES["apertus"] = ((r"\.attention_layernorm\.", ".input_layernorm."), (r"\.feedforward_layernorm\.",
                                                                         ".post_attention_layernorm."))
# AFMoE: its router's weight one module down, its correction bias on the block, its shared experts one MLP
# under a plural name, Gemma's four norms under names of its own, its attention's output gate renamed
# (``gate_proj`` would be stacked with an MLP's ``up_proj``).
_RENAMES["afmoe"] = ((r"\.mlp\.router\.gate\.", ".mlp.gate."), (r"\.mlp\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
                     (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."), (r"\.pre_mlp_layernorm\.", ".pre_feedforward_layernorm."),
                     (r"\.post_mlp_layernorm\.", ".post_feedforward_layernorm."),
                     (r"\.self_attn\.gate_proj\.", ".self_attn.output_gate."))
# StarCoder2's MLP: c_fc / c_proj, an up and a down projection without a gate.
_RENAMES["starcoder2"] = ((r"\.mlp\.c_fc\.", ".mlp.up_proj."), (r"\.mlp\.c_proj\.", ".mlp.down_proj."))
# Phi's: its attention's output projection ``dense``, its MLP's fc1 / fc2, its final norm ``final_layernorm``.
_RENAMES["phi"] = ((r"\.self_attn\.dense\.", ".self_attn.o_proj."), (r"\.mlp\.fc1\.", ".mlp.up_proj."),
                   (r"\.mlp\.fc2\.", ".mlp.down_proj."), (r"^model\.final_layernorm\.", "model.norm."))
# GPT-NeoX's (Pythia's): its own names for the model, the attention and its projections, the MLP's two, the
# final norm and the output head (``embed_out`` in its checkpoints); its fused q/k/v is split as it loads
# (``split_neox_qkv``).
_RENAMES["gpt_neox"] = ((r"^gpt_neox\.embed_in\.", "model.embed_tokens."), (r"^gpt_neox\.final_layer_norm\.", "model.norm."),
                        (r"^gpt_neox\.layers\.", "model.layers."), (r"\.attention\.dense\.", ".self_attn.o_proj."),
                        (r"\.attention\.query_key_value\.", ".self_attn.query_key_value."),
                        (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
                        (r"^embed_out\.", "lm_head."))
# Persimmon's: GPT-NeoX's fused q/k/v (split as it loads), its attention's output projection ``dense``, its q/k
# LayerNorms (one weight and bias for all heads), its MLP's two, its final norm ``final_layernorm``.
_RENAMES["persimmon"] = ((r"\.self_attn\.dense\.", ".self_attn.o_proj."), (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
                         (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
                         (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
                         (r"^model\.final_layernorm\.", "model.norm."))
# Falcon's: its own names for the model, the attention and its projections, the MLP's two and the norms (the new
# layer's ``ln_attn`` and ``ln_mlp`` as GPT-NeoX's two); its fused q/k/v is split as it loads.
_RENAMES["falcon"] = ((r"^transformer\.word_embeddings\.", "model.embed_tokens."), (r"^transformer\.ln_f\.", "model.norm."),
                      (r"^transformer\.h\.", "model.layers."), (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
                      (r"\.self_attention\.query_key_value\.", ".self_attn.query_key_value."),
                      (r"\.ln_attn\.", ".input_layernorm."), (r"\.ln_mlp\.", ".post_attention_layernorm."),
                      (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."), (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."))
# StableLM's per-head LayerNorms of q and k, one module per head, are one weight per head here (Cohere's).
_RENAMES["stablelm"] = ((r"\.self_attn\.q_layernorm\.norms\.", ".self_attn.q_norm.heads."),
                        (r"\.self_attn\.k_layernorm\.norms\.", ".self_attn.k_norm.heads."))
# VaultGemma: Gemma 2's layer without the norms after each block; its norm before the MLP under Gemma 2's name.
_RENAMES["vaultgemma"] = ((r"\.pre_feedforward_layernorm\.", ".post_attention_layernorm."),)
# Llama 4's: its MLP (dense, or the mixture with its shared expert) as ``feed_forward``, its router under its own name.
_RENAMES["llama4_text"] = ((r"\.feed_forward\.router\.", ".mlp.gate."), (r"\.feed_forward\.", ".mlp."))
# Families whose causal LM holds its base model under a name of its own (not ``model.``).
_OWN_PREFIX_TYPES = ("gpt_neox", "falcon")
# An image-text checkpoint (``IMAGE_TEXT_TYPES``): its language model's weights under a prefix of their own,
# renamed to a causal LM's; the vision tower's and the projector's, which text alone never reaches, unloaded.
_LANGUAGE_MODEL_NAMES = ((r"^language_model\.model\.", "model."), (r"^language_model\.lm_head\.", "lm_head."),
                         (r"^model\.language_model\.", "model."), (r"^model\.text_model\.", "model."))
_VISION_NAMES = re.compile(r"^(model\.)?((vision_tower|vision_model|multi_modal_projector|visual|connector)\.|"
                           r"image_newline$)")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ANY_LAYER = re.compile(r"\.layers\.(\d+)\.")  # a layer's tensors, under any prefix
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<kind>gate_up_proj|down_proj)\."
                     r"(?P<tensor>weight|weight_scale_inv|qweight|qzeros|scales)$")
# A stacked expert projection's tensors as ``Experts`` names them: packed ones after the projection's name.
_STACKED_EXPERT_TENSORS = {"weight": "", "weight_scale_inv": "_scale_inv", "qweight": "_qweight", "qzeros": "_qzeros",
                           "scales": "_scales"}


# What a resolved config in the cache holds, changed whenever ``language_model_config`` keeps more (2: an image-text
# checkpoint's quantization_config), so that a cache an older version wrote is not read as this one's.
_RESOLVED_CONFIG_FORMAT = 2


def load_hf_config(path: Path) -> Any:
    """The checkpoint's transformers config; raises ``UnsupportedConfig`` (naming the field) for
    anything the model does not implement, before any weight is read.

    transformers resolves it (its defaults for the model type filled in) the first time; its fields
    are then kept in the cache, keyed by ``config.json``, the transformers version and what this code keeps
    (``_RESOLVED_CONFIG_FORMAT``), and later
    starts read them from there as attributes: importing transformers and its config classes took
    about 6 s of CPU of an engine's ~10 s start. Only plain attribute reads are made of such a config;
    models with scaled RoPE (whose tables transformers computes from its config object) are not cached."""
    raw = (path / "config.json").read_bytes()
    key = hashlib.sha256(raw + b"\0" + importlib.metadata.version("transformers").encode() +
                         b"\0%d" % _RESOLVED_CONFIG_FORMAT).hexdigest()[:24]
    cached = cache_dir() / "resolved-configs" / f"{key}.json"
    config: Any
    try:
        config, resolved = SimpleNamespace(**json.loads(cached.read_text())), False
    except (OSError, ValueError):
        from transformers import AutoConfig

        config, resolved = language_model_config(AutoConfig.from_pretrained(str(path))), True
    arch = ModelArch.from_config(config)
    # Scaled RoPE tables come from transformers' functions, which need its config object.
    if resolved and arch.rope_type == "default":
        # Best effort: a read-only cache only costs the next start the transformers import again.
        with contextlib.suppress(OSError):
            cached.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(cached, json.dumps(config.to_dict()))
    return config


def load_model(
    path: Path, config: Any, kernels: ModuleType, dtype: torch.dtype, device: torch.device,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """The model in eval mode on ``device``; every parameter must come from the checkpoint. ``tp``: this
    rank's share of it (``LlamaForCausalLM``): the whole checkpoint is read, renamed, stacked and widened as
    for one process, then each tensor cut to this rank's share (``common.model.parallel.shard_rules``)."""
    with torch.device("meta"):  # parameters without storage, until the checkpoint's are assigned
        model = LlamaForCausalLM(config, kernels, tp)
    model.arch.check_dtype(str(dtype).removeprefix("torch."))
    size = model.tp.size
    # The checkpoint's counts: the model holds its rank's share of the heads.
    num_heads, num_kv_heads = int(config.num_attention_heads), model.total_kv_heads
    rules = shard_rules(num_heads, num_kv_heads, model.head_size, model.arch.qk_norm_per_head, model.arch.mla, size)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    image_text = json.loads((path / "config.json").read_text()).get("model_type") in IMAGE_TEXT_TYPES
    if model.classifier is not None and image_text:
        raise ValueError(f"checkpoint {model.classifier}: a sequence classifier of an image-text model is not "
                         "implemented")
    if model.base_model_only and (model.arch.model_type in _OWN_PREFIX_TYPES or image_text):
        raise ValueError(f"checkpoint {model.headless}: a base model without its output head is served for "
                         f"families whose causal LM holds it under 'model.' only, not {model.arch.model_type}")
    state: dict[str, torch.Tensor] = {}
    # Quantized weights kept packed (``common.model.packed_linear``); FP8 ones where float8 converts in hardware.
    packs = bool(getattr(kernels, "PACKS_WEIGHTS", False))
    fp8 = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(safe_open(str(file), framework="pt", device="cpu")) for file in files]
        groups: dict[int | None, list[tuple[Any, str]]] = {}
        for f in opened:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if "rotary_emb.inv_freq" not in name:
                    match = _ANY_LAYER.search(name)
                    groups.setdefault(None if match is None else int(match[1]), []).append((f, name))
        # A layer at a time, read, renamed, stacked and widened, then cut to this rank's share: a rank holds
        # one layer of the whole checkpoint at most beside its shares (not the whole of it).
        for layer in sorted(groups, key=lambda k: -1 if k is None else k):
            part = {name: f.get_tensor(name) for f, name in groups.pop(layer)}
            _prepare(part, model, config, rules, dtype, image_text, packs, fp8)
            if size > 1:
                shard_state(part, rules, model.tp)
            state.update(part)
    from_tokens = classifier_from_tokens(config)
    if from_tokens is not None:
        score_from_tokens(state, model, config, path, *from_tokens)
    checkpoint_dtype = to_packed_layers(model, state, kernels, dtype)
    expected = {n for n, _ in model.named_parameters()}
    if model.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - state.keys()
    unexpected = state.keys() - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if model.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    float32_buffers = {name: model.get_buffer(name) for name in model.float32_buffers()}  # before the cast
    model = model.to(device=device, dtype=dtype).eval()
    for name, buffer in float32_buffers.items():
        module, _, attr = name.rpartition(".")
        model.get_submodule(module).register_buffer(attr, buffer.to(device=device, dtype=torch.float32), persistent=False)
    # What transformers keeps in float32 whatever the dtype (GLM-4.5's router), from the checkpoint's values.
    for name in model.float32_parameters():
        model.get_parameter(name).data = state[name].to(device=device, dtype=torch.float32)
    for name in checkpoint_dtype:  # packed weights' scales, in their own dtypes, which widening computes in
        model.get_parameter(name).data = state[name].to(device=device)
    return model


def score_from_tokens(state: dict[str, torch.Tensor], model: LlamaForCausalLM, config: Any, path: Path,
                      method: str, tokens: list[str]) -> None:
    """In place: a causal LM's output head (or its tied embeddings) made the classifier's ``score``, as vLLM
    makes it (``common.model.loader.classifier_from_tokens``): the tokens' rows, in float32, or for the
    2-way method the true token's row minus the false one's; the output head dropped."""
    from transformers import AutoTokenizer

    if model.classifier is None:
        raise ValueError(f"classifier_from_token ({method}) needs a ...ForSequenceClassification architecture: "
                         "set architectures too")
    arch = model.arch
    for name, value in [("an output-head bias", arch.lm_head_bias), ("logits_scaling", arch.logits_scaling),
                        ("logit_scale", arch.logit_scale), ("a final logit soft-cap", arch.final_soft_cap)]:
        if value:
            raise ValueError(f"classifier_from_token: a model with {name} is not implemented (its score would "
                             "not be its tokens' logits)")
    head = state.pop("lm_head.weight", None)
    if getattr(config, "tie_word_embeddings", False):
        head = state["model.embed_tokens.weight"]
    if head is None:
        raise ValueError("classifier_from_token: the checkpoint has no lm_head.weight (and untied embeddings)")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    unknown = [t for t, i in zip(tokens, ids, strict=True) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"classifier_from_token: {unknown} are not tokens of the model's vocabulary")
    rows = head[ids].float()
    state["score.weight"] = rows[1:2] - rows[0:1] if method == FROM_2_WAY_SOFTMAX else rows


def _prepare(state: dict[str, torch.Tensor], model: LlamaForCausalLM, config: Any, rules: Any, dtype: torch.dtype,
             image_text: bool, packs: bool, fp8: bool) -> None:
    """A part of the checkpoint (one layer's tensors, or those of no layer) as the model names and shapes them,
    whole: widened from 8 or 4 bits (or, with ``packs``, kept packed where ``common.model.packed_linear.packed_layers``
    allows, FP8 weights only with ``fp8`` too; gpt-oss's MXFP4 experts where the ranks' shares are whole groups), the
    vision tower dropped, renamed, split and stacked."""
    model_type = model.arch.model_type
    # The loader reorders or splits q/k rows of these families, across FP8 scales' blocks; KV heads fewer than the
    # ranks are shared by head, not by the ranks' equal shares.
    fp8_attention = not model.arch.rope_interleaved and model.total_kv_heads >= model.tp.size and \
        model_type not in ("gpt_neox", "persimmon", "falcon")

    def ours(prefix: str) -> str:
        """A checkpoint layer's name in this model."""
        return model_name(prefix + ".weight", model_type).removesuffix(".weight")

    def packable(prefix: str, fp8_layer: bool) -> bool:
        """Whether a quantized layer may stay packed, whatever the rest of its stack: not an attention's projection
        of Multi-head Latent Attention (which reads its weights), nor an FP8 one of the families above; not experts
        a checkpoint holds input-major (the loader turns them)."""
        name = ours(prefix)
        if ".self_attn." in name:
            return not model.arch.mla and (fp8_attention or not fp8_layer)
        return not (".experts." in name and model.arch.experts_input_major)

    def packed(kinds: dict[str, Hashable | None]) -> set[str]:
        """Which of these quantized layers (checkpoint prefixes) stay packed (``packed_layers``)."""
        names = {prefix: ours(prefix) for prefix in kinds}
        unquantized = frozenset(ours(n.removesuffix(".weight")) for n in state
                                if n.endswith(".weight") and n + "_scale_inv" not in state)
        return packed_layers(kinds, names, unquantized) if packs else set()

    if model.arch.fp8_weights:  # before anything renames or stacks the weights
        if model.arch.quantization == QUANT_COMPRESSED_TENSORS:
            compressed_fp8_scales(state, dtype)
        scaled = {}  # x.weight's x.weight_scale_inv, or stacked experts' x_scale_inv
        for name in [n for n in state if n.endswith("_scale_inv")]:
            weight = name.removesuffix("_scale_inv")
            if weight not in state:
                raise ValueError(f"checkpoint mismatch: {name} without {weight}")
            scaled[weight] = name
        scaled_layers = {w.removesuffix(".weight"): (w, s) for w, s in scaled.items()
                         if w.endswith((".weight", ".experts.gate_up_proj", ".experts.down_proj"))}
        kept = packed({prefix: fp8_kind(state[w], state[s], ours(prefix), model.tp.size)
                       if fp8 and packable(prefix, True) else None for prefix, (w, s) in scaled_layers.items()})
        for weight, name in scaled.items():
            if weight.removesuffix(".weight") not in kept:
                state[weight] = dequantize_fp8(state[weight], state.pop(name), dtype)
        for name in [n for n in state if n.endswith((".activation_scale", ".input_scale"))]:
            raise ValueError(f"checkpoint mismatch: {name}: static activation scales are not implemented")
    if model.arch.int_weights is not None:
        layers = int_weight_layers(state, model.arch.int_weights)
        kept = packed({prefix: int_kind(values, ours(prefix), model.tp.size) if packable(prefix, False) else None
                       for prefix, values in layers.items()})
        for prefix, values in layers.items():
            if prefix in kept:
                pack_values(state, prefix, values)
            else:
                state[prefix + ".weight"] = values.widen().to(dtype)
    if image_text:
        for name in [n for n in state if _VISION_NAMES.match(n)]:
            del state[name]
        _rename(state, _LANGUAGE_MODEL_NAMES)
    if model.base_model_only:  # a base model's names lack the causal LM's prefix (``load_model`` checked it)
        for name in [n for n in state if not n.startswith("model.")]:
            state["model." + name] = state.pop(name)
    if model.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _rename(state, _RENAMES.get(model.arch.model_type, ()))
    # GLM-4.5's checkpoints hold its multi-token-prediction layers after the model's own: not run here.
    num_heads, num_kv_heads, size = int(config.num_attention_heads), model.total_kv_heads, model.tp.size
    num_layers, mtp = int(config.num_hidden_layers), int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    for name in [n for n in state if mtp and (m := _LAYER.match(n)) and num_layers <= int(m[1]) < num_layers + mtp]:
        del state[name]
    if model.arch.model_type in ("gpt_neox", "persimmon", "falcon"):  # grouped by kv head: one group per head
        # but in Falcon's multi-query and new layouts
        split_neox_qkv(state, num_heads, model.head_size, num_kv_heads)
    # Multi-head Latent Attention's q_proj (DeepSeek-V2-Lite's) is a projection of its own, stacked with nothing.
    mla_queries = {n: state.pop(n) for n in [n for n in state if ".self_attn.q_proj." in n]} if model.arch.mla else {}
    stack_projections(state)
    state.update(mla_queries)
    stack_head_norms(state)
    stack_experts(state)
    if model.arch.rope_interleaved and model.arch.mla:
        deinterleave_mla_rope(state, num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank)
    elif model.arch.rope_interleaved:
        deinterleave_rope(state, num_heads, num_kv_heads, model.head_size, model.arch.rotary_dim)
    for name in [n for n in state if n.endswith(".gate.e_score_correction_bias")]:
        state[name] = state[name].reshape(-1)  # ERNIE 4.5's is [1, experts]
    if model.arch.quantization == QUANT_MXFP4:
        for name in [n for n in state if n.endswith("_blocks")]:
            base = name.removesuffix("_blocks")
            blocks, scales = state.pop(name), state.pop(base + "_scales")
            # Kept packed, each row's bytes in one run, where the ranks would split the inputs by whole groups.
            if packs and blocks.dim() == 4 and blocks.shape[:-1] == scales.shape and \
                    (not base.endswith(".down_proj") or scales.shape[2] % model.tp.size == 0):
                state[name], state[base + "_scales"] = blocks.flatten(2), scales
            else:
                state[base] = dequantize_mxfp4(blocks, scales, dtype)
    if model.arch.model_type == "gpt_oss":
        gpt_oss_experts(state)
    # Qwen3-VL-MoE as released: [E, H, 2I] and [E, I, H], turned where so; Llama 4's always so.
    if model.arch.experts_input_major:
        for name in [n for n in state if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
            try:
                own = model.get_parameter(name).shape
            except AttributeError:  # not the model's: the check after every part names it
                continue
            whole = own if (shard := shard_of(rules, name)) is None else shard.full_shape(own, size)  # the checkpoint's
            if (model.arch.model_type == "llama4_text" or state[name].shape != whole) and \
                    state[name].transpose(1, 2).shape == whole:
                state[name] = state[name].transpose(1, 2).contiguous()


def model_name(checkpoint_name: str, model_type: str) -> str:
    """A checkpoint's name for a weight as this model names it (before any stacking): an image-text
    checkpoint's language-model prefix dropped, then the family's renames (LoRA adapters' module names)."""
    name = checkpoint_name
    for pattern, ours in (*_LANGUAGE_MODEL_NAMES, *_RENAMES.get(model_type, ())):
        name = re.sub(pattern, ours, name)
    return name


def _rename(state: dict[str, torch.Tensor], rules: tuple[tuple[str, str], ...]) -> None:
    """In place: each name with every rule (pattern, replacement) applied in turn."""
    for name in list(state) if rules else []:
        new = name
        for pattern, ours in rules:
            new = re.sub(pattern, ours, new)
        if new != name:
            state[new] = state.pop(name)


def stack_projections(state: dict[str, torch.Tensor]) -> None:
    """In place: each layer's checkpoint projections that the model computes as one product
    (``FUSED_PROJECTIONS``: q, k, v; gate, up) stacked into that product's weight and bias, in order.
    A layer that has some of a group's parts but not all is a broken checkpoint, named as such."""
    for fused, parts in FUSED_PROJECTIONS.items():
        first = f".{parts[0]}."
        for name in [n for n in state if first in n]:
            prefix, _, kind = name.rpartition(first)
            names = [f"{prefix}.{part}.{kind}" for part in parts]
            missing = [n for n in names if n not in state]
            if missing:
                raise ValueError(f"checkpoint mismatch: {name} without {', '.join(missing)}")
            if kind == "g_idx":  # packed weights' inputs' groups: the parts read one input, alike
                orders = [state.pop(n) for n in names]
                if any(not torch.equal(order, orders[0]) for order in orders):
                    raise ValueError(f"checkpoint mismatch: {prefix}.{fused}'s parts order their groups differently")
                state[f"{prefix}.{fused}.{kind}"] = orders[0]
                continue
            state[f"{prefix}.{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])


def split_neox_qkv(state: dict[str, torch.Tensor], num_heads: int, head_size: int, num_kv_heads: int | None = None) -> None:
    """In place: a fused ``query_key_value`` split into ``q_proj``, ``k_proj`` and ``v_proj`` (rows head by head
    within each), weight and bias. Its rows are grouped by kv head, each group its queries, then its k, then
    its v: GPT-NeoX's and Persimmon's (and Falcon's multi-head layout) a group per head, head by head, each
    head's q, k and v in turn; Falcon's new layout a group per kv head; its multi-query one a single group,
    every query, then the one k and v."""
    groups = num_kv_heads or num_heads
    per_group = num_heads // groups
    for name in [n for n in state if ".self_attn.query_key_value." in n]:
        prefix, _, kind = name.rpartition(".query_key_value.")
        fused = state.pop(name)
        if kind == "g_idx":  # packed weights' inputs' groups: every part reads the one input
            for part in ("q_proj", "k_proj", "v_proj"):
                state[f"{prefix}.{part}.{kind}"] = fused
            continue
        if fused.shape[0] != (num_heads + 2 * groups) * head_size:
            raise ValueError(f"checkpoint mismatch: {name} has {fused.shape[0]} rows, not ({num_heads} + 2 x {groups}) "
                             f"heads x {head_size}")
        grouped = fused.reshape(groups, per_group + 2, head_size, *fused.shape[1:])
        for part, rows in (("q_proj", grouped[:, :per_group]), ("k_proj", grouped[:, -2]), ("v_proj", grouped[:, -1])):
            state[f"{prefix}.{part}.{kind}"] = rows.reshape(-1, *fused.shape[1:]).contiguous()


def stack_head_norms(state: dict[str, torch.Tensor]) -> None:
    """In place: norms kept one per head (``<norm>.heads.<i>.weight``, StableLM's q/k LayerNorms) stacked
    into the norm's weight per head, ``[heads, width]`` (heads in order; a gap is a broken checkpoint)."""
    per_norm: dict[str, dict[int, torch.Tensor]] = {}
    for name in [n for n in state if ".heads." in n]:
        norm, _, rest = name.partition(".heads.")
        head, _, kind = rest.partition(".")
        if kind != "weight" or not head.isdigit():
            raise ValueError(f"checkpoint mismatch: {name}: a per-head norm holds only a weight per head")
        per_norm.setdefault(norm, {})[int(head)] = state.pop(name)
    for norm, heads in per_norm.items():
        if sorted(heads) != list(range(len(heads))):
            raise ValueError(f"checkpoint mismatch: {norm} has the norms of heads {sorted(heads)}")
        state[f"{norm}.weight"] = torch.stack([heads[i] for i in range(len(heads))])


def deinterleave_rope(state: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int, head_size: int,
                      rotary_dim: int | None) -> None:
    """In place: each layer's stacked q and k rows (``qkv_proj`` weight and bias) reordered within each head
    so that a RoPE over interleaved pairs (entries 2i and 2i+1 turned by the i-th frequency: GLM, Helium,
    ERNIE 4.5) becomes the rotation of halves the kernels compute (entries i and i + rotary_dim / 2): each
    head's first ``rotary_dim`` rows (all of them by default) even ones first, then odd ones; rows past
    them, and v's, stay. Every rotated entry is computed from the same two numbers with the same
    operations, and attention reads q and k only through q . k, a sum over the same products in another
    order, so the model is the same; its K cache holds each head's entries in this order. Norms of q and k
    before RoPE (Cohere's) see each head's entries reordered and their weights reordered with them."""
    rotary = rotary_dim or head_size
    within = torch.cat((torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, head_size)))
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    order = torch.cat((
        (torch.arange(num_heads)[:, None] * head_size + within).reshape(-1),  # q
        q_size + (torch.arange(num_kv_heads)[:, None] * head_size + within).reshape(-1),  # k
        torch.arange(q_size + kv_size, q_size + 2 * kv_size),  # v, as it is
    ))
    for name in [n for n in state if ".self_attn.qkv_proj." in n and not n.endswith(".g_idx")]:  # rows, not inputs
        state[name] = state[name][order].contiguous()
    # q and k norms' weights (one per head, per head shared, or across all heads) follow their entries.
    for name in [n for n in state if n.endswith((".self_attn.q_norm.weight", ".self_attn.k_norm.weight"))]:
        weight = state[name]
        state[name] = weight.reshape(-1, head_size)[:, within].reshape(weight.shape).contiguous()


def deinterleave_mla_rope(state: dict[str, torch.Tensor], num_heads: int, nope_dim: int, rope_dim: int,
                          kv_lora_rank: int) -> None:
    """In place: Multi-head Latent Attention's rotated rows reordered as ``deinterleave_rope`` reorders other
    families' (each pair's even entry first, then the odd ones), so that the kernels' rotation of halves turns
    the same pairs: each head's last ``rope_dim`` rows of the queries (``q_proj`` or ``q_b_proj``), and the shared
    key's rows of ``kv_a_proj_with_mqa`` (those after the latent's ``kv_lora_rank``), weight and bias. DeepSeek-V3's
    transformers code rotates by even and odd entries and leaves them so (``rope_interleave``): the same numbers
    in the same order; DeepSeek-V2's rotates them as complex numbers, each pair turned in place, which this
    order holds elsewhere, and attention reads q and k only through q . k."""
    within = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    head = torch.cat((torch.arange(nope_dim), nope_dim + within))
    q_order = (torch.arange(num_heads)[:, None] * (nope_dim + rope_dim) + head).reshape(-1)
    kv_order = torch.cat((torch.arange(kv_lora_rank), kv_lora_rank + within))
    for name in [n for n in state if n.endswith((".self_attn.q_proj.weight", ".self_attn.q_b_proj.weight"))]:
        state[name] = state[name][q_order].contiguous()
    for name in [n for n in state if ".self_attn.kv_a_proj_with_mqa." in n]:
        state[name] = state[name][kv_order].contiguous()


def stack_experts(state: dict[str, torch.Tensor]) -> None:
    """In place: each mixture's experts, one weight per expert and projection in the checkpoint
    (``...experts.<e>.gate_up_proj.weight`` once ``stack_projections`` has stacked its gate and up), stacked
    into ``Experts``' ``[E, ...]`` parameters in expert order; packed weights' tensors too (``.qweight``,
    ``.weight_scale_inv``: ``gate_up_proj_qweight``, ``gate_up_proj_scale_inv``). A checkpoint that holds them
    stacked already (transformers' own layout) is left as it is; one that lacks an expert is named as broken."""
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for name in state:
        match = _EXPERT.match(name)
        if match:
            kind = match["kind"] + _STACKED_EXPERT_TENSORS[match["tensor"]]
            groups.setdefault((match["prefix"], kind), {})[int(match["index"])] = name
    for (prefix, kind), experts in groups.items():
        missing = sorted(set(range(max(experts) + 1)) - experts.keys())
        if missing:
            raise ValueError(f"checkpoint mismatch: {prefix} lacks {kind} of experts {missing[:5]}")
        state[f"{prefix}.{kind}"] = torch.stack([state.pop(experts[e]) for e in range(len(experts))])


def gpt_oss_experts(state: dict[str, torch.Tensor]) -> None:
    """In place: gpt-oss's experts as ``Experts`` holds them. Its checkpoints keep each projection's
    weight input-major (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``) and the gate and up
    columns interleaved (gate, up, gate, up, ...), biases too: transposed here, and the gate's columns put
    before the up's. MXFP4 weights kept packed (``_blocks``, ``_scales``: a row per output already) have their
    gate and up rows put so too."""
    for name in [n for n in state if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        state[name] = state[name].transpose(1, 2)  # [E, 2I, H] (rows interleaved), [E, H, I]
    for name in [n for n in state if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_proj_bias",
                                                 ".mlp.experts.gate_up_proj_blocks", ".mlp.experts.gate_up_proj_scales"))]:
        rows = state[name]
        state[name] = torch.cat((rows[:, 0::2], rows[:, 1::2]), dim=1)
    for name in [n for n in state if ".mlp.experts." in n]:
        state[name] = state[name].contiguous()
