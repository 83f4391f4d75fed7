"""What a checkpoint's config asks of the model, decided in one place: implemented, or refused.

``ModelArch.from_config`` reads a transformers config and returns the few facts the forward pass
needs (biases, norms, activation, scalings, soft-capping, each layer's sliding window, RoPE kind).
Any field that would change the math in a way ``common/model/llama.py`` does not implement raises
``UnsupportedConfig`` naming the field, so a model is either computed exactly as transformers computes it or not loaded.
Per family, the rules follow transformers' own modeling code (which is the reference for
correctness):
- Llama (and InternLM3, which transformers runs as Llama) reads ``attention_bias`` / ``mlp_bias``;
  Seed-OSS the output projection's bias from ``attention_out_bias``; Qwen2 always has q/k/v biases.
- Mistral and Phi-3 apply ``sliding_window`` to every layer; Qwen2/Qwen3/Gemma 2/Gemma 3 and
  Ministral (Mistral's layer otherwise) to the layers ``layer_types`` marks.
- Phi-3's checkpoints hold q/k/v and gate/up already stacked, as this model computes them.
- Gemma 3 is Gemma 2's layer with Qwen3's q/k norms (Gemma's ``1 + weight`` form) and a RoPE per
  layer type (local layers their own base frequency, global ones theirs, scaled).
- Granite is Llama's layer with four scalings (embeddings, attention, each block's output, logits);
  SmolLM3 is Llama's with some layers unrotated (``no_rope_layers``); Arcee's MLP has no gate and
  squares a ReLU (``relu2``); Hunyuan norms q and k after RoPE, whose base a fixed NTK alpha stretches.
- OLMo 2 norms each block's output instead of its input (no norm before attention or the MLP), q and
  k across all their heads at once, and meets the normalized row with the weight in float32 (its own
  RMSNorm form); OLMo 3 adds sliding layers and a RoPE per layer type, as Gemma 3's.
- The mixtures of experts are their dense family's layer with a router over experts in the MLP's
  place: Mixtral Mistral's (every layer; its chosen experts' weights renormalized, kept in float32),
  Qwen3-MoE Qwen3's and Qwen2-MoE Qwen2's (each the layers ``decoder_sparse_step`` and
  ``mlp_only_layers`` leave it; ``norm_topk_prob``; Qwen2-MoE's shared expert behind a sigmoid gate),
  OLMoE Llama's with q and k normed across all heads, as OLMo 2's; Granite MoE Granite's with four
  scalings, its router's softmax over the top k logits only (and Granite MoE Shared a shared expert);
  GLM-4.5 (``glm4_moe``) Llama's with q/k biases, optional per-head q/k norms and a partial RoPE, its
  first ``first_k_dense_replace`` layers dense, its router DeepSeek-V3's (sigmoid scores, a correction
  bias for the choice, groups, a scaling), its shared experts one MLP beside; dots.llm1 (``dots1``) the
  same mixture behind Qwen3's attention; FlexOlmo (``flex_olmo``) OLMo 2's layer with Qwen's softmax
  mixture; Hunyuan MoE (``hunyuan_v1_moe``) Hunyuan's dense layer with a softmax mixture beside a
  shared MLP; MiniMax-M2
  (``minimax_m2``) Mixtral's with OLMo's q/k norms across all heads, a partial RoPE and the same router
  without groups; gpt-oss (``gpt_oss``) Llama's with biases, alternating sliding and full layers, a sink
  logit per head in each softmax, and a mixture whose experts have biases and a clamped SwiGLU of their own.
- GLM-4 (``glm``), GLM-4-0414 (``glm4``, with Gemma's four norms), Helium and ERNIE 4.5 (dense, and its mixture:
  a softmax router whose choice a correction bias shifts) rotate interleaved pairs, served by the kernels'
  rotation of halves once the checkpoint's q and k rows are reordered (``rope_interleaved``); ERNIE rotates
  in float32 (``rope_float32``).
- EXAONE 4 is OLMo 2's layout in Llama's norm form with Qwen3's per-head q/k norms, its global layers
  unrotated; Ministral 3 is Mistral's layer with its queries scaled by position (``query_scale_beta``);
  Gemma 1 is Llama's layer with Gemma's norms, scaled embeddings and GELU-tanh; Apertus is Llama's with
  per-head q/k norms and an ungated MLP with its xIELU.
- AFMoE is Gemma's four norms in OLMo's form, per-head q/k norms, a sigmoid gate on the attention's output,
  Cohere 2's unrotated global layers and MiniMax-M2's router, scaled.
- Image-text checkpoints (``IMAGE_TEXT_TYPES``: Gemma 3, Idefics3, InternVL, Llama 4, LLaVA, LLaVA-NeXT,
  LLaVA-OneVision, Mistral 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, SmolVLM) are served as their
  ``text_config``'s family; their images too, but Llama 4's (``common.model.vision``).
- Cohere (``cohere``) and Cohere 2 (``cohere2``) rotate interleaved pairs too, in float32; their norms are
  LayerNorms without bias (``NORM_LAYER``), attention and MLP read the same norm side by side, and the
  logits are scaled by ``logit_scale``; Cohere 2 windows its sliding layers and rotates only those.
- StarCoder2 is Mistral's windowed layer with torch's LayerNorms (``NORM_LAYER`` with a bias), biases by
  ``use_bias`` and an ungated MLP with GELU-tanh; Phi (1, 1.5, 2) is Cohere's side-by-side layer with
  those LayerNorms, the two outputs summed before they join the stream, biases everywhere (its output
  head's too), a partial RoPE and an ungated MLP with transformers' ``gelu_new``; StableLM is Llama's layer
  with those LayerNorms, a partial RoPE, q/k/v biases by ``use_qkv_bias``, optionally Cohere's side-by-side
  layer (``use_parallel_residual``) and its LayerNorms of q and k, a weight per head (``qk_layernorm``);
  GPT-NeoX (Pythia) is that side-by-side layer with a norm of its own for the MLP, biases, a partial RoPE, an
  ungated MLP with the exact GELU, and its q/k/v fused head by head in the checkpoint (split as it loads).
- OLMo 1 (``olmo``) is Llama's layer with LayerNorms that have neither weight nor bias (epsilon 1e-5, in float32:
  the LayerNorm form met with a weight of ones, ``norm_weightless``), q/k/v and o biases by ``attention_bias``,
  q, k and v clamped to ``clip_qkv``, and q and k rotated in float32 against float32 tables, as its code does.
- Persimmon is Llama's layer with torch's LayerNorms, biases everywhere, a partial RoPE, GPT-NeoX's q/k/v fused
  head by head, LayerNorms of q and k (one weight and bias shared by the heads, ``qk_layernorm``) and an ungated
  MLP with a squared ReLU.
- Falcon is GPT-NeoX's side-by-side layer with two norms (``new_decoder_architecture``; or one,
  ``num_ln_in_parallel_attn`` 1), Phi's with one (``parallel_attn``), or Llama's sequential layer, with torch's
  LayerNorms, biases by ``bias``, an ungated MLP ``ffn_hidden_size`` wide with the exact GELU, and its fused
  q/k/v as its variant lays it out: grouped by kv head (new architecture), all queries then one k and one v
  (``multi_query``), or head by head; ALiBi (``alibi``) is refused.
- DeepSeek-V2 (``deepseek_v2``: V2, V2-Lite, V2.5) and DeepSeek-V3 (``deepseek_v3``: V3, R1, Kimi K2, Moonlight)
  are Llama's layer with Multi-head Latent Attention (``ModelArch.mla``, ``common/model/mla.py``): q from a
  low-rank projection (``q_lora_rank``; V2-Lite's whole ``q_proj`` without), k and v from one latent per token
  (``kv_lora_rank``) beside one rotated key shared by the heads, the attention's scale YaRN's ``mscale_all_dim``
  squared where its RoPE is YaRN; RoPE over interleaved pairs (V2's always, in float32; V3's where
  ``rope_interleave``), served as the other interleaved families are. Their first ``first_k_dense_replace`` layers
  are dense, the rest mixtures with shared experts: V3's router GLM-4.5's, V2's a softmax in float32 whose top k
  are weighed by probability and ``routed_scaling_factor`` (``topk_method`` ``greedy``), or chosen within the
  ``topk_group`` groups of ``n_group`` whose best expert scores highest (``group_limited_greedy``). Fields that
  their original code reads and transformers ignores (``scoring_func``, ``topk_method`` for V3, ``moe_layer_freq``,
  V2's ``norm_topk_prob``) are refused where the two would differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeGuard

from common.model.quantization import (
    QUANT_AWQ,
    QUANT_COMPRESSED_TENSORS,
    QUANT_FP8,
    QUANT_GPTQ,
    QUANT_MXFP4,
    IntWeights,
    quantization_fields,
)
from pdserve_kernels.reference import NORM_GEMMA, NORM_LAYER, NORM_LLAMA, NORM_OLMO

# Families whose biases follow Llama's code: q/k/v/o by ``attention_bias``, the MLP's by ``mlp_bias``.
_LLAMA_BIAS_TYPES = ("llama", "granite", "smollm3", "internlm3", "arcee")
# Cohere's: LayerNorms, attention and MLP side by side on one norm, logits scaled (Command R, Aya; Cohere 2:
# Command R7B, Command A, whose global layers have no RoPE).
_COHERE_TYPES = ("cohere", "cohere2")
# Families whose q/k/v and o projections have biases by ``attention_bias`` and whose MLPs have none.
_ATTENTION_BIAS_TYPES = ("qwen3", "gemma", "gemma2", "gemma3_text", "vaultgemma", "hunyuan_v1_dense", "olmo2",
                         "olmo3", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "gpt_oss", "dots1",
                         "flex_olmo", "hunyuan_v1_moe", "apertus", "afmoe", "olmo", "llama4_text", *_COHERE_TYPES)
_NO_BIAS_TYPES = ("mistral", "ministral", "ministral3", "phi3", "mixtral", "minimax_m2", "exaone4")  # no bias anywhere
# Families whose q/k/v, o and MLP projections all have biases by ``use_bias`` (ERNIE 4.5, its experts none;
# StarCoder2).
_ERNIE_TYPES = ("ernie4_5", "ernie4_5_moe")
_USE_BIAS_TYPES = (*_ERNIE_TYPES, "starcoder2")
_GLM_TYPES = ("glm", "glm4")
# Families whose RoPE rotates interleaved pairs (entries 0 and 1, 2 and 3, ...), not each head's halves.
_INTERLEAVED_ROPE_TYPES = ("helium", "llama4_text", *_GLM_TYPES, *_ERNIE_TYPES, *_COHERE_TYPES)
# Families whose attention is DeepSeek's Multi-head Latent Attention (``ModelArch.mla``).
_MLA_TYPES = ("deepseek_v2", "deepseek_v3")
# Mixture-of-experts families: a router over experts in place of the MLP (in some layers or all).
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "glm4_moe", "minimax_m2",
              "gpt_oss", "dots1", "flex_olmo", "hunyuan_v1_moe", "ernie4_5_moe", "afmoe", "llama4_text", *_MLA_TYPES)
_HUNYUAN_TYPES = ("hunyuan_v1_dense", "hunyuan_v1_moe")
# Mixtures routed as DeepSeek-V3 routes (``ROUTER_SIGMOID_GROUPS``), with dense first layers and shared experts.
_DEEPSEEK_ROUTED_TYPES = ("glm4_moe", "dots1", "deepseek_v3")
# Families whose modeling code rotates only each head's first ``partial_rotary_factor`` share.
_PARTIAL_ROPE_TYPES = ("glm4_moe", "minimax_m2", "phi", "stablelm", "gpt_neox", "persimmon", *_GLM_TYPES)
# How a mixture's router picks and weighs experts, as each family's transformers code does:
ROUTER_SOFTMAX_TOPK = "softmax_topk"  # softmax over all experts, then the top k (Mixtral, Qwen, OLMoE)
ROUTER_TOPK_SOFTMAX = "topk_softmax"  # the top k logits, then a softmax over those (Granite)
# GLM-4.5's (DeepSeek-V3's): sigmoid scores; the k chosen by score plus a correction bias, among the
# ``topk_group`` groups whose two best such scores sum highest; weighed by score, scaled.
ROUTER_SIGMOID_GROUPS = "sigmoid_group_topk"
# MiniMax-M2's: the same without groups or scaling, its logits in the model's dtype.
ROUTER_SIGMOID = "sigmoid_topk"
# gpt-oss's: the top k of its logits (a linear layer with a bias), a softmax over them in the model's dtype.
ROUTER_TOPK_SOFTMAX_BIASED = "topk_softmax_biased"
# ERNIE 4.5's: a softmax in float32; the k chosen by probability plus a correction bias, weighed by their
# probabilities renormalized, rounded to the model's dtype.
ROUTER_SOFTMAX_CORRECTED = "softmax_corrected_topk"
# DeepSeek-V2's: a softmax in float32; the k most probable (within the ``topk_groups`` groups whose best
# expert is most probable, where there are groups), weighed by probability, scaled; not renormalized.
ROUTER_SOFTMAX_GROUPS = "softmax_group_limited_topk"
# Llama 4's: the top k logits; each one's sigmoid (in float32, rounded to the model's dtype) scales the token's
# input to that expert, not the expert's output.
ROUTER_SIGMOID_SCALED_INPUT = "topk_sigmoid_scaled_input"
_GRANITE_MOE_TYPES = ("granitemoe", "granitemoeshared")
# Mixtures whose experts are ``moe_intermediate_size`` wide, narrower than the dense MLP (others': ``intermediate_size``).
_OWN_EXPERT_WIDTH_TYPES = ("qwen2_moe", "qwen3_moe", "ernie4_5_moe", "afmoe", "deepseek_v2", *_DEEPSEEK_ROUTED_TYPES)
# The field of a shared expert's width where it is a field of its own (elsewhere a multiple of the experts').
_SHARED_EXPERT_WIDTH_FIELDS = {"qwen2_moe": "shared_expert_intermediate_size", "granitemoeshared": "shared_intermediate_size",
                               "hunyuan_v1_moe": "intermediate_size", "llama4_text": "intermediate_size"}
# The dense MLP's width where the config names it other than ``intermediate_size`` (``ModelArch.mlp_width``).
_MLP_WIDTH_FIELDS = {"falcon": "ffn_hidden_size", "llama4_text": "intermediate_size_mlp"}
SUPPORTED_MODEL_TYPES = (
    *_LLAMA_BIAS_TYPES, "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "vaultgemma",
    "phi3", "seed_oss", "hunyuan_v1_dense", "olmo2", "olmo3", "helium", "ministral3", "exaone4", "apertus", "starcoder2",
    "phi", "stablelm", "gpt_neox", "olmo", "persimmon", "falcon", "llama4_text",
    *_GLM_TYPES, *_ERNIE_TYPES, *_COHERE_TYPES, *_MOE_TYPES,
)
# DeepSeek-V2's ``topk_method`` values its transformers router implements.
_DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
# Gemma's norms ((1 + weight) in float32), scaled embeddings and GELU-tanh; Gemma 2 and 3 add norms after
# each block (``_SANDWICH_GEMMA_TYPES``), and with VaultGemma (Gemma 2's layer without those) soft-caps and
# their attention scale (``_SOFT_CAPPED_GEMMA_TYPES``).
_GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text", "vaultgemma")
_SANDWICH_GEMMA_TYPES = ("gemma2", "gemma3_text")
_SOFT_CAPPED_GEMMA_TYPES = (*_SANDWICH_GEMMA_TYPES, "vaultgemma")
# Image-text checkpoints whose language model is served on its own: Gemma 3 (4B and up), Idefics3, LLaVA,
# InternVL 3 / 3.5, LLaVA-NeXT, LLaVA-OneVision, Llama 4, Mistral Small 3.1 / 3.2, Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
# Qwen3-VL-MoE and SmolVLM. For a prompt of text alone
# the wrapper's logits are its language model's (the vision tower and projector only ever touch image tokens), so
# the model is its ``text_config``'s family; its images, where taken, replace their tokens' embeddings
# (``common.model.vision``).
IMAGE_TEXT_TYPES = ("gemma3", "idefics3", "internvl", "llama4", "llava", "llava_next", "llava_onevision", "mistral3",
                    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "smolvlm")
# Those whose images are implemented (``common.model.vision``); the others' images are refused by name.
IMAGE_INPUT_TYPES = tuple(kind for kind in IMAGE_TEXT_TYPES if kind != "llama4")


# LLaVA's vision towers whose images are implemented, by their config's model type: whether each has a CLS
# position before its patches' (``common.model.vision.LlavaEncoder``).
LLAVA_TOWERS = {"clip_vision_model": True, "siglip_vision_model": False, "pixtral": False}


def llava_image_refusal(tower: object, strategy: object) -> str | None:
    """Why a LLaVA checkpoint's images are not taken (its text is served): a vision tower or a
    ``vision_feature_select_strategy`` not implemented; None where they are."""
    if tower not in LLAVA_TOWERS:
        return (f"image input for a llava checkpoint with a {tower!r} vision tower is not implemented (its text is "
                f"served; towers: {', '.join(LLAVA_TOWERS)})")
    if strategy not in ("default", "full"):
        return f"image input with vision_feature_select_strategy {strategy!r} is not implemented (default, full)"
    return None


def llava_next_image_refusal(model_type: str, tower: object, strategy: object, aspect: object = None) -> str | None:
    """Why a LLaVA-NeXT or LLaVA-OneVision checkpoint's images are not taken (its text is served): a tower other
    than CLIP's or SigLIP's, a strategy that does not leave each tile one feature per patch (``default`` drops
    CLIP's CLS position, ``full`` keeps SigLIP's every one), OneVision's ``vision_aspect_ratio`` other than
    ``anyres_max_N``; None where they are."""
    if tower not in LLAVA_TOWERS or tower == "pixtral":
        return (f"image input for a {model_type} checkpoint with a {tower!r} vision tower is not implemented (its "
                "text is served; towers: clip_vision_model, siglip_vision_model)")
    if (strategy == "default") != LLAVA_TOWERS[str(tower)] or strategy not in ("default", "full"):
        return (f"image input for a {model_type} checkpoint with vision_feature_select_strategy {strategy!r} and a "
                f"{tower} tower is not implemented (a tile's features must be one per patch: default with CLIP, "
                "full with SigLIP)")
    if model_type == "llava_onevision" and not re.fullmatch(r"anyres_max_[1-9][0-9]*", str(aspect)):
        return f"image input with vision_aspect_ratio {aspect!r} is not implemented (anyres_max_N)"
    return None


def square_side(size: object, field: str, refused: type[Exception]) -> int:
    """A vision tower's side given as one integer or as two equal ones (InternVL's config lists them); ``refused``
    naming ``field`` otherwise (engine and router alike)."""
    sides = list(size) if isinstance(size, (list, tuple)) else [size, size]
    if len(sides) != 2 or sides[0] != sides[1] or not isinstance(sides[0], int) or isinstance(sides[0], bool):
        raise refused(f"image input with a vision_config.{field} of {size!r} is not implemented (square only)")
    return sides[0]


def image_input_refusal(model_type: str) -> str:
    """Why an image-text checkpoint of ``model_type`` (not in ``IMAGE_INPUT_TYPES``) is served its text alone."""
    return (f"image input for model type {model_type!r} is not implemented (its text is served; images are taken "
            f"for {', '.join(IMAGE_INPUT_TYPES)})")


# Language models of image-text checkpoints that are a served family's layer under another name: Qwen2.5-VL's
# is Qwen2's, Qwen3-VL's Qwen3's. Their M-RoPE gives each token three position ids (time, height, width)
# that, for text alone, are one: each section of the rotation then turns by that one position, which is
# the plain RoPE.
_TEXT_FAMILIES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
                  "qwen3_vl_moe_text": "qwen3_moe"}
# Qwen3-VL-MoE's: Qwen3-MoE's mixture, whose router always renormalizes its choice, and whose released
# checkpoints hold the stacked experts input-major (``[E, H, 2I]`` and ``[E, I, H]``), turned as they load
# where their shape says so (as transformers turns them).
_QWEN3_VL_MOE_TEXT = "qwen3_vl_moe_text"
_OLMO_TYPES = ("olmo2", "olmo3", "flex_olmo")
# Families whose modeling code reads a RoPE per layer type (``rope_parameters`` keyed by layer type).
_ROPE_PER_LAYER_TYPE = ("gemma3_text", "olmo3")
# Static RoPE kinds: their cos/sin tables depend on the position only, so precomputing them is exact.
# "dynamic" and "longrope" change frequencies with the sequence length at run time: refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Hunyuan's RoPE with a fixed NTK alpha (its checkpoints label it "dynamic"): base * alpha ** (d / (d - 2)).
NTK_ALPHA = "ntk_alpha"
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Fields that change the math, are not implemented, and must be unset (None/False/0) to load.
_UNSET_FIELDS = (
    "attn_logit_softcapping",  # Gemma 2: tanh soft-capping of attention scores
    "final_logit_softcapping",  # Gemma 2/3: tanh soft-capping of the logits
    "query_pre_attn_scalar",  # Gemma: a scale other than head_dim ** -0.5
    "use_qk_norm",  # Llama 4 style q/k norms (Qwen3's are its own family rule)
    "attention_chunk_size",  # chunked (local) attention
    "embedding_multiplier",  # Granite's scalings
    "logits_scaling",
    "residual_multiplier",
    "attention_multiplier",
    "use_bidirectional_attention",  # non-causal attention
    "clip_qkv",  # OLMoE / OLMo 1: q, k and v clamped
    "qk_layernorm",  # Phi's (and Persimmon's, StableLM's) LayerNorms of q and k
)
# ... except where a family implements them.
_GRANITE_SCALINGS = ("embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier")
_FAMILY_FIELDS = {
    **{gemma: ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")
       for gemma in _SOFT_CAPPED_GEMMA_TYPES},
    **{granite: _GRANITE_SCALINGS for granite in ("granite", *_GRANITE_MOE_TYPES)},
    "glm4_moe": ("use_qk_norm",),  # per-head q/k norms, as Qwen3's
    "minimax_m2": ("use_qk_norm",),  # its released configs set it; its modeling code norms q and k always
    "cohere": ("use_qk_norm",),  # Command R+'s LayerNorms of q and k, a weight per head
    "stablelm": ("qk_layernorm",),  # StableLM 2 12B's: the same
    "persimmon": ("qk_layernorm",),  # a LayerNorm of each head of q and k, one weight and bias for all heads
    "olmo": ("clip_qkv",),  # q, k and v clamped to [-clip_qkv, clip_qkv]
    "llama4_text": ("use_qk_norm", "attention_chunk_size"),  # its weightless q/k norms, its chunked layers
}
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
# Families whose transformers code keeps its norms in float32 when the model is in float16.
_FLOAT32_NORMS_UNDER_FLOAT16 = ("gpt_oss", "afmoe")
# Families whose MLP has no gate, down(act(up(x))), and the activation each implements: Arcee's squared
# ReLU, Apertus's xIELU (two learned scalars per layer, ``alpha_p`` and ``alpha_n``), StarCoder2's GELU in
# its tanh approximation (torch's), Phi's the same by its own formula (transformers' ``NewGELUActivation``),
# GPT-NeoX's exact GELU, Persimmon's squared ReLU, Falcon's exact GELU (its field ``activation``).
_UNGATED_ACTIVATIONS = {"arcee": "relu2", "apertus": "xielu", "starcoder2": "gelu_pytorch_tanh", "phi": "gelu_new",
                        "gpt_neox": "gelu", "persimmon": "relu2", "falcon": "gelu"}
# Families whose norms are torch's LayerNorm, a bias and all: StarCoder2's, Phi's (Phi-1, Phi-1.5, Phi-2) and
# StableLM's (its q/k norms, a LayerNorm per head, have none), GPT-NeoX's, Persimmon's and Falcon's.
_LAYER_NORM_TYPES = ("starcoder2", "phi", "stablelm", "gpt_neox", "persimmon", "falcon")
# OLMo 1's LayerNorms have neither weight nor bias, and an epsilon its code fixes (no config field names it).
_WEIGHTLESS_NORM_TYPES = ("olmo",)
_OLMO1_NORM_EPS = 1e-5
# Each norm's epsilon, where the config names it other than ``rms_norm_eps``.
_NORM_EPS_FIELDS = {"cohere": "layer_norm_eps", "cohere2": "layer_norm_eps", "phi": "layer_norm_eps",
                    "stablelm": "layer_norm_eps", "gpt_neox": "layer_norm_eps", "starcoder2": "norm_epsilon",
                    "persimmon": "layer_norm_eps", "falcon": "layer_norm_epsilon"}


class UnsupportedConfig(ValueError):
    """A config field this engine does not implement; the message names the field."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        super().__init__(f"unsupported model config: {field}={value!r} ({why}); refusing to load the model")
        self.field = field


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k, before RoPE (Qwen3; Gemma 3 in Gemma's form)
    sliding_windows: tuple[int | None, ...]  # per layer: a query sees itself and the window - 1 before it
    rope_type: str  # "default" where every layer's RoPE is the default one (its tables need no transformers)
    # Each layer's key into ``rope_parameters`` where the family has a RoPE per layer type, else None.
    rope_layer_types: tuple[str, ...] | None
    # AFMoE's: the attention's output times sigmoid(``output_gate``(x)), each head's entries, before ``o_proj``.
    attn_output_gate: bool = False
    # Cohere's q and k norms keep a weight per head (``[heads, head_dim]``), where others share one.
    qk_norm_per_head: bool = False
    # Hunyuan's: the per-head RMSNorm of q and k after RoPE (``query_layernorm`` / ``key_layernorm``).
    qk_norm_after_rope: bool = False
    # Layers that apply no RoPE at all (SmolLM3's ``no_rope_layers`` zeros): their q and k go unrotated.
    no_rope_layers: tuple[int, ...] = ()
    # Llama 4's chunked local attention: per layer, the chunk of positions a query's keys must share with it
    # (``attention_chunk_size`` in its ``chunked_attention`` layers), None for all of them. Empty: none anywhere.
    attention_chunks: tuple[int | None, ...] = ()
    # Llama 4's q and k norms (``use_qk_norm``): an RMSNorm of each head without a weight, after RoPE, in the layers
    # that rotate.
    qk_norm_weightless_after_rope: bool = False
    # Llama 4's attention temperature (``attn_temperature_tuning``), ``(floor_scale, attn_scale)``: in the layers
    # without RoPE, each token's queries times 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)),
    # in float32, rounded once.
    query_temperature: tuple[float, float] | None = None
    # "silu" or "gelu_tanh" (both gated: down(act(gate) * up)), or without a gate, down(act(up)): "relu2"
    # (relu(x)^2), "xielu" (Apertus's), "gelu_pytorch_tanh" (StarCoder2's), "gelu_new" (Phi's) or "gelu" (GPT-NeoX's).
    activation: str = "silu"
    # Norms on each side of each block (Gemma 2/3, GLM-4, AFMoE): a block's output normed before it joins the
    # stream.
    sandwich_norms: bool = False
    norm_form: int = NORM_LLAMA  # how every RMSNorm meets its weight (``pdserve_kernels.reference.NORM_*``)
    norm_bias: bool = False  # every norm with a bias (``NORM_LAYER`` only: torch's LayerNorm, StarCoder2's)
    # OLMo 1's: every norm without weight or bias (``NORM_LAYER`` met with a weight of ones, exact: x * 1 is x).
    norm_weightless: bool = False
    qk_norm_bias: bool = False  # Persimmon's q/k LayerNorms: a bias too (one weight and bias for all heads)
    clip_qkv: float | None = None  # OLMo 1's: q, k and v clamped to [-clip_qkv, clip_qkv] after their projections
    # The MLP's width where the config names it other than ``intermediate_size`` (Falcon's ``ffn_hidden_size``).
    mlp_width: int | None = None
    # OLMo's layer: no norm before a block, one after each (the block's output normed, then added);
    # q and k normed across all their heads (one norm of q_size, one of kv_size), before RoPE.
    post_norms_only: bool = False
    qk_norm_full_width: bool = False
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale is its -0.5 power (default: head_dim's)
    attn_soft_cap: float | None = None  # scores become cap * tanh(scores / cap)
    final_soft_cap: float | None = None  # the same for the logits
    # Granite's: embeddings times ``embedding_multiplier``; ``attention_multiplier`` as the attention
    # scale; each block's output times ``residual_multiplier`` before it joins the residual stream;
    # logits divided by ``logits_scaling``.
    embedding_multiplier: float | None = None
    attention_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    # A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) in the layers ``moe_layers``: a router
    # picks ``experts_per_token`` of ``num_experts`` gated MLPs (each ``moe_intermediate_size`` wide) by
    # softmax, their weights renormalized to sum to 1 where ``norm_topk_prob``, kept in float32 where
    # ``routing_weights_float32`` (Mixtral) or else rounded to the model's dtype. Qwen2-MoE adds a shared
    # expert every token goes through (``shared_expert_intermediate_size`` wide), scaled by a sigmoid gate
    # (``shared_expert_gated``); Granite's and GLM-4.5's are added as they are. ``router``: how the
    # experts are picked and weighed (``ROUTER_*``).
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    routing_weights_float32: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False
    router: str = ROUTER_SOFTMAX_TOPK
    num_expert_groups: int = 1  # the sigmoid router's groups and how many of them a token may use
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # Qwen3-VL-MoE's checkpoints: the stacked experts input-major, turned as they load.
    experts_input_major: bool = False
    # AFMoE's: the router's correction bias kept in float32 whatever the model's dtype, as transformers keeps it.
    router_bias_float32: bool = False
    # Each head's first entries that RoPE rotates (a partial RoPE, GLM-4.5's); None: all of them.
    rotary_dim: int | None = None
    # RoPE over interleaved pairs (GLM, Helium, ERNIE 4.5, Cohere): served by rotating halves after the
    # checkpoint's q and k rows are reordered as they load (``common.model.weights.deinterleave_rope``), each head's
    # even entries first: the same rotation of the same numbers, q . k a sum over the same products.
    rope_interleaved: bool = False
    # ERNIE 4.5's and Cohere's: q and k rotated in float32 and rounded once (others round each operation to
    # the model's dtype); ERNIE's tables in float32 too (``rope_tables_float32``), Cohere's rounded to the dtype.
    rope_float32: bool = False
    rope_tables_float32: bool = False
    lm_head_bias: bool = False  # the output head with a bias: ERNIE 4.5's mixture's (``use_bias``), Phi's
    norm_eps: float = 1e-6  # every norm's epsilon: ``rms_norm_eps``, or Cohere's ``layer_norm_eps``
    # Cohere's layer: attention and MLP both read the one input norm, their outputs added to the stream in turn;
    # Phi's: the same layer, the two outputs summed first, then added to the stream (``parallel_sum_first``).
    parallel_block: bool = False
    parallel_sum_first: bool = False
    parallel_mlp_norm: bool = False  # GPT-NeoX's (Falcon's new layer's): the MLP reads a norm of its own of the stream
    logit_scale: float | None = None  # Cohere's: the logits multiplied by it, in the weights' dtype
    # Ministral 3's: each token's rotated queries times 1 + beta * log(1 + floor(position / positions)), with
    # beta ``rope_parameters.llama_4_scaling_beta`` and positions its ``original_max_position_embeddings``.
    query_scale_beta: float | None = None
    query_scale_positions: int = 1
    # gpt-oss: a learned sink logit per query head in every softmax (``sinks``); its experts' projections
    # with biases, and their activation its own clamped one (``EXPERT_ACTIVATION_GPT_OSS``).
    attention_sinks: bool = False
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # Quantized weights, widened to the model's dtype as they load (the model transformers runs with its
    # quantization config's ``dequantize=True``): ``QUANT_MXFP4``, gpt-oss's released experts (``*_blocks``
    # and ``*_scales``), or ``QUANT_FP8``, 8-bit weights with a scale per block (``weight_scale_inv``: Qwen's,
    # Mistral's and DeepSeek's FP8 checkpoints), or integer weights (``QUANT_GPTQ``, ``QUANT_AWQ``,
    # ``QUANT_COMPRESSED_TENSORS``), whose layout ``int_weights`` says (``common.model.quantization``). None: none.
    quantization: str | None = None
    int_weights: IntWeights | None = None
    # 8-bit e4m3 weights, each with scales over a grid of blocks: ``QUANT_FP8``'s (``weight_scale_inv``), or
    # compressed-tensors' ``float-quantized`` ones (``weight_scale``, per channel, tensor or block: a block a row, one,
    # or a grid).
    fp8_weights: bool = False
    # DeepSeek's Multi-head Latent Attention (``common.model.mla``): one latent KV head per token, its dims the
    # config's (``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``q_lora_rank``);
    # ``rotary_dim`` then the rotated key's width, ``rope_interleaved`` its pairs' layout in the checkpoint.
    mla: bool = False

    def check_dtype(self, dtype_name: str) -> None:
        """Refuse a dtype this family is not computed in as transformers computes it: gpt-oss and AFMoE keep
        their norms in float32 under float16 (their ``_keep_in_fp32_modules``), which these kernels, whose
        norm weights share the activations' dtype, do not."""
        if dtype_name == "float16" and self.model_type in _FLOAT32_NORMS_UNDER_FLOAT16:
            raise UnsupportedConfig("dtype", dtype_name, f"transformers keeps {self.model_type}'s norms in float32 under "
                                    "float16; serve it in bfloat16 or float32")

    def check_tensor_parallel(self, config: Any, size: int) -> None:
        """Refuse, naming the field, a model that ``size`` ranks cannot each hold an equal share of
        (``common.model.parallel``): the query and KV heads, the MLP's, each expert's and the shared expert's
        width must divide by ``size``, and q and k must not be normed across all heads at once (OLMo's norm
        would need every rank's heads)."""
        if size == 1:
            return
        config = language_model_config(config)
        flag = f"--tensor-parallel-size {size}"
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % size:
            raise UnsupportedConfig("num_attention_heads", heads, f"must divide by {flag}")
        # Multi-head Latent Attention's one latent head is every rank's whole (each computes and caches it); fewer
        # KV heads than ranks are replicated, each on the ranks whose query heads read it (as vLLM's).
        if not self.mla and (kv_heads % size if kv_heads >= size else size % kv_heads):
            raise UnsupportedConfig("num_kv_heads" if self.model_type == "falcon" else "num_key_value_heads", kv_heads,
                                    f"must divide by {flag}, or divide it (each KV head then replicated on "
                                    f"{flag.split()[-1]} / heads ranks)")
        if self.qk_norm_full_width:
            raise UnsupportedConfig("model_type", self.model_type, f"q and k are normed across all heads at once, "
                                    f"which {flag} splits among ranks: not implemented")
        widths = []  # (field, width) of every MLP the model has
        if len(self.moe_layers) < int(config.num_hidden_layers):
            widths.append((_MLP_WIDTH_FIELDS.get(self.model_type, "ffn_hidden_size"), self.mlp_width) if self.mlp_width
                          else ("intermediate_size", config.intermediate_size))
        if self.moe_layers:
            widths.append((_experts_width_field(self.model_type), self.moe_intermediate_size))
            shared_field = _SHARED_EXPERT_WIDTH_FIELDS.get(self.model_type)
            if self.shared_expert_intermediate_size and shared_field:
                widths.append((shared_field, self.shared_expert_intermediate_size))
        for field, width in widths:
            if width % size:
                raise UnsupportedConfig(field, width, f"must divide by {flag}")

    @classmethod
    def from_config(cls, config: Any) -> ModelArch:
        config = language_model_config(config)
        model_type = getattr(config, "model_type", None)
        text_model_type = model_type
        if isinstance(model_type, str):  # Qwen-VL's language models: Qwen2's and Qwen3's layers
            model_type = _TEXT_FAMILIES.get(model_type, model_type)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfig("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        implemented = _FAMILY_FIELDS.get(model_type, ())
        for field in _UNSET_FIELDS:
            value = getattr(config, field, None)
            if field not in implemented and value not in (None, False, 0, {}):
                raise UnsupportedConfig(field, value, f"not implemented for {model_type}")
        if model_type in _GEMMA_TYPES:
            act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
            if act not in _GEMMA_ACTIVATIONS:
                raise UnsupportedConfig("hidden_activation", act, f"supported: {', '.join(_GEMMA_ACTIVATIONS)}")
        elif model_type in _UNGATED_ACTIVATIONS:  # its MLP has no gate: down(act(up(x)))
            act_field = "activation" if model_type == "falcon" else "hidden_act"
            act = getattr(config, act_field, None)
            if act != _UNGATED_ACTIVATIONS[model_type]:
                raise UnsupportedConfig(act_field, act, f"only {_UNGATED_ACTIVATIONS[model_type]} is implemented "
                                        f"for {model_type}")
        else:
            act = getattr(config, "hidden_act", "silu")
            if act != "silu":
                raise UnsupportedConfig("hidden_act", act, "only silu is implemented")
        eps_field = _NORM_EPS_FIELDS.get(model_type, "rms_norm_eps")
        norm_eps = _OLMO1_NORM_EPS if model_type in _WEIGHTLESS_NORM_TYPES else getattr(config, eps_field, None)
        if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or norm_eps <= 0:
            raise UnsupportedConfig(eps_field, norm_eps, "must be a positive number (only RMSNorm and LayerNorm are "
                                    "implemented)")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise UnsupportedConfig("num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
        if model_type in ("persimmon", "falcon"):  # their attention splits hidden_size into the heads, whatever head_dim says
            head_dim = getattr(config, "head_dim", None)
            if config.hidden_size % heads or head_dim not in (None, config.hidden_size // heads):
                raise UnsupportedConfig("head_dim", head_dim, f"{model_type}'s heads are hidden_size / "
                                        f"num_attention_heads wide (and must divide it)")
        if model_type == "persimmon" and kv_heads != heads:  # its code has no grouped-query attention
            raise UnsupportedConfig("num_key_value_heads", kv_heads, f"persimmon gives every head its k and v ({heads})")
        falcon = _falcon_layer(config, heads) if model_type == "falcon" else {}
        llama4 = _llama4_fields(config) if model_type == "llama4_text" else {}
        mla = _mla_fields(config, model_type, heads, kv_heads) if model_type in _MLA_TYPES else {}
        bias = bool(getattr(config, "attention_bias", False))
        mlp = bool(getattr(config, "mlp_bias", False))
        qkv_bias, o_bias, mlp_bias = (
            (bias, bias, mlp) if model_type in _LLAMA_BIAS_TYPES
            else (bias, bias, False) if model_type in _ATTENTION_BIAS_TYPES
            else (False, False, False) if model_type in _NO_BIAS_TYPES
            else (bool(getattr(config, "use_bias", False)),) * 3 if model_type in _USE_BIAS_TYPES
            else {  # (q/k/v, o, MLP) biases, as each other family's modeling code has them
                "qwen2": (True, False, False),
                "qwen2_moe": (bool(getattr(config, "qkv_bias", True)), False, False),
                "glm4_moe": (bias, False, False),
                "glm": (bias, False, False),
                "glm4": (bias, False, False),
                "phi": (True, True, True),
                "stablelm": (bool(getattr(config, "use_qkv_bias", False)), False, False),
                "gpt_neox": (bias, bias, True),
                "persimmon": (True, True, True),
                "falcon": (bool(getattr(config, "bias", False)),) * 3,
                "helium": (bias, False, mlp),
                # q_a_proj and kv_a_proj_with_mqa (``qkv_bias``) and o_proj by attention_bias; V2's MLPs by mlp_bias
                "deepseek_v2": (bias, bias, mlp),
                "deepseek_v3": (bias, bias, False),
                # q/k/v by attention_bias, the output projection by a field of its own
                "seed_oss": (bias, bool(getattr(config, "attention_out_bias", False)), mlp),
            }[model_type]
        )
        gemma, olmo = model_type in _GEMMA_TYPES, model_type in _OLMO_TYPES
        moe = _moe_fields(config, model_type) if model_type in _MOE_TYPES else {}
        if text_model_type == _QWEN3_VL_MOE_TEXT:
            moe.update(norm_topk_prob=True, experts_input_major=True)
        rope_type, rope_layer_types = _rope(config, model_type)
        rotary_dim = mla.pop("rotary_dim") if mla else _rotary_dim(config, model_type)
        mla_interleaved = bool(mla.pop("rope_interleaved", False))
        return cls(
            model_type=model_type,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", "dots1", "exaone4", "apertus", "afmoe") or (
                model_type in ("glm4_moe", "cohere") and bool(getattr(config, "use_qk_norm", False))) or (
                model_type in ("stablelm", "persimmon") and bool(getattr(config, "qk_layernorm", False))),
            qk_norm_per_head=model_type in ("cohere", "stablelm"),
            qk_norm_bias=model_type == "persimmon",
            qk_norm_after_rope=model_type in _HUNYUAN_TYPES,
            sliding_windows=_sliding_windows(config, model_type),
            rotary_dim=rotary_dim,
            attention_sinks=model_type == "gpt_oss",
            rope_interleaved=model_type in _INTERLEAVED_ROPE_TYPES or mla_interleaved,
            # OLMo 1's tables stay float32 too, and its q and k meet them there (rounded once), as ERNIE's; DeepSeek-V2
            # rotates in float32 (complex numbers of its float32 tables), rounded once.
            # Llama 4's too (complex numbers of its float32 tables, as DeepSeek-V2's).
            rope_float32=model_type in (*_ERNIE_TYPES, *_COHERE_TYPES, "olmo", "deepseek_v2", "llama4_text"),
            rope_tables_float32=model_type in (*_ERNIE_TYPES, "olmo", "deepseek_v2", "llama4_text"),
            lm_head_bias=model_type == "phi" or (model_type == "ernie4_5_moe" and bool(getattr(config, "use_bias", False))),
            rope_type=rope_type,
            rope_layer_types=rope_layer_types,
            no_rope_layers=_no_rope_layers(config, model_type),
            activation="gelu_tanh" if gemma else _UNGATED_ACTIVATIONS.get(model_type, "silu"),
            sandwich_norms=model_type in (*_SANDWICH_GEMMA_TYPES, "glm4", "afmoe"),
            attn_output_gate=model_type == "afmoe",
            # Helium's and AFMoE's RMSNorms meet their weight in float32, as OLMo's.
            norm_form=(NORM_GEMMA if gemma else NORM_OLMO if olmo or model_type in ("helium", "afmoe")
                       else NORM_LAYER if model_type in (*_COHERE_TYPES, *_LAYER_NORM_TYPES, *_WEIGHTLESS_NORM_TYPES)
                       else NORM_LLAMA),
            norm_bias=model_type in _LAYER_NORM_TYPES,
            norm_weightless=model_type in _WEIGHTLESS_NORM_TYPES,
            norm_eps=float(norm_eps),
            clip_qkv=_positive_or_none(config, "clip_qkv") if model_type == "olmo" else None,
            parallel_block=falcon.get("parallel_block", model_type in (*_COHERE_TYPES, "phi") or (
                model_type in ("stablelm", "gpt_neox") and bool(getattr(config, "use_parallel_residual", False)))),
            parallel_sum_first=falcon.get("parallel_sum_first", model_type in ("phi", "gpt_neox")),
            parallel_mlp_norm=falcon.get("parallel_mlp_norm", model_type == "gpt_neox"),
            mlp_width=falcon.get("mlp_width", llama4.pop("mlp_width", None)),
            logit_scale=_positive_or_none(config, "logit_scale") if model_type in _COHERE_TYPES else None,
            **_quantization(config, model_type),
            **(_query_scale(config) if model_type == "ministral3" else {}),
            post_norms_only=olmo or model_type == "exaone4",  # EXAONE 4's in Llama's norm form
            qk_norm_full_width=olmo or model_type in ("olmoe", "minimax_m2"),
            embed_scale=float(config.hidden_size) ** 0.5 if gemma else None,
            # Set only where the family implements them (checked above).
            query_pre_attn_scalar=_positive_or_none(config, "query_pre_attn_scalar"),
            attn_soft_cap=_positive_or_none(config, "attn_logit_softcapping"),
            final_soft_cap=_positive_or_none(config, "final_logit_softcapping"),
            **_granite_scalings(config, model_type),
            **moe,
            **mla,
            **llama4,
        )

    @property
    def kv_window(self) -> int | None:
        """How far back any layer's query reads keys: a query at position ``p`` reads none before
        ``p - kv_window + 1``. None where some layer attends to the whole context. The KV cache frees a
        sequence's blocks that lie wholly before that (``KVCacheManager.release_out_of_window``)."""
        windows = self.sliding_windows
        if not windows or None in windows:
            return None
        return max(w for w in windows if w is not None)


def language_model_config(config: Any) -> Any:
    """The config of the language model a checkpoint runs: its own, or an image-text wrapper's
    ``text_config`` (``IMAGE_TEXT_TYPES``) with what transformers reads from the wrapper instead: whether the
    output head shares the embedding (``tie_word_embeddings``), the EOS id where the text config has none, and
    how the checkpoint's weights are quantized (``quantization_config``, which quantizers write on the wrapper)."""
    if getattr(config, "model_type", None) not in IMAGE_TEXT_TYPES:
        return config
    text = getattr(config, "text_config", None)
    if text is None:
        raise UnsupportedConfig("text_config", None, f"{config.model_type} needs its language model's config")
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    if getattr(text, "eos_token_id", None) is None:
        text.eos_token_id = getattr(config, "eos_token_id", None)
    if getattr(text, "quantization_config", None) in (None, {}) and getattr(config, "quantization_config", None):
        text.quantization_config = config.quantization_config
    return text


def _query_scale(config: Any) -> dict[str, Any]:
    """Ministral 3's query scaling, from its RoPE parameters (its modeling code reads both there)."""
    params = rope_parameters(config)
    beta, positions = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or beta < 0:
        raise UnsupportedConfig("rope_parameters.llama_4_scaling_beta", beta, "must be a number, 0 or more")
    if not _positive_int(positions):
        raise UnsupportedConfig("rope_parameters.original_max_position_embeddings", positions,
                                "must be a positive integer (the query scaling's period)")
    return {"query_scale_beta": float(beta), "query_scale_positions": positions}


def _falcon_layer(config: Any, heads: int) -> dict[str, Any]:
    """Falcon's layer, as its transformers code builds and runs each variant, checked: ALiBi refused; the new
    architecture (Falcon-40B/180B, grouped q/k/v) attention and MLP side by side on two norms of the stream,
    or on one (``num_ln_in_parallel_attn`` 1), their outputs summed before the stream; the old one side by side
    on one norm (``parallel_attn``, Falcon-7B) or in turn on two (Llama's layer). Variants its code cannot run
    (the new architecture in turn, two norms in the old one) are refused by name, as is a ``num_kv_heads`` the
    old, multi-head layout does not hold."""
    if getattr(config, "alibi", False):
        raise UnsupportedConfig("alibi", config.alibi, "ALiBi position biases are not implemented (only RoPE)")
    new, parallel = bool(getattr(config, "new_decoder_architecture", False)), bool(getattr(config, "parallel_attn", True))
    norms = getattr(config, "num_ln_in_parallel_attn", None)
    if new and not parallel:
        raise UnsupportedConfig("parallel_attn", False, "the new decoder architecture runs attention and MLP side by side")
    if (new and norms not in (None, 1, 2)) or (not new and parallel and norms not in (None, 1)):
        raise UnsupportedConfig("num_ln_in_parallel_attn", norms, "1 or 2 with new_decoder_architecture, else 1 or unset")
    if not new and not getattr(config, "multi_query", True) and getattr(config, "num_kv_heads", heads) not in (None, heads):
        raise UnsupportedConfig("num_kv_heads", config.num_kv_heads, "without multi_query or the new architecture, "
                                f"every head has its k and v ({heads})")
    width = getattr(config, "ffn_hidden_size", None) or 4 * config.hidden_size
    if not _positive_int(width):
        raise UnsupportedConfig("ffn_hidden_size", width, "must be a positive integer")
    return {"parallel_block": parallel, "parallel_sum_first": parallel, "parallel_mlp_norm": new and norms != 1,
            "mlp_width": width}


def _granite_scalings(config: Any, model_type: str) -> dict[str, Any]:
    scalings = {name: _positive_or_none(config, name) for name in _GRANITE_SCALINGS}
    if model_type == "afmoe" and getattr(config, "mup_enabled", False):
        # AFMoE's muP: the embeddings times sqrt(hidden_size), the number as it is, as Granite's multiplier.
        scalings["embedding_multiplier"] = float(config.hidden_size) ** 0.5
    return scalings


def _moe_fields(config: Any, model_type: str) -> dict[str, Any]:
    """A mixture-of-experts family's ``ModelArch`` fields, checked; which layers have experts follows its
    transformers code (Qwen's: every ``decoder_sparse_step``-th layer outside ``mlp_only_layers``)."""
    num_layers = int(config.num_hidden_layers)
    mixtral = model_type == "mixtral"
    # transformers maps Qwen's and OLMoE's ``num_experts`` to ``num_local_experts`` (as a saved config names
    # it), and ``num_local_experts`` to GLM-4.5's ``n_routed_experts``.
    # ERNIE 4.5's config stores them as ``moe_num_experts`` and ``moe_k`` (a config read back from the cache).
    num_experts = (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
                   or getattr(config, "n_routed_experts", None) or getattr(config, "moe_num_experts", None))
    top_k = (getattr(config, "moe_topk", None) if model_type == "hunyuan_v1_moe"
             else getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_k", None))
    inter = getattr(config, _experts_width_field(model_type), None)
    if not _positive_int(num_experts):  # Hunyuan's may be a list, one per layer: not implemented
        raise UnsupportedConfig("num_local_experts", num_experts, "must be a positive integer")
    if not _positive_int(top_k) or top_k > num_experts:
        raise UnsupportedConfig("moe_topk" if model_type == "hunyuan_v1_moe" else "num_experts_per_tok", top_k,
                                f"must be 1 to the number of experts ({num_experts})")
    if not _positive_int(inter):
        raise UnsupportedConfig("moe_intermediate_size", inter, "must be a positive integer")
    moe_layers = tuple(range(num_layers))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step, dense = getattr(config, "decoder_sparse_step", 1), getattr(config, "mlp_only_layers", None) or []
        if not _positive_int(step):
            raise UnsupportedConfig("decoder_sparse_step", step, "must be a positive integer")
        if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in dense):
            raise UnsupportedConfig("mlp_only_layers", dense, f"must list layers 0 to {num_layers - 1}")
        moe_layers = tuple(i for i in moe_layers if i not in dense and (i + 1) % step == 0)
    if model_type in _DEEPSEEK_ROUTED_TYPES:
        moe_layers = _after_dense_layers(config, "first_k_dense_replace", num_layers)
    if model_type == "ernie4_5_moe":
        moe_layers = _ernie_moe_layers(config, num_layers)
    if model_type == "deepseek_v2":
        moe_layers = _after_dense_layers(config, "first_k_dense_replace", num_layers)
    shared = getattr(config, "shared_expert_intermediate_size", None) if model_type == "qwen2_moe" else 0
    if model_type == "qwen2_moe" and not _positive_int(shared):
        raise UnsupportedConfig("shared_expert_intermediate_size", shared, "must be a positive integer")
    router: dict[str, Any] = {}  # a sigmoid router's fields
    if model_type in _DEEPSEEK_ROUTED_TYPES:
        router = _sigmoid_router_fields(config, num_experts, top_k)
        shared = _shared_experts_width(config, "n_shared_experts", inter)
    if model_type == "deepseek_v2":
        router = _deepseek_v2_router_fields(config, num_experts, top_k)
        shared = _shared_experts_width(config, "n_shared_experts", inter)
    if model_type == "gpt_oss":
        swiglu = {field: _positive_or_none(config, field) for field in ("swiglu_alpha", "swiglu_limit")}
        for field, value in swiglu.items():
            if value is None:
                raise UnsupportedConfig(field, value, "must be a positive number")
        router = {"router": ROUTER_TOPK_SOFTMAX_BIASED, "expert_bias": True, "expert_activation": "gpt_oss", **swiglu}
    if model_type == "hunyuan_v1_moe":  # a shared MLP as wide as the dense one, ungated
        shared = getattr(config, "intermediate_size", None)
    if model_type == "minimax_m2":  # weights in float32, as its router leaves them
        router = {"router": ROUTER_SIGMOID, "routing_weights_float32": True}
    if model_type == "ernie4_5_moe":
        router = _ernie_router_fields(config, num_experts, top_k)
        shared = _shared_experts_width(config, "moe_num_shared_experts", inter)
    if model_type == "afmoe":  # MiniMax-M2's router, scaled; its first layers dense, shared experts beside
        moe_layers = _after_dense_layers(config, "num_dense_layers", num_layers)
        shared = _shared_experts_width(config, "num_shared_experts", inter)
        scale = _positive_or_none(config, "route_scale") or 1.0
        router = {"router": ROUTER_SIGMOID, "routing_weights_float32": True, "routed_scaling_factor": scale,
                  "router_bias_float32": True}
    if model_type == "llama4_text":  # its mixture's layers listed; a shared expert as wide as each routed one
        moe_layers = _listed_layers(config, "moe_layers", num_layers)
        shared = inter
        router = {"router": ROUTER_SIGMOID_SCALED_INPUT, "experts_input_major": True}
    if model_type == "granitemoeshared":  # 0: no shared expert
        shared = getattr(config, "shared_intermediate_size", 0)
        if shared != 0 and not _positive_int(shared):
            raise UnsupportedConfig("shared_intermediate_size", shared, "must be 0 or a positive integer")
    return {
        "moe_layers": moe_layers, "num_experts": num_experts, "experts_per_token": top_k,
        "moe_intermediate_size": inter,
        # Mixtral always renormalizes the chosen experts' weights, and keeps them in float32.
        "norm_topk_prob": mixtral or model_type in ("minimax_m2", "hunyuan_v1_moe", "afmoe")
        or bool(getattr(config, "norm_topk_prob", False)),
        "routing_weights_float32": mixtral, "shared_expert_intermediate_size": shared,
        "shared_expert_gated": model_type == "qwen2_moe",
        "router": ROUTER_TOPK_SOFTMAX if model_type in _GRANITE_MOE_TYPES else ROUTER_SOFTMAX_TOPK, **router,
    }


def _listed_layers(config: Any, field: str, num_layers: int) -> tuple[int, ...]:
    """The layers a config field lists (Llama 4's ``moe_layers``), checked."""
    layers = getattr(config, field, None)
    if not isinstance(layers, (list, tuple)) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers for i in layers):
        raise UnsupportedConfig(field, layers, f"must list layers 0 to {num_layers - 1}")
    return tuple(sorted(set(layers)))


def _llama4_fields(config: Any) -> dict[str, Any]:
    """Llama 4's text model, as its transformers code runs it, checked: its dense layers' width
    (``intermediate_size_mlp``); its layers of chunked attention (``layer_types``, each chunk
    ``attention_chunk_size`` positions), which its masks read, whatever ``no_rope_layers`` says; its
    weightless q/k norms in the layers that rotate (``use_qk_norm``); its attention temperature in the others
    (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``)."""
    num_layers = int(config.num_hidden_layers)
    width = getattr(config, "intermediate_size_mlp", None)
    if not _positive_int(width):
        raise UnsupportedConfig("intermediate_size_mlp", width, "must be a positive integer")
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    if len(layer_types) != num_layers or any(kind not in ("full_attention", "chunked_attention") for kind in layer_types):
        raise UnsupportedConfig("layer_types", layer_types, f"needs full_attention or chunked_attention for each of "
                                f"the {num_layers} layers")
    chunk = getattr(config, "attention_chunk_size", None)
    if "chunked_attention" in layer_types and not _positive_int(chunk):
        raise UnsupportedConfig("attention_chunk_size", chunk, "must be a positive integer (layer_types marks "
                                "chunked layers)")
    fields: dict[str, Any] = {
        "mlp_width": width,
        "attention_chunks": tuple(chunk if kind == "chunked_attention" else None for kind in layer_types),
        "qk_norm_weightless_after_rope": bool(getattr(config, "use_qk_norm", False)),
    }
    if getattr(config, "attn_temperature_tuning", False):
        scales = {field: _positive_or_none(config, field) for field in ("floor_scale", "attn_scale")}
        for field, value in scales.items():
            if value is None:
                raise UnsupportedConfig(field, getattr(config, field, None), "must be a positive number "
                                        "(attn_temperature_tuning is on)")
        fields["query_temperature"] = (scales["floor_scale"], scales["attn_scale"])
    return fields


def _experts_width_field(model_type: str) -> str:
    return "moe_intermediate_size" if model_type in _OWN_EXPERT_WIDTH_TYPES else "intermediate_size"


def _after_dense_layers(config: Any, field: str, num_layers: int) -> tuple[int, ...]:
    """The mixture's layers: all but the first ``field`` (GLM-4.5's ``first_k_dense_replace``, AFMoE's
    ``num_dense_layers``), which are dense."""
    first = getattr(config, field, 0) or 0
    if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first <= num_layers:
        raise UnsupportedConfig(field, first, f"must be 0 to {num_layers}")
    return tuple(range(first, num_layers))


def _shared_experts_width(config: Any, field: str, inter: int) -> int:
    """The shared experts' width: as many experts as ``field`` says, one ungated MLP as wide as all of them
    together, as transformers builds it (0: none)."""
    n_shared = getattr(config, field, 0) or 0
    if not isinstance(n_shared, int) or n_shared < 0:
        raise UnsupportedConfig(field, n_shared, "must be 0 or a positive integer")
    return inter * n_shared


def _quantization(config: Any, model_type: str) -> dict[str, Any]:
    """The checkpoint's weight quantization (``ModelArch.quantization`` and ``int_weights``), checked:
    gpt-oss's MXFP4 experts (transformers quantizes only those, whatever ``modules_to_not_convert`` lists),
    block-wise FP8 weights whose activations are quantized on the fly (``activation_scheme: dynamic``),
    which widened weights compute as transformers' dequantized model does, or integer weights with
    unquantized activations (GPTQ, AWQ, compressed-tensors); anything else refused by name."""
    if getattr(config, "quantization_config", None) in (None, {}):
        return {}
    method, fields = quantization_fields(config)
    if method == QUANT_MXFP4 and model_type == "gpt_oss":
        return {"quantization": QUANT_MXFP4}
    if method == QUANT_FP8:
        if fields.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedConfig("quantization_config.activation_scheme", fields.get("activation_scheme"),
                                    "only dynamic is implemented (static activation scales change the math)")
        block = fields.get("weight_block_size")
        if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
                _positive_int(b) for b in block)):
            raise UnsupportedConfig("quantization_config.weight_block_size", block, "must be two positive integers")
        return {"quantization": QUANT_FP8, "fp8_weights": True}
    readers = {QUANT_GPTQ: _gptq_weights, QUANT_AWQ: _awq_weights, QUANT_COMPRESSED_TENSORS: _compressed_weights}
    if method in readers:
        if model_type == "gpt_oss":
            raise UnsupportedConfig("quantization_config.quant_method", method, "gpt-oss's experts are fused "
                                    "tensors, not linear layers: integer weights are not implemented for it")
        weights = readers[method](fields)
        if weights is None:  # compressed-tensors' 8-bit floats
            return {"quantization": method, "fp8_weights": True}
        return {"quantization": method, "int_weights": weights}
    raise UnsupportedConfig("quantization_config.quant_method", method,
                            "implemented: fp8 (block-wise, dynamic activations), gptq, awq, compressed-tensors "
                            "(integer weights; FP8 weights with dynamic activations), and mxfp4 for gpt-oss's experts")


def _gptq_weights(fields: dict[str, Any]) -> IntWeights:
    """GPTQ (AutoGPTQ's and GPTQModel's checkpoints): 2, 4 or 8 bits in int32 words, in the original format
    (zero points stored minus one) or GPTQModel's v2; ``desc_act``'s group order comes with ``g_idx``."""
    bits = fields.get("bits")
    if bits not in (2, 4, 8):
        raise UnsupportedConfig("quantization_config.bits", bits, "implemented for gptq: 2, 4 and 8")
    layout = fields.get("checkpoint_format") or fields.get("format") or "gptq"
    if layout not in ("gptq", "gptq_v2"):
        raise UnsupportedConfig("quantization_config.checkpoint_format", layout, "implemented: gptq, gptq_v2")
    if fields.get("is_marlin_format"):
        raise UnsupportedConfig("quantization_config.is_marlin_format", True, "Marlin's repacked layout is not "
                                "implemented (gptq's is)")
    if str(fields.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise UnsupportedConfig("quantization_config.pack_dtype", fields.get("pack_dtype"), "implemented: int32")
    return IntWeights(QUANT_GPTQ, (bits,), zeros_minus_one=layout == "gptq")


def _awq_weights(fields: dict[str, Any]) -> IntWeights:
    """AWQ in AutoAWQ's GEMM layout (``version: gemm``, the one its 4-bit releases use)."""
    if fields.get("bits", fields.get("w_bit")) != 4:
        raise UnsupportedConfig("quantization_config.bits", fields.get("bits"), "implemented for awq: 4")
    version = str(fields.get("version", "gemm")).lower()
    version = version.removeprefix("awqlinearversion.")  # transformers' enum, written by name
    if version != "gemm":
        raise UnsupportedConfig("quantization_config.version", fields.get("version"), "implemented for awq: gemm")
    if fields.get("zero_point", True) is not True:  # AutoAWQ's releases; without, implementations disagree
        raise UnsupportedConfig("quantization_config.zero_point", fields.get("zero_point"), "implemented for awq: true")
    if fields.get("backend") not in (None, "autoawq", "auto"):
        raise UnsupportedConfig("quantization_config.backend", fields.get("backend"), "implemented for awq: autoawq")
    return IntWeights(QUANT_AWQ, (4,))


def _compressed_weights(fields: dict[str, Any]) -> IntWeights | None:
    """compressed-tensors (llm-compressor's checkpoints): integer weights in its ``pack-quantized`` format, 4 or 8
    bits, a scale per group or channel, symmetric or not, activations left unquantized (W4A16, W8A16); or 8-bit
    float weights in its ``float-quantized`` format (None), a scale per channel, per tensor or per block, their
    activations unquantized or quantized per token on the fly (FP8-dynamic, W8A8-FP8: computed, as transformers'
    decompressed model computes them, from the activations as they are). Static activation scales, output or
    KV-cache quantization, sparsity and transforms change the math: refused, and so is a checkpoint that mixes
    integer and float schemes."""
    status = fields.get("quantization_status", "compressed")
    if status != "compressed":
        raise UnsupportedConfig("quantization_config.quantization_status", status, "implemented: compressed")
    for name in ("kv_cache_scheme", "transform_config"):
        if fields.get(name):
            raise UnsupportedConfig(f"quantization_config.{name}", fields[name], "not implemented")
    sparsity = fields.get("sparsity_config") or {}
    if (sparsity.get("format") if isinstance(sparsity, dict) else sparsity) not in (None, "dense"):
        raise UnsupportedConfig("quantization_config.sparsity_config", sparsity, "sparse formats are not implemented")
    groups = fields.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedConfig("quantization_config.config_groups", groups, "must name at least one scheme")
    bits: set[int] = set()
    layouts: set[str] = set()
    for key, scheme in groups.items():
        field = f"quantization_config.config_groups.{key}"
        layout = scheme.get("format") or fields.get("format")
        if layout not in ("pack-quantized", "float-quantized"):
            raise UnsupportedConfig(f"{field}.format", layout, "implemented: pack-quantized (integer weights), "
                                    "float-quantized (8-bit float weights)")
        layouts.add(layout)
        floats = layout == "float-quantized"
        if scheme.get("output_activations"):
            raise UnsupportedConfig(f"{field}.output_activations", scheme["output_activations"],
                                    "quantized outputs are not implemented")
        inputs = scheme.get("input_activations")
        if inputs and not (floats and inputs.get("dynamic") is True and inputs.get("type") == "float"):
            raise UnsupportedConfig(f"{field}.input_activations", inputs,
                                    "implemented: unquantized, or 8-bit floats quantized on the fly beside 8-bit float "
                                    "weights (static scales change the math)")
        weights = scheme.get("weights") or {}
        allowed_fields = ((("type", ("float",)), ("num_bits", (8,)), ("strategy", ("channel", "tensor", "block")),
                           ("dynamic", (False, None))) if floats else
                          (("type", ("int",)), ("num_bits", (4, 8)), ("strategy", ("group", "channel")),
                           ("dynamic", (False, None)), ("block_structure", (None,))))
        for name, allowed in allowed_fields:
            if weights.get(name) not in allowed:
                raise UnsupportedConfig(f"{field}.weights.{name}", weights.get(name),
                                        f"implemented: {', '.join(map(str, allowed))}")
        if floats and weights.get("symmetric") is False:
            raise UnsupportedConfig(f"{field}.weights.symmetric", False, "implemented for float weights: true")
        if not floats:
            bits.add(int(weights["num_bits"]))
    if len(layouts) > 1:
        raise UnsupportedConfig("quantization_config.config_groups", sorted(layouts),
                                "integer and float schemes in one checkpoint are not implemented")
    return None if layouts == {"float-quantized"} else IntWeights(QUANT_COMPRESSED_TENSORS, tuple(sorted(bits)))


def _ernie_moe_layers(config: Any, num_layers: int) -> tuple[int, ...]:
    """ERNIE 4.5's mixture layers: every ``moe_layer_interval``-th from ``moe_layer_start_index`` to
    ``moe_layer_end_index`` (-1: the last), as its decoder layer decides."""
    bounds = {field: getattr(config, field, default) for field, default in (
        ("moe_layer_start_index", 1), ("moe_layer_end_index", -1), ("moe_layer_interval", 1))}
    for field, value in bounds.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if field == "moe_layer_interval" else -1):
            raise UnsupportedConfig(field, value, "must be an integer (the interval positive)")
    start, end, interval = bounds.values()
    end = num_layers - 1 if end == -1 else end
    return tuple(i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end)


def _ernie_router_fields(config: Any, num_experts: int, top_k: int) -> dict[str, Any]:
    """ERNIE 4.5's router divides its chosen probabilities by their sum clamped below at ``moe_norm_min``.
    The k largest of a softmax over the experts sum to at least k / experts, so a minimum below that never
    binds and the weights are renormalized as ``norm_topk_prob`` renormalizes them; one above it would."""
    norm_min = getattr(config, "moe_norm_min", 1e-12)
    if not isinstance(norm_min, (int, float)) or isinstance(norm_min, bool) or not 0 <= norm_min < top_k / num_experts:
        raise UnsupportedConfig("moe_norm_min", norm_min, f"only a minimum below {top_k}/{num_experts} is implemented")
    return {"router": ROUTER_SOFTMAX_CORRECTED, "norm_topk_prob": True}


def _deepseek_v2_router_fields(config: Any, num_experts: int, top_k: int) -> dict[str, Any]:
    """DeepSeek-V2's router as transformers runs it (``ROUTER_SOFTMAX_GROUPS``), checked: ``topk_method`` greedy
    (no groups) or group_limited_greedy; its weights never renormalized (transformers reads no
    ``norm_topk_prob``, which DeepSeek's own code would apply: refused where set)."""
    _original_router_fields(config, "softmax", None)
    method = getattr(config, "topk_method", "greedy")
    if method not in _DEEPSEEK_V2_TOPK_METHODS:
        raise UnsupportedConfig("topk_method", method, f"implemented: {', '.join(_DEEPSEEK_V2_TOPK_METHODS)}")
    if getattr(config, "norm_topk_prob", False):
        raise UnsupportedConfig("norm_topk_prob", config.norm_topk_prob, "transformers' DeepSeek-V2 router never "
                                "renormalizes its weights, DeepSeek's own code would: not implemented")
    groups: Any = 1
    topk_groups: Any = 1
    if method == "group_limited_greedy":
        groups, topk_groups = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        if not _positive_int(groups) or num_experts % groups:
            raise UnsupportedConfig("n_group", groups, f"must divide the {num_experts} experts into groups")
        _check_topk_groups(topk_groups, groups, num_experts, top_k)
    return {"router": ROUTER_SOFTMAX_GROUPS, "num_expert_groups": groups, "topk_groups": topk_groups,
            "routed_scaling_factor": _routed_scaling_factor(config), "routing_weights_float32": True,
            "norm_topk_prob": False}


def _check_topk_groups(topk_groups: Any, groups: int, num_experts: int, top_k: int) -> None:
    """A grouped router's ``topk_group``: 1 to ``n_group``, its groups holding enough experts to choose from."""
    if not _positive_int(topk_groups) or topk_groups > groups or top_k > topk_groups * (num_experts // groups):
        raise UnsupportedConfig("topk_group", topk_groups,
                                f"must be 1 to n_group ({groups}), its groups holding num_experts_per_tok experts")


def _routed_scaling_factor(config: Any) -> float:
    scale = getattr(config, "routed_scaling_factor", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise UnsupportedConfig("routed_scaling_factor", scale, "must be a positive number")
    return float(scale)


def _original_router_fields(config: Any, scoring: str, topk_method: str | None) -> None:
    """Refuse, by name, a DeepSeek config whose original code routes otherwise than transformers' class for its
    ``model_type`` does (which reads none of these): another ``scoring_func``, another ``topk_method`` (V3's
    ``noaux_tc``), or experts in every ``moe_layer_freq``-th layer only."""
    scoring_func = getattr(config, "scoring_func", None)
    if scoring_func not in (None, scoring):
        raise UnsupportedConfig("scoring_func", scoring_func, f"transformers scores {config.model_type}'s experts by "
                                f"{scoring} only")
    method = getattr(config, "topk_method", None)
    if topk_method is not None and method not in (None, topk_method):
        raise UnsupportedConfig("topk_method", method, f"transformers routes {config.model_type} as {topk_method} only")
    freq = getattr(config, "moe_layer_freq", None)
    if freq not in (None, 1):
        raise UnsupportedConfig("moe_layer_freq", freq, "transformers puts experts in every layer after "
                                "first_k_dense_replace: only 1 is implemented")


def _mla_fields(config: Any, model_type: str, heads: int, kv_heads: int) -> dict[str, Any]:
    """Multi-head Latent Attention's ``ModelArch`` fields, its dims checked (``common.model.mla`` reads them from
    the config); a V3 config's router checked against DeepSeek's own code as well."""
    if kv_heads != heads:  # transformers' MLA expands the latent to every head, then would repeat them again
        raise UnsupportedConfig("num_key_value_heads", kv_heads, f"Multi-head Latent Attention gives every head its "
                                f"k and v ({heads})")
    for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not _positive_int(getattr(config, field, None)):
            raise UnsupportedConfig(field, getattr(config, field, None), "must be a positive integer")
    q_lora_rank = getattr(config, "q_lora_rank", None)
    if q_lora_rank is not None and not _positive_int(q_lora_rank):
        raise UnsupportedConfig("q_lora_rank", q_lora_rank, "must be a positive integer or null (a whole q_proj)")
    if config.qk_rope_head_dim % 2:
        raise UnsupportedConfig("qk_rope_head_dim", config.qk_rope_head_dim, "RoPE turns pairs: must be even")
    if config.kv_lora_rank % 2:  # the cached [k_pe, c] is split in halves across the K and V slots
        raise UnsupportedConfig("kv_lora_rank", config.kv_lora_rank, "the cache holds the latent in two halves: "
                                "must be even")
    if model_type == "deepseek_v3":
        _original_router_fields(config, "sigmoid", "noaux_tc")
    interleaved = model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))
    return {"mla": True, "rotary_dim": int(config.qk_rope_head_dim), "rope_interleaved": interleaved}


def _sigmoid_router_fields(config: Any, num_experts: int, top_k: int) -> dict[str, Any]:
    groups, topk_groups = getattr(config, "n_group", 1) or 1, getattr(config, "topk_group", 1) or 1
    if not _positive_int(groups) or num_experts % groups or num_experts // groups < 2:
        raise UnsupportedConfig("n_group", groups, f"must divide the {num_experts} experts into groups of 2 or more")
    _check_topk_groups(topk_groups, groups, num_experts, top_k)
    # Weights in float32 as its router computes them, each expert's output met with its weight there.
    return {"router": ROUTER_SIGMOID_GROUPS, "num_expert_groups": groups, "topk_groups": topk_groups,
            "routed_scaling_factor": _routed_scaling_factor(config), "routing_weights_float32": True}


def _rotary_dim(config: Any, model_type: str) -> int | None:
    """Each head's rotated entries under a partial RoPE (``partial_rotary_factor``, checked in ``_rope``)."""
    if model_type not in _PARTIAL_ROPE_TYPES:
        return None
    factor = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor in (None, 1, 1.0):
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * factor)  # as transformers' RoPE initialisation rounds it
    if dim < 2 or dim % 2:
        raise UnsupportedConfig("partial_rotary_factor", factor, f"rotates {dim} of {head_dim} entries: needs an even number")
    return dim


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_or_none(config: Any, field: str) -> float | None:
    value = getattr(config, field, None)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise UnsupportedConfig(field, value, "must be a positive number or null")
    return float(value)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters in transformers' current form (``rope_type``, ``rope_theta``...)."""
    params = getattr(config, "rope_parameters", None) or {}
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return dict(params)


