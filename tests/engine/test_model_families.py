"""Each supported family and config feature (mixtures of experts among them), on a tiny random-weight checkpoint: greedy output equals
transformers ``generate`` over a prompt longer than the sliding window, through one engine (chunked
prefill with chunks ending inside blocks and windows, a batch of two) and through prefill -> KV
hand-off -> decode."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.model.arch import (
    ROUTER_SIGMOID,
    ROUTER_SIGMOID_GROUPS,
    ROUTER_SIGMOID_SCALED_INPUT,
    ROUTER_SOFTMAX_TOPK,
    ROUTER_TOPK_SOFTMAX,
    ROUTER_TOPK_SOFTMAX_BIASED,
    ModelArch,
)
from common.model.llama import LlamaForCausalLM
from common.model.weights import load_hf_config
from common.sampling_params import SamplingParams
from pdserve_kernels import get_kernels
from pdserve_kernels.reference import NORM_GEMMA, NORM_LAYER, NORM_LLAMA, NORM_OLMO
from tests.engine.test_disaggregated_lifecycle import _drain, _transfer
from tests.engine.tiny_models import (
    WINDOW,
    build_checkpoint,
    family_configs,
    hf_greedy,
    hf_model,
    prompt_token_ids,
)

MAX_NEW_TOKENS = 10
PROMPT_LEN = 2 * WINDOW + 7  # longer than the window, ending inside a block
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
FAMILIES = sorted(family_configs())
WINDOWED = [name for name in FAMILIES if "window" in name or "layer-types" in name]
MIXTURES = [name for name in FAMILIES if "moe" in name]
INTERLEAVED = [name for name in FAMILIES if "interleaved" in name]
IMAGE_TEXT = [name for name in FAMILIES if "image-text" in name]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("families")

    @functools.cache
    def build(name: str) -> Path:
        return build_checkpoint(family_configs()[name], root / name)

    return build


@functools.cache
def _expected(folder: Path, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(folder, list(prompt), MAX_NEW_TOKENS)


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Engines a test builds; afterwards every block must be back and each pool sound."""
    built: list[LLMEngine] = []
    yield built
    for engine in built:
        engine.check_integrity()
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks, "blocks leaked"


def _engine(engines: list[LLMEngine], folder: Path, **overrides: object) -> LLMEngine:
    config = {"model": str(folder), "block_size": 8, "num_blocks": 64, "max_num_batched_tokens": 5,
              "device": "cpu", "dtype": "float32"}
    config.update(overrides)
    engine = LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]
    engines.append(engine)
    return engine