def _rope(config: Any, model_type: str) -> tuple[str, tuple[str, ...] | None]:
    """The RoPE kind (``"default"`` only where every layer's is) and, for a RoPE per layer type,
    each layer's type."""
    params = rope_parameters(config)
    if model_type in _HUNYUAN_TYPES and params.get("rope_type") == "dynamic" and "alpha" in params:
        # Labelled dynamic, but a fixed alpha only stretches the base: static (transformers' "ntk_alpha").
        alpha = params["alpha"]
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
            raise UnsupportedConfig("rope_parameters.alpha", alpha, "must be a positive number")
        return NTK_ALPHA, None
    if not (params and all(isinstance(v, dict) for v in params.values())):
        return _rope_type(config, params, "rope_parameters", model_type), None
    if model_type not in _ROPE_PER_LAYER_TYPE:
        raise UnsupportedConfig("rope_parameters", params, f"a RoPE per layer type is not implemented for {model_type}")
    layer_types = tuple(getattr(config, "layer_types", None) or ())
    if len(layer_types) != int(config.num_hidden_layers) or not set(layer_types) <= set(params):
        raise UnsupportedConfig("rope_parameters", params, f"needs a RoPE for each of layer_types {layer_types}")
    kinds = {_rope_type(config, params[kind], f"rope_parameters.{kind}", model_type) for kind in set(layer_types)}
    return ("default" if kinds == {"default"} else "scaled"), layer_types


def _rope_type(config: Any, params: dict[str, Any], field: str, model_type: str) -> str:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfig(f"{field}.rope_type", rope_type, f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if model_type in _PARTIAL_ROPE_TYPES and partial is not None and (
            not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1):
        raise UnsupportedConfig("partial_rotary_factor", partial, "must be in (0, 1]")
    if model_type not in _PARTIAL_ROPE_TYPES and partial not in (None, 1, 1.0):
        raise UnsupportedConfig("partial_rotary_factor", partial, f"a partial RoPE is not implemented for {model_type}")
    return str(rope_type)


def _no_rope_layers(config: Any, model_type: str) -> tuple[int, ...]:
    """The layers without RoPE: SmolLM3's (and Llama 4's) ``no_rope_layers`` holds 1 (RoPE) or 0 (none) per layer; Cohere 2
    rotates its sliding layers only, as AFMoE does, and EXAONE 4 too where it has a window."""
    if model_type in ("cohere2", "afmoe") or (model_type == "exaone4" and getattr(config, "sliding_window", None) is not None):
        layer_types = getattr(config, "layer_types", None) or ()
        return tuple(i for i, kind in enumerate(layer_types) if kind != "sliding_attention")
    if model_type not in ("smollm3", "llama4_text"):  # Llama 4's config fills them in where a checkpoint has none
        return ()
    flags = getattr(config, "no_rope_layers", None)
    if not isinstance(flags, list) or len(flags) != int(config.num_hidden_layers) or any(
        f not in (0, 1) or isinstance(f, float) for f in flags
    ):
        raise UnsupportedConfig("no_rope_layers", flags, f"needs a 0 or 1 per layer ({config.num_hidden_layers})")
    return tuple(i for i, flag in enumerate(flags) if not flag)


def _sliding_windows(config: Any, model_type: str) -> tuple[int | None, ...]:
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if model_type in ("llama", "internlm3", "seed_oss", "olmo2", "flex_olmo", "glm4_moe", "minimax_m2", "helium",
                      "cohere", "gemma", "apertus", "phi", "stablelm", "gpt_neox", "olmo", "persimmon", "falcon",
                      "llama4_text", *_GLM_TYPES, *_ERNIE_TYPES, *_MLA_TYPES):
        return (None,) * num_layers  # their transformers code has no sliding window: the field is unused
    if model_type == "smollm3" and not getattr(config, "use_sliding_window", False):
        return (None,) * num_layers  # its attention reads layer_types only with use_sliding_window
    if model_type == "exaone4" and window is None:
        return (None,) * num_layers  # its sliding layers, without a window, attend to everything (and rotate)
    if model_type == "qwen2_moe" and not getattr(config, "use_sliding_window", False):
        return (None,) * num_layers  # its config sets the window to 0 then
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UnsupportedConfig("sliding_window", window, "must be a positive integer")
    if model_type == "olmoe":  # its attention would read one, but its config class has no such field
        if window is not None:
            raise UnsupportedConfig("sliding_window", window, "not implemented for olmoe")
        return (None,) * num_layers
    if model_type == "qwen3_moe":  # every layer with use_sliding_window (its config has no layer_types)
        return ((window if getattr(config, "use_sliding_window", False) else None),) * num_layers
    if model_type in ("mistral", "ministral3", "phi3", "mixtral", "starcoder2"):  # every layer, whatever layer_types says
        return (window,) * num_layers
    # Qwen2/Qwen3 derive layer_types from use_sliding_window and max_window_layers; Gemma 2 alternates.
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise UnsupportedConfig("layer_types", layer_types, f"needs one entry per layer ({num_layers})")
    windows: list[int | None] = []
    for kind in layer_types:
        if kind not in SUPPORTED_LAYER_TYPES:
            raise UnsupportedConfig("layer_types", kind, f"supported: {', '.join(SUPPORTED_LAYER_TYPES)}")
        if kind == "sliding_attention" and window is None:
            raise UnsupportedConfig("sliding_window", window, "layer_types marks sliding layers")
        windows.append(window if kind == "sliding_attention" else None)
    return tuple(windows)