def test_windowed_families_have_the_layers_their_config_asks_for() -> None:
    configs = family_configs()
    arch = {name: ModelArch.from_config(configs[name]) for name in FAMILIES}
    assert arch["mistral-window"].sliding_windows == (WINDOW, WINDOW, WINDOW)
    assert arch["phi3-window"].sliding_windows == (WINDOW, WINDOW, WINDOW)
    gemma3 = arch["gemma3-window-rope-per-type"]
    assert gemma3.sliding_windows == (WINDOW, None, WINDOW) and gemma3.qk_norm and gemma3.sandwich_norms
    assert gemma3.rope_layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert arch["qwen2-window-layers"].sliding_windows == (None, WINDOW, WINDOW)  # i >= max_window_layers
    assert arch["qwen3-layer-types-bias"].sliding_windows == (WINDOW, None, WINDOW)
    assert arch["qwen3-qk-norm"].qk_norm and arch["qwen3-qk-norm"].sliding_windows == (None,) * 3
    assert arch["qwen3-layer-types-bias"].o_bias and arch["llama-bias"].mlp_bias
    assert arch["qwen2-window-layers"].qkv_bias and not arch["qwen2-window-layers"].o_bias
    granite = arch["granite-scalings"]
    assert (granite.embedding_multiplier, granite.attention_multiplier, granite.residual_multiplier,
            granite.logits_scaling) == (3.0, 0.1, 0.5, 2.0)
    assert granite.o_bias and granite.sliding_windows == (None,) * 3
    assert arch["llama-bias"].residual_multiplier is None  # only Granite reads them
    assert arch["smollm3-nope"].no_rope_layers == (1,) and arch["smollm3-nope"].sliding_windows == (None,) * 3
    assert arch["smollm3-nope-window"].sliding_windows == (None, WINDOW, None)
    assert arch["llama-bias"].no_rope_layers == ()
    assert arch["ministral-window-layers"].sliding_windows == (WINDOW, None, WINDOW)
    seed = arch["seed-oss-biases"]
    assert seed.qkv_bias and not seed.o_bias and seed.mlp_bias
    assert arch["internlm3-bias"].o_bias and arch["internlm3-bias"].mlp_bias
    assert arch["arcee-relu2"].activation == "relu2" and arch["llama-bias"].activation == "silu"
    hunyuan = arch["hunyuan-qk-norm-ntk-alpha"]
    assert hunyuan.qk_norm_after_rope and not hunyuan.qk_norm and hunyuan.rope_type == "ntk_alpha"
    gemma = arch["gemma2-window-softcap"]
    assert gemma.sliding_windows == (WINDOW, None, WINDOW) and gemma.sandwich_norms
    olmo2, olmo3 = arch["olmo2-post-norms"], arch["olmo3-window-rope-per-type"]
    for olmo in (olmo2, olmo3):
        assert olmo.post_norms_only and olmo.qk_norm_full_width and not olmo.qk_norm and not olmo.sandwich_norms
        assert olmo.norm_form == NORM_OLMO and not olmo.mlp_bias
    assert olmo2.qkv_bias and olmo2.o_bias and not olmo3.qkv_bias  # attention_bias, as the configs say
    assert olmo2.sliding_windows == (None,) * 3 and olmo2.rope_layer_types is None
    assert olmo3.sliding_windows == (WINDOW, None, WINDOW) and olmo3.rope_type == "scaled"
    assert arch["llama-bias"].norm_form == NORM_LLAMA and gemma.norm_form == NORM_GEMMA
    mixtral, qwen3_moe = arch["mixtral-moe-window"], arch["qwen3-moe-dense-layer"]
    qwen2_moe, olmoe = arch["qwen2-moe-shared-expert"], arch["olmoe-qk-norm"]
    assert (mixtral.moe_layers, mixtral.num_experts, mixtral.experts_per_token) == ((0, 1, 2), 4, 2)
    assert mixtral.norm_topk_prob and mixtral.routing_weights_float32 and mixtral.sliding_windows == (WINDOW,) * 3
    assert mixtral.moe_intermediate_size == 128  # Mixtral's experts are intermediate_size wide
    assert qwen3_moe.moe_layers == (0, 2) and qwen3_moe.moe_intermediate_size == 32 and qwen3_moe.qk_norm
    assert qwen3_moe.norm_topk_prob and not qwen3_moe.routing_weights_float32
    assert qwen3_moe.sliding_windows == (None,) * 3
    assert (qwen2_moe.num_experts, qwen2_moe.experts_per_token, qwen2_moe.shared_expert_intermediate_size) == (6, 3, 48)
    assert not qwen2_moe.norm_topk_prob and qwen2_moe.qkv_bias and not qwen2_moe.o_bias
    assert qwen2_moe.sliding_windows == (None,) * 3  # use_sliding_window off: its config's window is 0
    assert olmoe.qk_norm_full_width and not olmoe.post_norms_only and olmoe.norm_form == NORM_LLAMA
    assert olmoe.qkv_bias and olmoe.o_bias and olmoe.moe_layers == (0, 1, 2)
    granite_moe, granite_shared = arch["granitemoe-scalings"], arch["granitemoeshared-shared-expert"]
    assert granite_moe.router == ROUTER_TOPK_SOFTMAX and not granite_moe.norm_topk_prob
    assert mixtral.router == ROUTER_SOFTMAX_TOPK and mixtral.rotary_dim is None
    glm = arch["glm4-moe-partial-rope-groups"]
    assert glm.router == ROUTER_SIGMOID_GROUPS and (glm.num_expert_groups, glm.topk_groups) == (2, 1)
    assert glm.moe_layers == (1, 2) and glm.moe_intermediate_size == 32 and glm.shared_expert_intermediate_size == 32
    assert glm.rotary_dim == 8 and glm.qk_norm and glm.qkv_bias and not glm.o_bias
    assert glm.routing_weights_float32 and glm.routed_scaling_factor == 2.5 and not glm.shared_expert_gated
    flex = arch["flex-olmo-moe-post-norms"]
    assert flex.post_norms_only and flex.qk_norm_full_width and flex.norm_form == NORM_OLMO
    assert flex.router == ROUTER_SOFTMAX_TOPK and flex.norm_topk_prob and flex.moe_layers == (0, 1, 2)
    hunyuan_moe = arch["hunyuan-moe-shared-mlp"]
    assert hunyuan_moe.qk_norm_after_rope and hunyuan_moe.rope_type == "ntk_alpha" and hunyuan_moe.norm_topk_prob
    assert hunyuan_moe.shared_expert_intermediate_size == 128 and not hunyuan_moe.shared_expert_gated
    dots = arch["dots1-moe-window"]
    assert dots.router == ROUTER_SIGMOID_GROUPS and dots.qk_norm and dots.rotary_dim is None
    assert dots.moe_layers == (1, 2) and dots.shared_expert_intermediate_size == 64 and dots.o_bias
    assert dots.sliding_windows == (WINDOW, None, WINDOW) and dots.routed_scaling_factor == 1.5
    oss = arch["gpt-oss-moe-sinks-window"]
    assert oss.attention_sinks and oss.expert_bias and oss.expert_activation == "gpt_oss"
    assert (oss.swiglu_alpha, oss.swiglu_limit) == (1.702, 1.5) and oss.router == ROUTER_TOPK_SOFTMAX_BIASED
    assert oss.sliding_windows == (WINDOW, None, WINDOW) and oss.qkv_bias and oss.o_bias
    assert not arch["llama-bias"].attention_sinks
    llama4 = arch["llama4-moe-chunked-nope-qk-norm"]
    assert llama4.attention_chunks == (WINDOW, None, WINDOW) and llama4.no_rope_layers == (1,)
    assert llama4.qk_norm_weightless_after_rope and not llama4.qk_norm and llama4.query_temperature == (4.0, 0.5)
    assert llama4.router == ROUTER_SIGMOID_SCALED_INPUT and llama4.moe_layers == (0, 2) and llama4.mlp_width == 96
    assert llama4.moe_intermediate_size == llama4.shared_expert_intermediate_size == 48 and llama4.rope_interleaved
    assert all(not arch[name].attention_chunks for name in FAMILIES if not name.startswith("llama4"))
    minimax = arch["minimax-m2-moe-partial-rope"]
    assert minimax.router == ROUTER_SIGMOID and minimax.rotary_dim == 8 and minimax.qk_norm_full_width
    assert minimax.norm_topk_prob and minimax.moe_layers == (0, 1, 2) and minimax.moe_intermediate_size == 128
    assert not (minimax.qkv_bias or minimax.o_bias or minimax.qk_norm or minimax.shared_expert_intermediate_size)
    assert granite_moe.residual_multiplier == 0.5 and granite_moe.embedding_multiplier == 3.0
    assert granite_moe.shared_expert_intermediate_size == 0 and granite_moe.o_bias
    assert granite_shared.shared_expert_intermediate_size == 48 and not granite_shared.shared_expert_gated
    assert qwen2_moe.shared_expert_gated
    assert arch["llama-bias"].moe_layers == () and arch["llama-bias"].num_experts == 0
    assert (gemma.attn_soft_cap, gemma.final_soft_cap, gemma.query_pre_attn_scalar) == (2.0, 3.0, 24.0)
    olmo1 = arch["olmo-layernorm-no-weights-clip-qkv"]
    assert olmo1.norm_form == NORM_LAYER and olmo1.norm_weightless and not olmo1.norm_bias and olmo1.norm_eps == 1e-5
    assert olmo1.clip_qkv == 1.5 and olmo1.qkv_bias and olmo1.o_bias and not olmo1.mlp_bias
    assert olmo1.rope_float32 and olmo1.rope_tables_float32 and not olmo1.post_norms_only
    assert arch["llama-bias"].clip_qkv is None and not arch["llama-bias"].norm_weightless
    persimmon = arch["persimmon-qk-layernorm-partial-rope-relu2"]
    assert persimmon.qk_norm and persimmon.qk_norm_bias and not persimmon.qk_norm_per_head
    assert persimmon.norm_form == NORM_LAYER and persimmon.norm_bias and persimmon.rotary_dim == 8
    assert persimmon.activation == "relu2" and persimmon.qkv_bias and persimmon.o_bias and persimmon.mlp_bias
    assert not arch["persimmon-no-qk-layernorm"].qk_norm and arch["persimmon-no-qk-layernorm"].rotary_dim == 4
    falcon_two, falcon_one = arch["falcon-new-arch-grouped-qkv-two-norms"], arch["falcon-new-arch-one-norm"]
    falcon_mq, falcon_seq = arch["falcon-multi-query-parallel"], arch["falcon-sequential-bias"]
    assert falcon_two.parallel_block and falcon_two.parallel_sum_first and falcon_two.parallel_mlp_norm
    assert falcon_one.parallel_block and falcon_one.parallel_sum_first and not falcon_one.parallel_mlp_norm
    assert falcon_mq.parallel_block and not falcon_mq.parallel_mlp_norm and not falcon_mq.qkv_bias
    assert not falcon_seq.parallel_block and falcon_seq.qkv_bias and falcon_seq.mlp_bias
    assert {a.mlp_width for a in (falcon_two, falcon_one, falcon_mq, falcon_seq)} == {128}
    assert falcon_two.activation == "gelu" and falcon_two.norm_bias and falcon_two.rotary_dim is None


@pytest.mark.parametrize("name", WINDOWED)
def test_the_window_changes_transformers_output_so_the_tests_can_see_it(checkpoint, name: str) -> None:  # type: ignore[no-untyped-def]
    """Guards the tests below: with full attention the same weights give other tokens."""
    from transformers import AutoConfig

    folder = checkpoint(name)
    full = AutoConfig.from_pretrained(str(folder))
    full.sliding_window = 10_000  # longer than any sequence here (Gemma 2 needs a value)
    full.layer_types = ["full_attention"] * full.num_hidden_layers
    prompt = prompt_token_ids(PROMPT_LEN)
    assert hf_greedy(folder, prompt, MAX_NEW_TOKENS, config=full) != _expected(folder, tuple(prompt))


def test_attention_soft_capping_changes_transformers_output_so_the_tests_can_see_it(checkpoint) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    folder = checkpoint("gemma2-window-softcap")
    prompt = prompt_token_ids(PROMPT_LEN)
    uncapped = AutoConfig.from_pretrained(str(folder))
    uncapped.attn_logit_softcapping = None
    assert hf_greedy(folder, prompt, MAX_NEW_TOKENS, config=uncapped) != _expected(folder, tuple(prompt))


def _changes_transformers_logits(folder: Path, change_config: Callable[[Any], None] | None = None,
                                 change_model: Callable[[Any], None] | None = None) -> bool:
    """Whether transformers' logits over the test prompt move (by more than 1e-2) when the checkpoint's
    config is changed by ``change_config``, or its loaded model by ``change_model``: a guard that the
    equality tests below could see that feature done wrong."""
    from transformers import AutoConfig

    prompt = torch.tensor([prompt_token_ids(PROMPT_LEN)])
    config = AutoConfig.from_pretrained(str(folder))
    if change_config is not None:
        change_config(config)
    with torch.inference_mode():
        models = [hf_model(folder, **kw)
                  for kw in ({}, {"config": config})]
        if change_model is not None:
            change_model(models[1])
        logits = [model(prompt).logits for model in models]
    return bool((logits[0] - logits[1]).abs().max() > 1e-2)


@pytest.mark.parametrize("scaling", ["embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                     "logits_scaling"])
def test_each_granite_scaling_changes_transformers_logits_so_the_tests_can_see_it(checkpoint, scaling: str) -> None:  # type: ignore[no-untyped-def]
    assert _changes_transformers_logits(checkpoint("granite-scalings"), lambda c: setattr(c, scaling, 1.0))


def test_a_layer_without_rope_changes_transformers_logits_so_the_tests_can_see_it(checkpoint) -> None:  # type: ignore[no-untyped-def]
    assert _changes_transformers_logits(checkpoint("smollm3-nope"), lambda c: setattr(c, "no_rope_layers", [1, 1, 1]))


@pytest.mark.parametrize("name", MIXTURES)
def test_the_routing_changes_transformers_logits_so_the_tests_can_see_it(checkpoint, name: str) -> None:  # type: ignore[no-untyped-def]
    """Routed to one expert fewer, the same weights give other logits."""
    def fewer(config: Any) -> None:
        text = getattr(config, "text_config", None) or config  # an image-text wrapper's language model
        text.num_experts_per_tok -= 1

    assert _changes_transformers_logits(checkpoint(name), fewer)


def _no_correction_bias(model: Any) -> None:
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()


def _no_ernie_correction_bias(model: Any) -> None:
    for layer in model.model.layers[1:]:
        layer.mlp.gate.moe_statics.e_score_correction_bias.zero_()


def _no_afmoe_expert_bias(model: Any) -> None:
    for layer in model.model.layers[1:]:
        layer.mlp.expert_bias.zero_()


def _no_qk_norm_bias(model: Any) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_layernorm.bias.zero_()
        layer.self_attn.k_layernorm.bias.zero_()


def _no_sinks(model: Any) -> None:
    for layer in model.model.layers:
        layer.self_attn.sinks.fill_(-1e4)


@pytest.mark.parametrize(("name", "change_config", "change_model"), [
    ("glm4-moe-partial-rope-groups",
     lambda c: setattr(c, "rope_parameters", {**c.rope_parameters, "partial_rotary_factor": 1.0}), None),
    ("glm4-moe-partial-rope-groups", lambda c: setattr(c, "topk_group", 2), None),
    ("glm4-moe-partial-rope-groups", None, _no_correction_bias),
    ("gpt-oss-moe-sinks-window", lambda c: setattr(c, "swiglu_limit", 1e6), None),
    ("gpt-oss-moe-sinks-window", None, _no_sinks),
    ("ernie4_5-moe-interleaved-rope-shared", None, _no_ernie_correction_bias),
    ("glm-interleaved-partial-rope",
     lambda c: setattr(c, "rope_parameters", {**c.rope_parameters, "partial_rotary_factor": 1.0}), None),
    ("ministral3-query-scale-yarn",
     lambda c: setattr(c, "rope_parameters", {**c.rope_parameters, "llama_4_scaling_beta": 0.0}), None),
    ("afmoe-moe-gated-attention-window", lambda c: setattr(c, "mup_enabled", False), None),
    ("afmoe-moe-gated-attention-window", None, _no_afmoe_expert_bias),
    ("afmoe-moe-gated-attention-window", lambda c: setattr(c, "route_scale", 1.0), None),
    ("olmo-layernorm-no-weights-clip-qkv", lambda c: setattr(c, "clip_qkv", None), None),
    ("persimmon-qk-layernorm-partial-rope-relu2", None, _no_qk_norm_bias),
    ("persimmon-qk-layernorm-partial-rope-relu2",
     lambda c: setattr(c, "rope_parameters", {**c.rope_parameters, "partial_rotary_factor": 1.0}), None),
    ("llama4-moe-chunked-nope-qk-norm", lambda c: setattr(c, "attention_chunk_size", 10_000), None),
    ("llama4-moe-chunked-nope-qk-norm", lambda c: setattr(c, "attn_temperature_tuning", False), None),
    ("llama4-moe-chunked-nope-qk-norm", lambda c: setattr(c, "use_qk_norm", False), None),
    ("llama4-moe-chunked-nope-qk-norm", lambda c: setattr(c, "no_rope_layers", [1, 1, 1]), None),
], ids=["glm-full-rope", "glm-all-groups", "glm-no-correction-bias", "gpt-oss-no-clamp", "gpt-oss-no-sinks",
        "ernie-no-correction-bias", "glm-dense-full-rope", "ministral3-no-query-scale", "afmoe-no-mup",
        "afmoe-no-expert-bias", "afmoe-unscaled-routes", "olmo-no-clip-qkv", "persimmon-no-qk-norm-bias",
        "persimmon-full-rope", "llama4-unchunked", "llama4-no-temperature", "llama4-no-qk-norm", "llama4-rope-everywhere"])
def test_glm_s_and_gpt_oss_s_features_each_change_transformers_logits(checkpoint, name, change_config, change_model) -> None:  # type: ignore[no-untyped-def]
    """GLM-4.5's partial RoPE, groups and correction bias, gpt-oss's clamp and sinks, OLMo 1's clamp of q, k and v,
    Persimmon's q/k norms' bias and partial RoPE, and Llama 4's chunks, temperature, q/k norms and layer without
    RoPE, each undone."""
    assert _changes_transformers_logits(checkpoint(name), change_config, change_model)


@pytest.mark.parametrize("name", IMAGE_TEXT)
def test_an_image_text_checkpoint_serves_its_language_model_alone(checkpoint, name: str) -> None:
    """Its vision tower and projector are in the checkpoint and left unloaded; whether the head shares the
    embedding is the wrapper's word, as transformers reads it (Mistral 3's text config says the opposite)."""
    from safetensors import safe_open

    from common.model.weights import load_model
    from pdserve_kernels import reference

    folder = checkpoint(name)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert any(key.startswith(("vision_tower.", "multi_modal_projector.", "visual.", "model.visual."))
                   for key in f.keys())  # noqa: SIM118
    wrapper = family_configs()[name]
    config = load_hf_config(folder)
    assert config.model_type == wrapper.text_config.model_type
    assert ModelArch.from_config(config).model_type == {
        "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe"}.get(config.model_type,
                                                                                                 config.model_type)
    assert config.tie_word_embeddings == wrapper.tie_word_embeddings
    if name.startswith("mistral3"):
        assert not config.tie_word_embeddings and family_configs()[name].text_config.tie_word_embeddings
    model = load_model(folder, config, reference, torch.float32, torch.device("cpu"))
    assert not any("vision" in n or "projector" in n for n, _ in model.named_parameters())
    hf = hf_model(folder)
    head = getattr(hf, "lm_head", None) or hf.language_model.lm_head  # Llama 4's: its language model's
    assert torch.equal(model.lm_head.weight, head.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_widens_to_transformers_own_bits(dtype: torch.dtype) -> None:
    """Every byte (two codes) under scales from 2**-127 to 2**127, against transformers' dequantization."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from common.model.quantization import dequantize_mxfp4

    gen = torch.Generator().manual_seed(5)
    blocks = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=gen)].reshape(2, 4, 2, 16)
    scales = torch.tensor([0, 1, 60, 100, 126, 127, 128, 140, 200, 254, 120, 130, 127, 3, 250, 90],
                          dtype=torch.uint8).reshape(2, 4, 2)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert got.shape == (2, 64, 4) and got.dtype == dtype
    assert torch.equal(got, convert_moe_packed_tensors(blocks, scales, dtype=dtype))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, scales[..., :1], dtype)


@pytest.mark.parametrize(("name", "quantization"), [
    ("gpt-oss-moe-sinks-window", "mxfp4"), ("llama-bias", "fp8"), ("qwen3-moe-dense-layer", "fp8"),
    ("qwen3-moe-dense-layer", "fp8-experts-one-by-one"), ("deepseek-v3-mla-moe-yarn", "fp8"),
])
def test_a_quantized_checkpoint_equals_transformers_dequantized(checkpoint, engines, tmp_path, name: str,  # type: ignore[no-untyped-def]
                                                                quantization: str) -> None:
    """A checkpoint quantized as released: gpt-oss's experts in MXFP4, or block-wise FP8 weights (a dense model
    with biases, and a mixture's experts, stacked or one weight per expert). Logits over the prompt and greedy
    output through the engine equal transformers' with its quantization config's ``dequantize=True``, which the
    quantization moved from the unquantized model's."""
    from transformers import FineGrainedFP8Config, Mxfp4Config

    from common.model.llama import Experts
    from common.model.packed_linear import Fp8Linear
    from common.model.weights import load_model
    from pdserve_kernels import reference, triton_ops
    from tests.engine.tiny_models import experts_one_by_one, fp8_checkpoint, mxfp4_checkpoint

    source = checkpoint(name)
    if quantization.endswith("-experts-one-by-one"):
        quantization, source = "fp8", experts_one_by_one(source, tmp_path / "one-by-one")
    quantize, config = {"mxfp4": (mxfp4_checkpoint, Mxfp4Config), "fp8": (fp8_checkpoint, FineGrainedFP8Config)}[quantization]
    # DeepSeek's latent widths (24, 40) in blocks of 8.
    folder = quantize(source, tmp_path / quantization, **({"block": 8} if name.startswith("deepseek") else {}))
    prompt = prompt_token_ids(PROMPT_LEN)
    dequantize = {"quantization_config": config(dequantize=True)}
    with torch.inference_mode():
        hf = hf_model(folder, **dequantize)(torch.tensor([prompt])).logits[0]
        unquantized = hf_model(checkpoint(name))(torch.tensor([prompt])).logits[0]
    assert (hf - unquantized).abs().max() > 1e-2
    model = load_model(folder, load_hf_config(folder), reference, torch.float32, torch.device("cpu"))
    assert model.arch.quantization == quantization
    torch.testing.assert_close(_logits(model, prompt), hf, atol=1e-4, rtol=1e-4)
    expected = [hf_greedy(folder, prompt, MAX_NEW_TOKENS, **dequantize)]
    engine = _engine(engines, folder)
    assert [c[0] for c in engine.generate([prompt], GREEDY)] == expected
    # The Triton kernels keep the projections' 8-bit weights and their scales, a mixture's experts' too; gpt-oss's
    # experts their MXFP4 blocks.
    packed = load_model(folder, load_hf_config(folder), triton_ops, torch.float32, torch.device("cpu"))
    if quantization == "mxfp4":
        experts = [m for m in packed.modules() if isinstance(m, Experts)]
        assert experts and all(e.mxfp4 == {"gate_up_proj", "down_proj"} and e.down_proj_blocks.dtype == torch.uint8
                               for e in experts)
        torch.testing.assert_close(_logits(packed, prompt), hf, atol=1e-4, rtol=1e-4)
        assert [c[0] for c in _engine(engines, folder, kernel_backend="triton").generate([prompt], GREEDY)] == expected
        return
    fp8_linears = sorted(n for n, m in packed.named_modules() if isinstance(m, Fp8Linear))
    assert all(m.weight.element_size() == 1 and m.weight_scale_inv.dtype == torch.float32  # not cast to the model's
               for m in packed.modules() if isinstance(m, Fp8Linear))
    assert fp8_linears == sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(
        "_proj") and not (model.arch.mla and ".self_attn." in n)) and len(fp8_linears) >= 6  # MLA's widened
    experts = [m for m in packed.modules() if isinstance(m, Experts)]
    assert all(e.fp8 == {"gate_up_proj", "down_proj"} and e.down_proj.element_size() == 1
               and e.down_proj_scale_inv.dtype == torch.float32 for e in experts)
    assert len(experts) == sum(isinstance(m, Experts) for m in model.modules()) and bool(experts) == ("moe" in name)
    torch.testing.assert_close(_logits(packed, prompt), hf, atol=1e-4, rtol=1e-4)
    assert [c[0] for c in _engine(engines, folder, kernel_backend="triton").generate([prompt], GREEDY)] == expected


@pytest.mark.parametrize(("name", "strategy", "scale_dtype"), [
    ("llama-bias", "channel", torch.bfloat16), ("llama-bias", "tensor", torch.float32),
    ("qwen3-moe-dense-layer", "channel", torch.float32), ("llama-bias", "block", torch.float32),
])
def test_compressed_tensors_fp8_equals_transformers_decompressed(checkpoint, engines, tmp_path, name: str,  # type: ignore[no-untyped-def]
                                                                 strategy: str, scale_dtype: torch.dtype) -> None:
    """llm-compressor's FP8-dynamic checkpoints (compressed-tensors' ``float-quantized``: e4m3 weights, a scale per
    channel, per tensor or per block; activations quantized per token on the fly, which this computes unquantized, as
    transformers' decompressed model does): logits and engine greedy equal transformers' with
    ``run_compressed=False``. bfloat16 scales beside a float32 model round each value in bfloat16 first, as
    compressed-tensors widens it: widened as the checkpoint loads. float32 ones stay packed for the Triton kernels
    (``Fp8Linear``; a per-tensor scale's q/k/v, whose blocks differ in height, widened), a mixture's experts too."""
    from transformers import CompressedTensorsConfig

    from common.model.llama import Experts
    from common.model.packed_linear import Fp8Linear
    from common.model.weights import load_model
    from pdserve_kernels import reference, triton_ops
    from tests.engine.tiny_models import compressed_fp8_checkpoint, experts_one_by_one

    source = checkpoint(name)
    if "moe" in name:
        source = experts_one_by_one(source, tmp_path / "one-by-one")
    folder = compressed_fp8_checkpoint(source, tmp_path / "fp8", strategy, scale_dtype)
    prompt = prompt_token_ids(PROMPT_LEN)
    decompress = {"quantization_config": CompressedTensorsConfig(run_compressed=False)}
    with torch.inference_mode():
        hf = hf_model(folder, **decompress)(torch.tensor([prompt])).logits[0]
        unquantized = hf_model(source)(torch.tensor([prompt])).logits[0]
    assert (hf - unquantized).abs().max() > 1e-2
    config = load_hf_config(folder)
    for kernels in (reference, triton_ops):
        model = load_model(folder, config, kernels, torch.float32, torch.device("cpu"))
        assert model.arch.quantization == "compressed-tensors" and model.arch.fp8_weights
        torch.testing.assert_close(_logits(model, prompt), hf, atol=1e-4, rtol=1e-4)
    fp8_linears = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    layers = len(model.model.layers)
    assert len(fp8_linears) == {torch.bfloat16: 0, torch.float32: (3 if strategy == "tensor" else 4) * layers}[
        scale_dtype] - (2 * 2 if "moe" in name else 0)  # the mixture's two layers: experts, not an MLP
    assert all(e.fp8 == {"gate_up_proj", "down_proj"} for e in model.modules() if isinstance(e, Experts))
    expected = [hf_greedy(folder, prompt, MAX_NEW_TOKENS, **decompress)]
    assert [c[0] for c in _engine(engines, folder).generate([prompt], GREEDY)] == expected
    assert [c[0] for c in _engine(engines, folder, kernel_backend="triton").generate([prompt], GREEDY)] == expected


def test_fp8_experts_a_checkpoint_holds_input_major_are_widened(checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Qwen3-VL-MoE's experts stacked input-major (``[E, H, 2I]``, which the loader turns) in FP8 blocks: the Triton
    kernels widen them (their blocks' grid would not turn with them) and keep its other projections packed; the
    logits are the torch kernels' (which widen everything)."""
    from common.model.llama import Experts
    from common.model.packed_linear import Fp8Linear
    from common.model.weights import load_model
    from pdserve_kernels import reference, triton_ops
    from tests.engine.tiny_models import fp8_checkpoint

    folder = fp8_checkpoint(checkpoint("qwen3-vl-moe-image-text-text-only"), tmp_path / "fp8")
    prompt = prompt_token_ids(PROMPT_LEN)
    config = load_hf_config(folder)
    widened = load_model(folder, config, reference, torch.float32, torch.device("cpu"))
    packed = load_model(folder, config, triton_ops, torch.float32, torch.device("cpu"))
    experts = [m for m in packed.modules() if isinstance(m, Experts)]
    assert experts and all(not e.fp8 and e.down_proj.dtype == torch.float32 for e in experts)
    assert any(isinstance(m, Fp8Linear) for m in packed.modules())
    torch.testing.assert_close(_logits(packed, prompt), _logits(widened, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("name", "method", "options"), [
    ("llama-bias", "gptq", {"bits": 4, "desc_act": True}), ("gpt-neox-parallel-two-norms", "gptq", {"bits": 8, "v2": True}),
    ("qwen3-qk-norm", "gptq", {"bits": 2, "desc_act": False}),
    ("qwen3-moe-dense-layer", "gptq", {"bits": 4, "desc_act": False}), ("qwen3-qk-norm", "awq", {}),
    ("phi3-window", "compressed-tensors", {"bits": 4, "group": 16}),
    ("mistral-window", "compressed-tensors", {"bits": 8, "group": None, "symmetric": True}),
    ("gpt-neox-parallel-two-norms", "gptq", {"bits": 4, "desc_act": False}), ("mixtral-moe-window", "gptq", {"bits": 8, "desc_act": False}),
], ids=["gptq-4-desc-act", "gptq_v2-8-fused-qkv", "gptq-2", "gptq-4-moe", "awq", "compressed-tensors-w4a16-group",
        "compressed-tensors-w8a16-channel", "gptq-4-fused-qkv-in-order", "gptq-8-mixtral"])
def test_an_integer_quantized_checkpoint_equals_its_dequantized_model(checkpoint, engines, tmp_path, name: str,  # type: ignore[no-untyped-def]
                                                                      method: str, options: dict[str, Any]) -> None:
    """Integer weights as GPTQ (its original and v2 formats, 4 and 8 bits, groups in activation order, a
    fused q/k/v, a mixture's experts: Qwen3's, Mixtral's), AutoAWQ and compressed-tensors store them: logits
    over the prompt and greedy output through the engine equal transformers' on the dequantized model, with the
    weights widened and (the Triton kernels') kept packed. Its reference, where
    this host can run one, is transformers' own loading through compressed-tensors (``run_compressed``
    false); AWQ's after compressed-tensors' own converter from AutoAWQ's layout; GPTQ's (whose libraries need
    a newer torch) the checkpoint of the weights the quantization stands for."""
    from transformers import CompressedTensorsConfig

    from common.model.llama import Experts
    from common.model.packed_linear import IntLinear
    from common.model.weights import load_model
    from pdserve_kernels import reference, triton_ops
    from tests.engine.tiny_models import (
        awq_as_compressed_tensors,
        awq_checkpoint,
        compressed_tensors_checkpoint,
        experts_one_by_one,
        gptq_checkpoint,
    )

    source, folder = checkpoint(name), tmp_path / "quantized"
    if name.startswith("qwen3-moe"):  # as quantizers write a mixture's experts: one weight per expert (Mixtral's so)
        source = experts_one_by_one(source, tmp_path / "one-by-one")
    decompress: dict[str, Any] = {"quantization_config": CompressedTensorsConfig(run_compressed=False)}
    if method == "gptq":
        reference_folder, decompress = tmp_path / "dequantized", {}
        gptq_checkpoint(source, folder, reference_folder, **options)
    elif method == "awq":
        reference_folder = awq_as_compressed_tensors(awq_checkpoint(source, folder), tmp_path / "converted")
    else:
        reference_folder = compressed_tensors_checkpoint(source, folder, **options)
    prompt = prompt_token_ids(PROMPT_LEN)
    with torch.inference_mode():
        hf = hf_model(reference_folder, **decompress)(torch.tensor([prompt])).logits[0]
        unquantized = hf_model(source)(torch.tensor([prompt])).logits[0]
    assert (hf - unquantized).abs().max() > 1e-2
    model = load_model(folder, load_hf_config(folder), reference, torch.float32, torch.device("cpu"))
    assert model.arch.quantization == method
    torch.testing.assert_close(_logits(model, prompt), hf, atol=1e-4, rtol=1e-4)
    assert not any(isinstance(m, IntLinear) for m in model.modules())  # the torch backend widens them
    # The Triton kernels keep them packed, a mixture's experts' too.
    packed = load_model(folder, load_hf_config(folder), triton_ops, torch.float32, torch.device("cpu"))
    int_linears = {n: m for n, m in packed.named_modules() if isinstance(m, IntLinear)}
    experts = [m for m in packed.modules() if isinstance(m, Experts)]
    assert len(experts) == sum(isinstance(m, Experts) for m in model.modules()) and bool(experts) == ("moe" in name)
    assert all(e.bits == dict.fromkeys(("gate_up_proj", "down_proj"), options.get("bits", 4)) for e in experts)
    assert all(e.down_proj_scales.dtype == torch.float16 for e in experts)  # the checkpoint's, not the model's
    dense = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith("_proj")]
    reordered = method == "gptq" and options.get("desc_act", True)  # its groups out of order: each input's group
    assert sorted(int_linears) == sorted(dense) and len(dense) >= 6
    assert all((m.g_idx is not None) == reordered for m in int_linears.values())
    assert all(m.bits == options.get("bits", 4) for m in int_linears.values())
    torch.testing.assert_close(_logits(packed, prompt), hf, atol=1e-4, rtol=1e-4)
    if int_linears:
        assert sum(p.numel() * p.element_size() for p in packed.parameters()) < sum(
            p.numel() * p.element_size() for p in model.parameters())
    # vLLM's --quantization, with its kernels' names for the same checkpoints, is checked against the config.
    engine = _engine(engines, folder, quantization={"gptq": "gptq_marlin", "awq": "awq_marlin"}.get(method, method))
    expected = [hf_greedy(reference_folder, prompt, MAX_NEW_TOKENS, **decompress)]
    assert [c[0] for c in engine.generate([prompt], GREEDY)] == expected
    triton_engine = _engine(engines, folder, kernel_backend="triton")
    assert [c[0] for c in triton_engine.generate([prompt], GREEDY)] == expected
    with pytest.raises(ValueError, match=f"--quantization fp8: the checkpoint's quantization_config says {method}"):
        _engine(engines, folder, quantization="fp8")
    with pytest.raises(ValueError, match="not quantized, and quantizing a model as it loads is not implemented"):
        _engine(engines, source, quantization=method)


def test_awq_s_packing_order_and_stray_tensors() -> None:
    """AutoAWQ's nibble order read as compressed-tensors' converter reads it, on random words; packed weights
    without their zero points, a scale or zero point without its packed weights, or packed weights that do not
    fit their scales, is a broken checkpoint."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    from common.model.quantization import QUANT_AWQ, QUANT_GPTQ, IntWeights, int_weight_layers

    def widen_int_weights(state: dict[str, torch.Tensor], spec: IntWeights, dtype: torch.dtype) -> None:
        state.update({f"{prefix}.weight": values.widen().to(dtype)
                      for prefix, values in int_weight_layers(state, spec).items()})

    gen = torch.Generator().manual_seed(3)
    qweight = torch.randint(-2**31, 2**31 - 1, (32, 2), generator=gen, dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (2, 2), generator=gen, dtype=torch.int32)
    scales = torch.rand(2, 16, generator=gen).half()
    state = {"x.qweight": qweight, "x.qzeros": qzeros, "x.scales": scales}
    widen_int_weights(state, IntWeights(QUANT_AWQ, (4,)), torch.float32)
    weight, scale, zero = AutoAWQConverter(group_size=16)._convert_gemm_module(qweight, scales, qzeros)
    expected = (weight.int() - zero.int().repeat_interleave(16, dim=1)).half() * scale.repeat_interleave(16, dim=1)
    assert set(state) == {"x.weight"} and torch.equal(state["x.weight"], expected.float())
    with pytest.raises(ValueError, match="qweight without qzeros"):
        widen_int_weights({"x.qweight": qweight, "x.scales": scales}, IntWeights(QUANT_AWQ, (4,)), torch.float32)
    with pytest.raises(ValueError, match="without their qweight"):
        widen_int_weights({"x.scales": scales}, IntWeights(QUANT_AWQ, (4,)), torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        widen_int_weights({"x.qweight": qweight, "x.qzeros": qzeros, "x.scales": scales[:, :8]},
                          IntWeights(QUANT_AWQ, (4,)), torch.float32)
    with pytest.raises(ValueError, match="group index"):  # GPTQ's g_idx naming a group it has no scale for
        widen_int_weights({"x.qweight": qweight.reshape(8, 8)[:4], "x.qzeros": qzeros[:, :1], "x.scales": scales[:, :8],
                           "x.g_idx": torch.full((32,), 2, dtype=torch.int32)}, IntWeights(QUANT_GPTQ, (4,)),
                          torch.float32)


def test_fp8_widens_each_block_by_its_scale_as_transformers_does() -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from common.model.quantization import dequantize_fp8

    gen = torch.Generator().manual_seed(2)
    weight = (100 * torch.randn(3, 32, 48, generator=gen)).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, 3, generator=gen) + 1e-3
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_fp8(weight, scale, dtype)
        assert torch.equal(got, Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=dtype))
    with pytest.raises(ValueError, match="blocks"):
        dequantize_fp8(weight, torch.rand(3, 5, 3), torch.float32)  # 32 rows in 5 blocks
    with pytest.raises(ValueError, match="float8"):
        dequantize_fp8(weight.float(), scale, torch.float32)


def _transformers_modeling(folder: Path) -> Any:
    import importlib
    import json

    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


@pytest.mark.parametrize("name", INTERLEAVED)
def test_the_interleaved_pairing_changes_transformers_logits_so_the_tests_can_see_it(checkpoint, name, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Rotated by halves, as the other families rotate (GLM-4.5's function, partial RoPE included), the same
    weights give other logits: loading them without reordering q and k would show."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb as by_halves

    folder = checkpoint(name)
    prompt = torch.tensor([prompt_token_ids(PROMPT_LEN)])
    with torch.inference_mode():
        model = hf_model(folder)
        interleaved = model(prompt).logits
        monkeypatch.setattr(_transformers_modeling(folder), "apply_rotary_pos_emb", by_halves)
        halves = model(prompt).logits
    assert (interleaved - halves).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "dtype"), [(n, d) for n in INTERLEAVED for d in (torch.bfloat16, torch.float16)])
def test_interleaved_rope_rotates_as_transformers_does_bit_for_bit(checkpoint, name: str, dtype: torch.dtype) -> None:
    """In 16-bit, the model's tables and rotation (float32 and rounded once for ERNIE, each operation rounded
    for GLM and Helium) on q and k whose head entries were reordered as the loader reorders the weights'
    rows give transformers' interleaved rotation's bits, reordered so."""
    from common.model.weights import load_model
    from pdserve_kernels import reference

    folder = checkpoint(name)
    ours = load_model(folder, load_hf_config(folder), reference, dtype, torch.device("cpu"))
    hf = hf_model(folder, dtype)
    attn = ours.model.layers[0].self_attn
    heads, kv_heads, head_size = attn.num_heads, attn.num_kv_heads, attn.head_size
    rotary = ours.arch.rotary_dim or head_size
    assert ours.arch.rope_interleaved and rotary in (head_size, head_size // 2)
    gen = torch.Generator().manual_seed(4)
    n = 40
    q = (3 * torch.randn(n, heads, head_size, generator=gen)).to(dtype)
    k = (3 * torch.randn(n, kv_heads, head_size, generator=gen)).to(dtype)
    positions = torch.arange(n)
    with torch.inference_mode():
        cos, sin = hf.model.rotary_emb(q[None], positions[None])
        want_q, want_k = _transformers_modeling(folder).apply_rotary_pos_emb(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        tables = ours.rope_tables(positions, dtype)[ours.layer_rope_kinds[0]]  # layer 0 rotates in every family here
        order = torch.cat((torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, head_size)))
        got_q, got_k = reference.rope(q[..., order], k[..., order], *tables)
    assert cos.dtype == (torch.float32 if "ernie" in name else dtype)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)[..., order])
    assert torch.equal(got_k, want_k[0].transpose(0, 1)[..., order])


def _logits(model: LlamaForCausalLM, prompt: list[int], capped: bool = True) -> torch.Tensor:
    """The model's logits over ``prompt`` in one prefill, its K and V in 8-token blocks (``capped``
    False: before a final soft-cap)."""
    from common.model.llama import AttentionMetadata

    n, block_size = len(prompt), 8
    attn = model.model.layers[0].self_attn
    kv_cache = torch.zeros(len(model.model.layers), 2, -(-n // block_size), block_size, attn.num_kv_heads,
                           attn.head_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(-(-n // block_size), dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), context_lens=torch.tensor([n], dtype=torch.int32),
        max_query_len=n,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(n), meta, kv_cache)
        return model.compute_logits(hidden) if capped else model.lm_head(hidden).float()


@pytest.mark.parametrize("name", FAMILIES)
def test_family_logits_over_a_prompt_equal_transformers(checkpoint, name: str) -> None:  # type: ignore[no-untyped-def]
    """Logits, not only their argmax: a final soft-cap (monotonic) can never change a greedy token."""
    from common.model.weights import load_model
    from pdserve_kernels import reference

    folder = checkpoint(name)
    prompt = prompt_token_ids(PROMPT_LEN)
    model = load_model(folder, load_hf_config(folder), reference, torch.float32, torch.device("cpu"))
    got, uncapped = _logits(model, prompt), _logits(model, prompt, capped=False)
    with torch.inference_mode():
        expected = hf_model(folder)(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if model.arch.final_soft_cap is not None:  # the cap is applied, and changes the logits
        assert got.abs().max() < model.arch.final_soft_cap < uncapped.abs().max()


@pytest.mark.parametrize("name", FAMILIES)
def test_family_greedy_equals_transformers_through_the_engine(checkpoint, engines, name: str) -> None:  # type: ignore[no-untyped-def]
    folder = checkpoint(name)
    prompts = [prompt_token_ids(PROMPT_LEN), prompt_token_ids(WINDOW + 3, seed=2)]
    engine = _engine(engines, folder)
    got = [choices[0] for choices in engine.generate(prompts, GREEDY)]
    assert got == [_expected(folder, tuple(p)) for p in prompts]


@pytest.mark.parametrize("name", sorted({*WINDOWED, *MIXTURES, *INTERLEAVED, *IMAGE_TEXT, "ministral3-query-scale-yarn",
                                          "qwen3-qk-norm",
                                          "hunyuan-qk-norm-ntk-alpha", "olmo2-post-norms",
                                          "olmo-layernorm-no-weights-clip-qkv", "persimmon-qk-layernorm-partial-rope-relu2",
                                          "falcon-new-arch-grouped-qkv-two-norms", "falcon-multi-query-parallel"}))
def test_family_greedy_equals_transformers_through_prefill_handoff_decode(checkpoint, engines, name: str) -> None:  # type: ignore[no-untyped-def]
    folder = checkpoint(name)
    prompt = prompt_token_ids(PROMPT_LEN)
    prefill, decode = _engine(engines, folder, max_num_batched_tokens=16), _engine(engines, folder)
    first = _transfer(prefill, decode, prompt, GREEDY)
    decode.remote_kv_arrived("r")
    assert [first, *_drain(decode)["r"]] == _expected(folder, tuple(prompt))


# The families whose every layer has the window: only they give blocks back as a sequence moves on.
WINDOW_ON_EVERY_LAYER = ["mistral-window", "mixtral-moe-window", "phi3-window", "starcoder2-layernorm-bias-window"]


def test_only_a_window_on_every_layer_lets_the_cache_give_blocks_back() -> None:
    configs = family_configs()
    windows = {name: ModelArch.from_config(configs[name]).kv_window for name in FAMILIES}
    assert sorted(name for name, window in windows.items() if window is not None) == WINDOW_ON_EVERY_LAYER
    assert {windows[name] for name in WINDOW_ON_EVERY_LAYER} == {WINDOW}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("name", WINDOW_ON_EVERY_LAYER)
def test_blocks_out_of_every_window_go_back_and_every_logprob_stays_transformers(  # type: ignore[no-untyped-def]
    checkpoint, engines, name: str, async_scheduling: bool,
) -> None:
    """A prompt of five windows in chunks of 5, then three windows of tokens: the request holds the blocks of about
    one window and a chunk, never the sequence's, and each prompt token's and each sampled token's logprob equals
    transformers' forward over the whole sequence (a key read from a block given back too early would move it).
    Two choices forked after the prompt's blocks went back both decode transformers' greedy tokens."""
    folder = checkpoint(name)
    prompt = prompt_token_ids(5 * WINDOW + 1, seed=3)
    engine = _engine(engines, folder, async_scheduling=async_scheduling)
    assert engine.kv.sliding_window == WINDOW
    num_new = 3 * WINDOW
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    engine.add_request("r", prompt, params)
    outs, most_held, least_free = [], 0, engine.kv.pool.num_blocks
    while engine.has_unfinished_requests():
        outs += engine.step()
        held = len(engine.kv.req_blocks.get("r", ())) - engine.kv.num_released("r")
        most_held, least_free = max(most_held, held), min(least_free, engine.kv.pool.num_free_blocks)
    tokens = [t for out in outs for t in out.new_token_ids]
    sequence = prompt + tokens
    assert len(tokens) == num_new
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(folder)(torch.tensor([sequence])).logits[0].float(), dim=-1)
    (prompt_logprobs,) = [out.prompt_logprobs for out in outs if out.prompt_logprobs is not None]
    for i in range(1, len(prompt)):
        assert prompt_logprobs[i].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4), i
    sampled = [lp for out in outs for lp in out.logprobs or ()]
    assert [lp.token_id for lp in sampled] == tokens == ref[len(prompt) - 1 : -1].argmax(-1).tolist()
    for j, lp in enumerate(sampled):
        assert lp.logprob == pytest.approx(ref[len(prompt) - 1 + j, tokens[j]].item(), abs=1e-4), j
    bs = engine.block_size
    assert most_held <= -(-(WINDOW + 2 * 5) // bs) + 1 < -(-len(sequence) // bs) // 2
    assert most_held <= engine.kv.max_blocks_held(len(sequence), 5)  # what admission and start-up count on
    # Released blocks go back to the pool: never more than the window's worth in use (plus cached ones free).
    assert engine.kv.pool.num_blocks - least_free == most_held
    forked = SamplingParams(temperature=0.0, max_tokens=WINDOW, ignore_eos=True, n=2)
    assert engine.generate([prompt], forked) == [[tokens[:WINDOW]] * 2]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("name", ["mistral-window", "starcoder2-layernorm-bias-window"])
def test_a_windowed_request_longer_than_the_pool_runs_and_a_continuation_hits_its_last_window(  # type: ignore[no-untyped-def]
    checkpoint, engines, name: str, async_scheduling: bool,
) -> None:
    """6 blocks of 8 (48 tokens) cannot hold a 97-token sequence, but a request whose queries read 12 keys back holds
    at most 4 blocks at once (a window and two 5-token steps): it is admitted and runs to transformers' tokens; the
    same pool refuses it for a model without a window. A continuation of that conversation hits the blocks of its
    last window, still cached, though the first blocks were taken for others by then: they count as given back."""
    folder = checkpoint(name)
    prompt = prompt_token_ids(5 * WINDOW + 1, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=3 * WINDOW, ignore_eos=True)
    whole = _engine(engines, checkpoint("llama-bias"), num_blocks=6)
    with pytest.raises(ValueError, match="request needs 13 KV blocks at its longest, but the pool has only 6"):
        whole.add_request("r", prompt, params)
    engine = _engine(engines, folder, num_blocks=6, async_scheduling=async_scheduling)
    assert engine.kv.max_blocks_held(len(prompt) + 3 * WINDOW, 5) == 4
    [[tokens]] = engine.generate([prompt], params)
    assert engine.scheduler.num_preemptions == 0
    follow = prompt + tokens + prompt_token_ids(5, seed=4)
    engine.add_request("next", follow, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    more = [t for out in outs for t in out.new_token_ids]
    hit = max(out.num_cached_tokens for out in outs)
    assert hit >= WINDOW, "a continuation found no block of its last window"
    with torch.inference_mode():
        ref = hf_model(folder)(torch.tensor([follow + more])).logits[0]
    assert tokens == ref[len(prompt) - 1 : len(prompt) + len(tokens) - 1].argmax(-1).tolist()
    assert more == ref[len(follow) - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize("name", ["mistral-window", "phi3-window"])
def test_drafts_verified_over_a_window_keep_transformers_tokens_and_the_window_s_blocks(  # type: ignore[no-untyped-def]
    checkpoint, engines, name: str,
) -> None:
    """n-gram drafts: a decode step writes the KV of its token and up to 4 drafts, some rejected and written over
    later, while the blocks behind the window go back by the step's first query. The tokens stay transformers'
    greedy at every position, some drafts are taken, and the request holds no more than a window and two steps."""
    folder = checkpoint(name)
    prompt = prompt_token_ids(2 * WINDOW, seed=5) * 2 + prompt_token_ids(3, seed=6)  # a repeat to draft from
    ngram = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    engine = _engine(engines, folder, speculative_config=ngram)
    params = SamplingParams(temperature=0.0, max_tokens=4 * WINDOW, ignore_eos=True)
    engine.add_request("r", prompt, params)
    tokens, most_held = [], 0
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
        most_held = max(most_held, engine.kv.pool.num_used_blocks)
    assert engine.spec_num_accepted_tokens > 0
    assert most_held <= engine.kv.max_blocks_held(len(prompt) + len(tokens), 5) < -(-(len(prompt) + len(tokens)) // 8)
    with torch.inference_mode():
        ref = hf_model(folder)(torch.tensor([prompt + tokens])).logits[0]
    assert tokens == ref[len(prompt) - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize("name", ["mistral-window", "gemma2-window-softcap"])
def test_a_service_publishes_its_window_for_the_routers_prefix_matches(checkpoint, redis_url: str, name: str) -> None:  # type: ignore[no-untyped-def]
    """Routers count a windowed instance's prefix hits as its engine does (``PrefixIndex.match``) from the window
    it publishes: a model windowed on every layer publishes its window, one with a layer that sees everything 0."""
    import argparse

    from common.service import add_service_args
    from prefill_svc.service import PrefillService

    parser = argparse.ArgumentParser()
    add_service_args(parser, "prefill")
    args = parser.parse_args(["--model", str(checkpoint(name)), "--device", "cpu", "--dtype", "float32",
                              "--block-size", "8", "--num-blocks", "16", "--redis-url", redis_url])
    service = PrefillService(args)
    try:
        assert service.info().kv_window == (WINDOW if name in WINDOW_ON_EVERY_LAYER else 0)
    finally:
        service.close()
        service.engine.close()
        service.ctx.destroy(linger=0)


@pytest.mark.parametrize("name", WINDOW_ON_EVERY_LAYER)
def test_a_decode_takes_only_the_window_of_a_handed_off_prompt(checkpoint, engines, name: str) -> None:  # type: ignore[no-untyped-def]
    """The decode holds, and the prefill sends, only the blocks its first query reads: those before are skipped
    as prefix hits are, and the prefill gives back, as its chunks go, blocks the decode skips. Again after the
    decode computed the prompt itself: then its cached blocks of the window are hits, the ones before skipped."""
    folder = checkpoint(name)
    # 58 tokens: the first query (at 58) sees keys from 47 on, the last of the 8-token block 40-47.
    prompt = prompt_token_ids(4 * WINDOW + 10, seed=3)
    prefill, decode = _engine(engines, folder), _engine(engines, folder)
    bs = decode.block_size
    skip = (len(prompt) - WINDOW + 1) // bs  # the decode's first query is at len(prompt), after the prompt
    prefill.add_request("r", prompt, GREEDY, kv_transfer=True)
    most_held = 0
    while not any(out.kv_handoff for out in prefill.step()):
        most_held = max(most_held, prefill.kv.pool.num_used_blocks)
    # The last chunk (from 55) read keys from 44 on: blocks 0-4 went back, all of them skipped by the decode.
    assert prefill.kv.num_released("r") == (len(prompt) - 3 - WINDOW + 1) // bs == skip
    assert most_held <= prefill.kv.max_blocks_held(len(prompt), 5) < -(-len(prompt) // bs)
    prefill.abort_request("r")
    prefill.release_kv("r")
    first = _transfer(prefill, decode, prompt, GREEDY)
    assert decode.kv.num_released("r") == skip > 0
    assert decode.kv.pool.num_used_blocks == -(-len(prompt) // bs) - skip
    decode.remote_kv_arrived("r")
    assert [first, *_drain(decode)["r"]] == _expected(folder, tuple(prompt))
    # The decode computes the prompt itself, caching its blocks (given back, still findable)...
    assert decode.generate([prompt], GREEDY) == [[_expected(folder, tuple(prompt))]]
    # ... so a hand-off of it now hits every full block of the window, and only the last block is sent.
    first = _transfer(prefill, decode, prompt, GREEDY)
    assert decode.kv.num_released("r") == skip and decode.kv.req_blocks["r"][skip].block_hash is not None
    assert decode.kv.pool.num_used_blocks == -(-len(prompt) // bs) - skip
    decode.remote_kv_arrived("r")
    assert [first, *_drain(decode)["r"]] == _expected(folder, tuple(prompt))


def _derived(model: torch.nn.Module) -> dict[str, str]:
    """Every value a model's modules computed from its config (shapes, flags, scales, windows)."""
    out = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_") or key == "config" or isinstance(value, (torch.Tensor, torch.nn.Module)):
                continue
            out[f"{name}.{key}"] = repr(value)
        for key, param in module.named_parameters(recurse=False):
            out[f"{name}.{key}"] = repr(tuple(param.shape))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_a_config_read_back_from_the_cache_builds_the_same_model(checkpoint, name, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """Engines after the first read a model's resolved config from the cache, without transformers:
    it must build exactly the model transformers' config builds."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    folder = checkpoint(name)
    first = load_hf_config(folder)
    assert not isinstance(first, SimpleNamespace), "the first read goes through transformers"
    again = load_hf_config(folder)
    if ModelArch.from_config(first).rope_type != "default":  # its tables need transformers' config
        assert not isinstance(again, SimpleNamespace)
        return
    assert isinstance(again, SimpleNamespace), "the second read comes from the cache"
    assert ModelArch.from_config(again) == ModelArch.from_config(first)
    kernels = get_kernels("cpu")
    with torch.device("meta"):
        built = [LlamaForCausalLM(config, kernels) for config in (first, again)]
    assert _derived(built[0]) == _derived(built[1])
    ropes = [model.rotary_embs for model in built]
    for (key, a), (_, b) in zip(ropes[0].named_buffers(), ropes[1].named_buffers(), strict=True):
        assert torch.equal(a, b), key
    # A changed config.json is resolved afresh, not read from the old entry.
    (folder / "config.json").write_text((folder / "config.json").read_text().replace("}", ', "pdserve_test": 1}', 1))
    try:
        assert not isinstance(load_hf_config(folder), SimpleNamespace)
    finally:
        (folder / "config.json").write_text((folder / "config.json").read_text().replace(', "pdserve_test": 1', ""))
