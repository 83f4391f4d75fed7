"""Tiny random-weight checkpoints of each supported family, built locally with transformers' own
config and model classes, and transformers' greedy output for them (the reference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

TINY_DIMS: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,  # sharp attention, so that what a query may see changes the output
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
WINDOW = 12  # not a multiple of the 8-token blocks the tests use
# Falcon's config: heads hidden_size / num_attention_heads wide, the MLP ffn_hidden_size wide, kv heads its own.
_FALCON_DIMS: dict[str, Any] = {
    **{k: v for k, v in TINY_DIMS.items() if k not in ("num_key_value_heads", "head_dim", "intermediate_size")},
    "ffn_hidden_size": 128,
}
# An image-text checkpoint's vision tower, as small as its config allows.
_TINY_VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "image_size": 28, "patch_size": 14}


# DeepSeek's Multi-head Latent Attention: every head its k and v (from one latent of kv_lora_rank per token),
# queries and keys 16 + 8 wide (the last 8 rotated), values 16; experts 32 wide.
_MLA_DIMS: dict[str, Any] = {
    **{k: v for k, v in TINY_DIMS.items() if k not in ("num_key_value_heads", "head_dim")},
    "num_key_value_heads": TINY_DIMS["num_attention_heads"], "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32,
}
# DeepSeek's YaRN (V2's and V3's released configs scale so), its mscale_all_dim scaling the attention too.
_DEEPSEEK_YARN: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 16,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}


# Llama 4's text model (see ``family_configs``): layer 1 without RoPE, the others chunked; layers 0 and 2 mixtures.
_LLAMA4_TEXT: dict[str, Any] = {
    **TINY_DIMS, "intermediate_size": 48, "intermediate_size_mlp": 96, "num_local_experts": 4, "num_experts_per_tok": 2,
    "moe_layers": [0, 2], "no_rope_layers": [1, 0, 1], "attention_chunk_size": WINDOW, "use_qk_norm": True,
    "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


# Families without grouped-query attention (q/k/v fused head by head): every head its own k and v.
_MHA_DIMS = {k: v for k, v in TINY_DIMS.items() if k not in ("num_key_value_heads", "head_dim")}


def _partial_rope(factor: float) -> dict[str, Any]:
    """A default RoPE over each head's first ``factor`` share."""
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}


def family_configs() -> dict[str, Any]:
    """One config per family and config feature; each windowed one has a window of ``WINDOW``."""
    from transformers import (
        AfmoeConfig,
        ApertusConfig,
        ArceeConfig,
        Cohere2Config,
        CohereConfig,
        DeepseekV2Config,
        DeepseekV3Config,
        Dots1Config,
        Ernie4_5_MoeConfig,
        Ernie4_5Config,
        Exaone4Config,
        FalconConfig,
        FlexOlmoConfig,
        Gemma2Config,
        Gemma3Config,
        Gemma3TextConfig,
        GemmaConfig,
        Glm4Config,
        Glm4MoeConfig,
        GlmConfig,
        GPTNeoXConfig,
        GptOssConfig,
        GraniteConfig,
        GraniteMoeConfig,
        GraniteMoeSharedConfig,
        HeliumConfig,
        HunYuanDenseV1Config,
        HunYuanMoEV1Config,
        InternLM3Config,
        Llama4Config,
        Llama4TextConfig,
        LlamaConfig,
        MiniMaxM2Config,
        Ministral3Config,
        MinistralConfig,
        Mistral3Config,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        Olmo3Config,
        OlmoConfig,
        OlmoeConfig,
        PersimmonConfig,
        Phi3Config,
        PhiConfig,
        PixtralVisionConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLTextConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3VLConfig,
        Qwen3VLMoeConfig,
        Qwen3VLMoeTextConfig,
        Qwen3VLTextConfig,
        SeedOssConfig,
        SiglipVisionConfig,
        SmolLM3Config,
        StableLmConfig,
        Starcoder2Config,
        VaultGemmaConfig,
    )

    return {
        "mistral-window": MistralConfig(**TINY_DIMS, sliding_window=WINDOW, tie_word_embeddings=False),
        # max_window_layers=1: layer 0 full, layers 1 and 2 sliding (transformers' rule).
        "qwen2-window-layers": Qwen2Config(
            **TINY_DIMS, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
            tie_word_embeddings=True,
        ),
        "qwen3-qk-norm": Qwen3Config(**TINY_DIMS, tie_word_embeddings=True),
        "qwen3-layer-types-bias": Qwen3Config(
            **TINY_DIMS, use_sliding_window=True, sliding_window=WINDOW, attention_bias=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
        ),
        # Gemma 1: Llama's layer with Gemma's (1 + weight) norms, scaled embeddings and GELU-tanh; the
        # checkpoints' legacy hidden_act "gelu", which transformers reads as the tanh approximation.
        "gemma-norms-gelu": GemmaConfig(**TINY_DIMS, hidden_act="gelu", attention_bias=True),
        # Layers alternate sliding / full; small caps so that soft-capping changes the output.
        "gemma2-window-softcap": Gemma2Config(
            **TINY_DIMS, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, tie_word_embeddings=False,  # tied, the residual just repeats tokens
        ),
        # VaultGemma: Gemma 2's layer without the norms after each block.
        "vaultgemma-window-softcap": VaultGemmaConfig(
            **TINY_DIMS, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False,
        ),
        # Gemma 2's layer with q/k norms, a RoPE per layer type (the global one scaled) and no soft-caps.
        "gemma3-window-rope-per-type": Gemma3TextConfig(
            **TINY_DIMS, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
            tie_word_embeddings=False,
        ),
        # q/k/v and gate/up stacked in the checkpoint itself; a window on every layer.
        "phi3-window": Phi3Config(**TINY_DIMS, sliding_window=WINDOW, tie_word_embeddings=False),
        # Llama's layer with Granite's four scalings, each far enough from 1 to change the output.
        "granite-scalings": GraniteConfig(
            **TINY_DIMS, embedding_multiplier=3.0, attention_multiplier=0.1, residual_multiplier=0.5,
            logits_scaling=2.0, attention_bias=True, tie_word_embeddings=True,
        ),
        # Layer 1 without RoPE; with use_sliding_window, transformers gives the NoPE layers the window.
        "smollm3-nope": SmolLM3Config(**TINY_DIMS, no_rope_layers=[1, 0, 1], tie_word_embeddings=True),
        "smollm3-nope-window": SmolLM3Config(
            **TINY_DIMS, no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=WINDOW,
            tie_word_embeddings=False,
        ),
        # EXAONE 4: norms after each block (OLMo 2's layout, Llama's norm), q/k norms per head, sliding layers
        # that alone rotate.
        "exaone4-post-norms-window": Exaone4Config(
            **TINY_DIMS, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        # Ministral 3: Mistral's layer, YaRN, and each token's rotated queries scaled by its position's period
        # (here 16 tokens, so that the test prompts cross two).
        "ministral3-query-scale-yarn": Ministral3Config(**TINY_DIMS, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}),
        # Mistral's layer with windows where layer_types says.
        "ministral-window-layers": MinistralConfig(
            **TINY_DIMS, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False,
        ),
        # q/k/v biases without the output projection's (attention_out_bias), MLP biases.
        "seed-oss-biases": SeedOssConfig(**TINY_DIMS, attention_bias=True, attention_out_bias=False, mlp_bias=True),
        "internlm3-bias": InternLM3Config(**TINY_DIMS, attention_bias=True, mlp_bias=True),
        # AFMoE (Arcee's Trinity): Gemma's four norms in OLMo's form, q/k norms per head, the attention's output
        # gated, sliding layers that alone rotate, muP-scaled embeddings; layer 0 dense, then 2 of 6 experts by
        # sigmoid score plus a float32 correction bias, scaled, beside a shared one.
        "afmoe-moe-gated-attention-window": AfmoeConfig(
            **TINY_DIMS, moe_intermediate_size=32, num_dense_layers=1, num_experts=6, num_experts_per_tok=2,
            num_shared_experts=1, route_scale=2.5, sliding_window=WINDOW, mup_enabled=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
        ),
        # Apertus: an MLP without a gate and its xIELU (two learned scalars per layer), q/k norms per head,
        # Llama 3's RoPE, its norms under names of their own.
        "apertus-xielu-qk-norm": ApertusConfig(**TINY_DIMS, attention_bias=True, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}),
        # StarCoder2: torch's LayerNorms (a bias each), biases on every projection by use_bias, an MLP without
        # a gate (c_fc, GELU-tanh, c_proj), a window on every layer.
        "starcoder2-layernorm-bias-window": Starcoder2Config(
            **TINY_DIMS, use_bias=True, sliding_window=WINDOW, norm_epsilon=1e-5,
            tie_word_embeddings=True,
        ),
        # Phi-2: attention and MLP side by side on one LayerNorm (their outputs summed, then added to the stream),
        # biases everywhere, the output head's too, a partial RoPE, an MLP without a gate (GELU by its formula).
        "phi-parallel-partial-rope-layernorm": PhiConfig(
            **TINY_DIMS, layer_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters=_partial_rope(0.5),
        ),
        # StableLM: Llama's layer with torch's LayerNorms, a partial RoPE and q/k/v biases; StableLM 2 12B's
        # variant: attention and MLP side by side, LayerNorms of q and k with a weight per head (stacked as
        # they load from one module per head).
        "stablelm-layernorm-partial-rope": StableLmConfig(
            **TINY_DIMS, use_qkv_bias=True, tie_word_embeddings=False,
            rope_parameters=_partial_rope(0.25),
        ),
        "stablelm-parallel-qk-layernorm": StableLmConfig(
            **TINY_DIMS, use_parallel_residual=True, qk_layernorm=True, tie_word_embeddings=False,
            rope_parameters=_partial_rope(0.5),
        ),
        # GPT-NeoX (Pythia): attention and MLP side by side, each on a LayerNorm of its own of the stream (or in
        # turn), biases, a partial RoPE, an ungated MLP with the exact GELU, q/k/v fused head by head; no GQA.
        "gpt-neox-parallel-two-norms": GPTNeoXConfig(
            **_MHA_DIMS,
            use_parallel_residual=True, tie_word_embeddings=False,
            rope_parameters=_partial_rope(0.25),
        ),
        "gpt-neox-sequential": GPTNeoXConfig(
            **_MHA_DIMS,
            use_parallel_residual=False, tie_word_embeddings=False,
            rope_parameters=_partial_rope(0.5),
        ),
        # OLMo 1: Llama's layer with LayerNorms without weight or bias, q/k/v/o biases, q, k and v clamped (to a
        # bound the tiny model's q, k and v often pass).
        "olmo-layernorm-no-weights-clip-qkv": OlmoConfig(
            **TINY_DIMS, attention_bias=True, clip_qkv=1.5, tie_word_embeddings=False,
        ),
        # Persimmon: Llama's layer with torch's LayerNorms, biases everywhere, q/k/v fused head by head, LayerNorms
        # of q and k (a weight and a bias shared by the heads), a partial RoPE, an ungated MLP squaring a ReLU.
        "persimmon-qk-layernorm-partial-rope-relu2": PersimmonConfig(
            **_MHA_DIMS,
            qk_layernorm=True, tie_word_embeddings=False,
            rope_parameters=_partial_rope(0.5),
        ),
        "persimmon-no-qk-layernorm": PersimmonConfig(
            **_MHA_DIMS,
            qk_layernorm=False, tie_word_embeddings=True,
            rope_parameters=_partial_rope(0.25),
        ),
        # Falcon's variants: the new layer (40B/180B: q/k/v grouped by kv head, attention and MLP side by side on
        # two norms; or on one), the old side-by-side layer with one k and v for all heads (7B), and the old
        # sequential layer, multi-head, with biases; torch's LayerNorms, an ungated MLP with the exact GELU.
        "falcon-new-arch-grouped-qkv-two-norms": FalconConfig(
            **_FALCON_DIMS, new_decoder_architecture=True, num_kv_heads=2, bias=True, tie_word_embeddings=False,
        ),
        "falcon-new-arch-one-norm": FalconConfig(
            **_FALCON_DIMS, new_decoder_architecture=True, num_kv_heads=4, num_ln_in_parallel_attn=1,
            tie_word_embeddings=True,
        ),
        "falcon-multi-query-parallel": FalconConfig(
            **_FALCON_DIMS, multi_query=True, parallel_attn=True, tie_word_embeddings=True,
        ),
        "falcon-sequential-bias": FalconConfig(
            **_FALCON_DIMS, multi_query=False, parallel_attn=False, bias=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        # An MLP without a gate: down(relu(up(x)) ** 2).
        "arcee-relu2": ArceeConfig(**TINY_DIMS, mlp_bias=True, tie_word_embeddings=False),
        # q/k norms after RoPE; the RoPE its checkpoints label "dynamic" with a fixed NTK alpha (static).
        "hunyuan-qk-norm-ntk-alpha": HunYuanDenseV1Config(
            **TINY_DIMS, attention_bias=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0},
        ),
        # Norms after each block, none before; q and k normed across all their heads.
        "olmo2-post-norms": Olmo2Config(**TINY_DIMS, attention_bias=True, tie_word_embeddings=False),
        # OLMo 2's layer with sliding layers and a RoPE per layer type (the global one scaled).
        "olmo3-window-rope-per-type": Olmo3Config(
            **TINY_DIMS, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
            tie_word_embeddings=False,
        ),
        # Mixtures of experts. Mixtral: Mistral's layer (a window on every layer) with 2 of 4 experts.
        "mixtral-moe-window": MixtralConfig(
            **TINY_DIMS, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, tie_word_embeddings=False,
        ),
        # Qwen3's layer with 2 of 8 experts, renormalized; layer 1 a dense MLP (mlp_only_layers).
        "qwen3-moe-dense-layer": Qwen3MoeConfig(
            **TINY_DIMS, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            mlp_only_layers=[1], tie_word_embeddings=False,
        ),
        # Qwen2's layer with 3 of 6 experts, not renormalized, beside a shared expert behind a sigmoid gate.
        "qwen2-moe-shared-expert": Qwen2MoeConfig(
            **TINY_DIMS, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False,
        ),
        # OLMoE: Llama's norms, q and k normed across all their heads, 2 of 4 experts, biases.
        "olmoe-qk-norm": OlmoeConfig(
            **TINY_DIMS, num_experts=4, num_experts_per_tok=2, attention_bias=True, tie_word_embeddings=False,
        ),
        # Granite's four scalings with 2 of 4 experts (the softmax over the top 2 logits only)...
        "granitemoe-scalings": GraniteMoeConfig(
            **TINY_DIMS, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0,
            attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=2.0, attention_bias=True,
            tie_word_embeddings=False,
        ),
        # ... and beside them a shared expert, added as it is.
        "granitemoeshared-shared-expert": GraniteMoeSharedConfig(
            **TINY_DIMS, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
            residual_multiplier=0.5, tie_word_embeddings=True,
        ),
        # GLM-4.5: q/k biases and norms, RoPE over half of each head, layer 0 dense; 2 of 8 experts picked
        # by sigmoid score plus a correction bias within the best 1 of 2 groups, scaled, beside a shared one.
        "glm4-moe-partial-rope-groups": Glm4MoeConfig(
            **TINY_DIMS, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            use_qk_norm=True, attention_bias=True, tie_word_embeddings=False,
            rope_parameters=_partial_rope(0.5),
        ),
        # MiniMax-M2: q and k normed across all heads, RoPE over half of each head, 2 of 6 experts picked
        # by sigmoid score plus a correction bias.
        "minimax-m2-moe-partial-rope": MiniMaxM2Config(
            **TINY_DIMS, num_local_experts=6, num_experts_per_tok=2, use_qk_norm=True, tie_word_embeddings=False,
            rope_parameters=_partial_rope(0.5),
        ),
        # gpt-oss: sliding and full layers, a sink per head, 2 of 4 experts with biases and a clamped SwiGLU
        # (a limit the random weights cross), its YaRN RoPE.
        "gpt-oss-moe-sinks-window": GptOssConfig(
            **TINY_DIMS, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=1.5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0},
        ),
        # dots.llm1: Qwen3's attention with windows where layer_types says, GLM-4.5's mixture (2 groups of 3).
        "dots1-moe-window": Dots1Config(
            **TINY_DIMS, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True,
            attention_bias=True, sliding_window=WINDOW, tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        # FlexOlmo: OLMo 2's layer (norms after each block, q/k across all heads) with 2 of 4 experts.
        "flex-olmo-moe-post-norms": FlexOlmoConfig(
            **TINY_DIMS, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, attention_bias=True,
            tie_word_embeddings=False,
        ),
        # Hunyuan MoE: Hunyuan's layer (q/k norms after RoPE, its NTK-alpha RoPE), 2 of 4 experts and a shared MLP.
        # Llama 4: chunked attention in the layers that rotate (chunks of WINDOW), the others without RoPE under
        # the attention temperature (its floor low enough to bite here), weightless q/k norms after RoPE; its
        # mixture's experts fed inputs scaled by their sigmoid scores, beside a shared expert, one dense layer.
        "llama4-moe-chunked-nope-qk-norm": Llama4TextConfig(**_LLAMA4_TEXT),
        "hunyuan-moe-shared-mlp": HunYuanMoEV1Config(
            **TINY_DIMS, num_experts=4, moe_topk=2, attention_bias=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0},
        ),
        # RoPE over interleaved pairs. GLM: over each head's first half, q/k/v biases, gate and up stacked in
        # the checkpoint; GLM-4 adds norms after each block (Gemma's four, under its own names).
        "glm-interleaved-partial-rope": GlmConfig(**TINY_DIMS, attention_bias=True, tie_word_embeddings=False),
        "glm4-interleaved-rope-sandwich-norms": Glm4Config(**TINY_DIMS, attention_bias=True, tie_word_embeddings=False),
        # Helium: Llama's layer, its RMSNorm meeting the weight in float32.
        "helium-interleaved-rope": HeliumConfig(**TINY_DIMS, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
        # ERNIE 4.5: biases everywhere (use_bias); rotated in float32. Its mixture: layers 1 and 2, 2 of 6 experts
        # chosen by probability plus a correction bias, beside a shared one.
        "ernie4_5-interleaved-rope-biases": Ernie4_5Config(**TINY_DIMS, use_bias=True, tie_word_embeddings=True),
        "ernie4_5-moe-interleaved-rope-shared": Ernie4_5_MoeConfig(
            **TINY_DIMS, moe_num_experts=6, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
            moe_layer_start_index=1, use_bias=True, tie_word_embeddings=False,
        ),
        # Cohere: LayerNorms, attention and MLP side by side on one norm, logits scaled, RoPE over interleaved
        # pairs in float32; Cohere 2 the same with sliding layers, the only ones it rotates.
        # Cohere with Command R+'s LayerNorms of q and k, a weight per head.
        "cohere-interleaved-rope-parallel-qk-norm": CohereConfig(
            **TINY_DIMS, attention_bias=True, logit_scale=0.5, use_qk_norm=True),
        "cohere2-interleaved-rope-window": Cohere2Config(
            **TINY_DIMS, attention_bias=True, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        # Image-text checkpoints, served text-only: the language model under its own prefix beside a (tiny)
        # vision tower and projector. Gemma 3's: gemma3-window-rope-per-type's layer, the head tied; Mistral
        # Small 3.1's: Mistral's layer, the head its own (the wrapper's tie_word_embeddings, as transformers).
        "gemma3-image-text-text-only": Gemma3Config(
            text_config=Gemma3TextConfig(
                **TINY_DIMS, sliding_window=WINDOW, query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
            ).to_dict(),
            vision_config=SiglipVisionConfig(**_TINY_VISION).to_dict(), mm_tokens_per_image=4,
        ),
        "mistral3-image-text-text-only": Mistral3Config(
            text_config=MistralConfig(**TINY_DIMS, sliding_window=None, tie_word_embeddings=True).to_dict(),
            vision_config=PixtralVisionConfig(**_TINY_VISION, head_dim=16).to_dict(), spatial_merge_size=1,
            image_token_index=TINY_DIMS["vocab_size"] - 1, tie_word_embeddings=False,
        ),
        # Qwen2.5-VL's and Qwen3-VL's: Qwen2's and Qwen3's layers under M-RoPE (three sections of each head's
        # frequencies, Qwen3-VL's interleaved), beside a vision tower with its own merger.
        "qwen2-5-vl-image-text-text-only": Qwen2_5_VLConfig(
            text_config=Qwen2_5_VLTextConfig(**TINY_DIMS, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}).to_dict(),
            vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                           "out_hidden_size": TINY_DIMS["hidden_size"], "fullatt_block_indexes": [0]},
            tie_word_embeddings=False,
        ),
        "qwen3-vl-image-text-text-only": Qwen3VLConfig(
            text_config=Qwen3VLTextConfig(**TINY_DIMS, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                "mrope_interleaved": True}).to_dict(),
            vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                           "out_hidden_size": TINY_DIMS["hidden_size"], "deepstack_visual_indexes": [0]},
            tie_word_embeddings=True,
        ),
        # Qwen3-VL-MoE's: Qwen3-MoE's layer (2 of 6 experts, always renormalized; layer 1 dense), its experts
        # stored input-major.
        "llama4-image-text-text-only": Llama4Config(
            text_config=Llama4TextConfig(**_LLAMA4_TEXT).to_dict(),
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                           "image_size": 28, "patch_size": 14, "vision_output_dim": 32, "projector_input_dim": 32,
                           "projector_output_dim": TINY_DIMS["hidden_size"]},
            tie_word_embeddings=False,
        ),
        "qwen3-vl-moe-image-text-text-only": Qwen3VLMoeConfig(
            text_config=Qwen3VLMoeTextConfig(**TINY_DIMS, num_experts=6, num_experts_per_tok=2,
                                             moe_intermediate_size=16, mlp_only_layers=[1], rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                "mrope_interleaved": True}).to_dict(),
            vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                           "out_hidden_size": TINY_DIMS["hidden_size"], "deepstack_visual_indexes": [0]},
            tie_word_embeddings=False,
        ),
        # DeepSeek's Multi-head Latent Attention (MLA), layer 0 dense, the rest mixtures beside a shared expert.
        # DeepSeek-V2-Lite's: q by one whole projection, its RoPE over interleaved pairs (as complex numbers, in
        # float32), 2 of 6 experts by softmax (greedy), scaled.
        "deepseek-v2-lite-mla-moe-greedy": DeepseekV2Config(
            **_MLA_DIMS, q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.5, tie_word_embeddings=False,
        ),
        # DeepSeek-V2's: q through a low-rank projection and its norm, biases (attention_bias, mlp_bias), YaRN with
        # mscale_all_dim; 2 of 8 experts within the best 1 of 2 groups (group_limited_greedy).
        "deepseek-v2-mla-moe-group-limited-yarn": DeepseekV2Config(
            **_MLA_DIMS, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
            first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1,
            routed_scaling_factor=2.0, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
            rope_parameters=_DEEPSEEK_YARN,
        ),
        # DeepSeek-V3's (Kimi K2's, Moonlight's): q low-rank, RoPE over interleaved pairs (rope_interleave), YaRN
        # with mscale_all_dim; 2 of 8 experts by sigmoid score plus a correction bias within the best 1 of 2
        # groups, renormalized and scaled. A large rms_norm_eps, which the latent norms (their own 1e-6) ignore.
        "deepseek-v3-mla-moe-yarn": DeepseekV3Config(
            **_MLA_DIMS, q_lora_rank=24, rms_norm_eps=0.05, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            tie_word_embeddings=False, rope_parameters=_DEEPSEEK_YARN,
        ),
        # ... without rope_interleave (halves), q by one whole projection, attention biases, the default RoPE.
        "deepseek-v3-mla-moe-halves": DeepseekV3Config(
            **_MLA_DIMS, q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
            rope_interleave=False, attention_bias=True, tie_word_embeddings=True,
        ),
        "llama-bias": LlamaConfig(**TINY_DIMS, attention_bias=True, mlp_bias=True),
        "llama-rope-linear": LlamaConfig(**TINY_DIMS, rope_parameters={
            "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
        "llama-rope-llama3": LlamaConfig(**TINY_DIMS, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}),
        "llama-rope-yarn": LlamaConfig(**TINY_DIMS, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}),
    }


def hf_model_class(model_type: str) -> Any:
    """transformers' class for a checkpoint: a causal LM's, or an image-text model's (Mistral 3; Llama 4, whose
    wrapper the causal-LM table maps to its language model alone, without the vision tower)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type != "llama4"
    return AutoModelForCausalLM if causal else AutoModelForImageTextToText


def hf_model(folder: Path, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Any:
    """transformers' model of a checkpoint folder, in eval mode."""
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    return hf_model_class(model_type).from_pretrained(str(folder), dtype=dtype, **kwargs).eval()


def build_checkpoint(config: Any, folder: Path, seed: int = 0) -> Path:
    """A checkpoint folder (config.json + model.safetensors) with random float32 weights."""
    torch.manual_seed(seed)
    model = hf_model_class(config.model_type).from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norm weights too, so a norm applied wrongly shows
        for name, param in model.named_parameters():
            # AFMoE's expert_bias too; Falcon's norms are ln_attn, ln_mlp and ln_f.
            # Gemma 3's image projection is initialized to zeros.
            if "norm" in name or ".ln_" in name or name.endswith(
                    ("bias", "sinks", "alpha_p", "alpha_n", "mm_input_projection_weight")):
                param.add_(0.3 * torch.randn_like(param))
        for name, buffer in model.named_buffers():  # GLM-4.5's router's correction bias, which picks experts
            if name.endswith("e_score_correction_bias"):
                buffer.add_(0.3 * torch.randn_like(buffer))
    model.save_pretrained(str(folder))
    if config.model_type == "qwen3_vl_moe":  # as its released checkpoints hold the stacked experts
        _experts_input_major(folder)
    return folder


def _experts_input_major(folder: Path) -> None:
    """The checkpoint's stacked experts rewritten input-major (``[E, H, 2I]``, ``[E, I, H]``)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[name] = state[name].transpose(1, 2).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def experts_one_by_one(folder: Path, target: Path) -> Path:
    """The checkpoint at ``folder`` with its stacked experts (``experts.gate_up_proj`` ``[E, 2I, H]``,
    ``experts.down_proj``) written one weight per expert and projection (``experts.<e>.gate_proj.weight``, ``up_proj``,
    ``down_proj``), as released mixtures hold them, and as GPTQ, AWQ and FP8 quantizers write them."""
    from safetensors.torch import load_file, save_file

    from ops.bench.quantized_weights import unstack_experts

    target.mkdir(parents=True, exist_ok=True)
    state = load_file(str(folder / "model.safetensors"))
    unstack_experts(state)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(folder / "config.json", target / "config.json")
    return target


# MXFP4's four-bit values by code, for ``mxfp4_checkpoint``'s rounding.
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_checkpoint(folder: Path, target: Path) -> Path:
    """gpt-oss's checkpoint at ``folder`` with its experts quantized to MXFP4 as its released checkpoints
    hold them (``*_blocks``: two e2m1 codes a byte, the low four bits first; ``*_scales``: a power of two
    per 32 inputs, e8m0), and the ``quantization_config`` that says so."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, weight in load_file(str(folder / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = weight
            continue
        rows = weight.transpose(1, 2).float()  # [E, outputs, inputs]: the blocks run along the inputs
        groups = rows.reshape(*rows.shape[:2], -1, 32)
        exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
        codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - _E2M1).abs().argmin(-1).to(torch.uint8)
        out[name + "_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        out[name + "_scales"] = (exponent + 127).to(torch.uint8)
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (target / "config.json").write_text(json.dumps(config))
    return target


def fp8_checkpoint(folder: Path, target: Path, block: int = 16) -> Path:
    """The checkpoint at ``folder`` with every projection's weight (experts' too) in 8 bits (e4m3) with a
    scale per ``block`` x ``block`` (``weight_scale_inv``, the block's largest magnitude over 448), as Qwen's
    and DeepSeek's FP8 checkpoints hold them, and the ``quantization_config`` that says so."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, weight in load_file(str(folder / "model.safetensors")).items():
        if not (name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")) and weight.dim() >= 2):
            out[name] = weight
            continue
        *lead, rows, cols = weight.shape
        blocks = weight.float().reshape(*lead, rows // block, block, cols // block, block)
        scale = blocks.abs().amax(dim=(-3, -1)) / 448.0
        out[name] = (blocks / scale[..., :, None, :, None]).reshape(weight.shape).to(torch.float8_e4m3fn)
        out[name.removesuffix(".weight") + (".weight_scale_inv" if name.endswith(".weight") else "_scale_inv")] = scale
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (target / "config.json").write_text(json.dumps(config))
    return target


def int_quantize(weight: torch.Tensor, bits: int, group: int, symmetric: bool, act_order: bool = False,
                 scale_dtype: torch.dtype = torch.float16, min_zero: int = 0) -> dict[str, torch.Tensor]:
    """A weight ``[out, in]`` quantized to unsigned integers of ``bits`` with a scale (in ``scale_dtype``) and
    a zero point per row and group of ``group`` inputs (``group`` = in: one per row), as GPTQ and AWQ
    quantize: ``q``, ``zeros``, ``scales`` ``[out, groups]``, ``g_idx`` ``[in]`` (the inputs' groups:
    contiguous, or with ``act_order`` spread over the row as GPTQ's ``desc_act`` leaves them), and
    ``dequantized``, ``(q - zeros) * scales`` rounded once in ``scale_dtype``. Zero points are at least
    ``min_zero``."""
    out, inputs = weight.shape
    g_idx = torch.arange(inputs) // group
    if act_order:  # by the input alone, as GPTQ's order comes from its input's statistics (q, k and v share it)
        g_idx = g_idx[torch.randperm(inputs, generator=torch.Generator().manual_seed(inputs))]
    groups = inputs // group
    members = torch.stack([weight[:, g_idx == g] for g in range(groups)], dim=1)  # [out, groups, group]
    top = (1 << bits) - 1
    if symmetric:
        scales = (members.abs().amax(-1) / ((1 << (bits - 1)) - 1)).to(scale_dtype)
        zeros = torch.full((out, groups), 1 << (bits - 1), dtype=torch.int32)
    else:
        low, high = members.amin(-1).clamp(max=0), members.amax(-1).clamp(min=0)
        scales = ((high - low) / top).to(scale_dtype)
        zeros = torch.round(-low / scales.float()).clamp(min_zero, top).to(torch.int32)
    q = torch.round(weight / scales.float()[:, g_idx]) + zeros[:, g_idx]
    q = q.clamp(0, top).to(torch.int32)
    dequantized = (q - zeros[:, g_idx]).to(scale_dtype) * scales[:, g_idx]
    return {"q": q, "zeros": zeros, "scales": scales, "g_idx": g_idx.to(torch.int32), "dequantized": dequantized}


def pack_words(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned values ``[..., n]`` packed ``32 / bits`` to an int32 word along the last dimension, the first
    value in the lowest bits (with ``order``, the word's value ``k`` in its field ``order[k]``)."""
    per_word = 32 // bits
    fields = torch.tensor(order if order is not None else range(per_word), dtype=torch.int64) * bits
    words = (values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word) << fields).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _quantized_layers(state: dict[str, torch.Tensor]) -> list[str]:
    """The checkpoint's linear layers' weights within its decoder layers (not embeddings, norms, a mixture's
    router or the head: as GPTQ, AWQ and llm-compressor leave them)."""
    return [n for n in state if ".layers." in n and n.endswith(".weight") and state[n].dim() == 2
            and not n.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight"))]


def _save_quantized(folder: Path, target: Path, out: dict[str, torch.Tensor], quantization: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (target / "config.json").write_text(json.dumps(config))
    return target


def gptq_checkpoint(folder: Path, target: Path, reference: Path, bits: int = 4, group: int = 16,
                    desc_act: bool = True, v2: bool = False) -> Path:
    """The checkpoint at ``folder`` quantized as GPTQ stores it (AutoGPTQ's and GPTQModel's layout: ``qweight``
    packed along the inputs, ``qzeros`` along the outputs, minus one unless ``v2``, ``scales``, ``g_idx``),
    asymmetric, and at ``reference`` the same model with each weight its dequantized value. The original
    format cannot store a zero point of 0 (it would be -1): there they are 1 or more."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    out, dense = dict(state), dict(state)
    for name in _quantized_layers(state):
        prefix = name.removesuffix(".weight")
        quantized = int_quantize(state[name], bits, group, symmetric=False, act_order=desc_act, min_zero=0 if v2 else 1)
        del out[name]
        out[prefix + ".qweight"] = pack_words(quantized["q"], bits).T.contiguous()  # along the inputs
        out[prefix + ".qzeros"] = pack_words(quantized["zeros"].T - (0 if v2 else 1), bits)
        out[prefix + ".scales"] = quantized["scales"].T.contiguous()
        out[prefix + ".g_idx"] = quantized["g_idx"]
        dense[name] = quantized["dequantized"].float()
    reference.mkdir(parents=True, exist_ok=True)
    save_file(dense, str(reference / "model.safetensors"), metadata={"format": "pt"})
    (reference / "config.json").write_text((folder / "config.json").read_text())
    return _save_quantized(folder, target, out, {
        "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": False,
        "checkpoint_format": "gptq_v2" if v2 else "gptq"})


# AutoAWQ's GEMM layout: column 8j + c of a word's eight in its nibble _AWQ_NIBBLE[c].
_AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def awq_checkpoint(folder: Path, target: Path, group: int = 16) -> Path:
    """The checkpoint at ``folder`` quantized to 4 bits as AutoAWQ's GEMM layout stores it (``qweight``
    ``[in, out / 8]`` and ``qzeros`` packed along the outputs in AWQ's order, ``scales`` ``[groups, out]``)."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    out = dict(state)
    for name in _quantized_layers(state):
        prefix = name.removesuffix(".weight")
        quantized = int_quantize(state[name], 4, group, symmetric=False)
        del out[name]
        out[prefix + ".qweight"] = pack_words(quantized["q"].T.contiguous(), 4, _AWQ_NIBBLE)
        out[prefix + ".qzeros"] = pack_words(quantized["zeros"].T.contiguous(), 4, _AWQ_NIBBLE)
        out[prefix + ".scales"] = quantized["scales"].T.contiguous()
    return _save_quantized(folder, target, out, {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})


def awq_as_compressed_tensors(awq: Path, target: Path) -> Path:
    """An AWQ checkpoint converted by compressed-tensors' own AutoAWQ converter: the reference transformers
    loads (through compressed-tensors) for a format transformers alone cannot run here."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from safetensors.torch import load_file

    config = json.loads((awq / "config.json").read_text())
    converter = AutoAWQConverter.from_autoawq_config(config.pop("quantization_config"))
    out = converter.process(dict(load_file(str(awq / "model.safetensors"))))
    quantization = converter.update_config(None).model_dump(exclude_none=True)
    (awq / "plain").mkdir(exist_ok=True)
    (awq / "plain" / "config.json").write_text(json.dumps(config))
    return _save_quantized(awq / "plain", target, out, quantization)


def compressed_tensors_checkpoint(folder: Path, target: Path, bits: int = 4, group: int | None = 16,
                                  symmetric: bool = False) -> Path:
    """The checkpoint at ``folder`` in compressed-tensors' ``pack-quantized`` format (llm-compressor's W4A16 /
    W8A16), packed by compressed-tensors itself: integers of ``bits``, a scale per ``group`` inputs (None:
    per channel), zero points unless ``symmetric``."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    out = dict(state)
    offset = 1 << (bits - 1)
    for name in _quantized_layers(state):
        prefix = name.removesuffix(".weight")
        weight = state[name]
        quantized = int_quantize(weight, bits, group or weight.shape[1], symmetric, scale_dtype=torch.bfloat16)
        del out[name]
        out[prefix + ".weight_packed"] = pack_to_int32((quantized["q"] - offset).to(torch.int8), bits)
        out[prefix + ".weight_scale"] = quantized["scales"]
        out[prefix + ".weight_shape"] = torch.tensor(weight.shape)
        if not symmetric:
            out[prefix + ".weight_zero_point"] = pack_to_int32((quantized["zeros"] - offset).to(torch.int8), bits,
                                                               packed_dim=0)
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
               **({"strategy": "group", "group_size": group} if group else {"strategy": "channel"})}
    return _save_quantized(folder, target, out, {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"], "quantization_status": "compressed"})


def compressed_fp8_checkpoint(folder: Path, target: Path, strategy: str = "channel",
                              scale_dtype: torch.dtype = torch.bfloat16) -> Path:
    """The checkpoint at ``folder`` in compressed-tensors' ``float-quantized`` format (llm-compressor's FP8-dynamic
    scheme, W8A8 with activations quantized per token on the fly): each projection's weight in e4m3 with a scale in
    ``scale_dtype``, its largest magnitude over 448, per output channel (``[out, 1]``), per tensor (one number) or
    per 16 x 16 block."""
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    out = dict(state)
    for name in _quantized_layers(state):
        weight = state[name].float()
        rows, cols = weight.shape
        if strategy == "block":  # 16 x 16
            top = weight.reshape(rows // 16, 16, cols // 16, 16).abs().amax(dim=(1, 3))
        else:
            top = weight.abs().amax(dim=1, keepdim=True) if strategy == "channel" else weight.abs().amax().reshape(1)
        scale = (top / 448.0).to(scale_dtype)
        spread = scale.float().repeat_interleave(16, 0).repeat_interleave(16, 1) if strategy == "block" else scale.float()
        out[name] = (weight / spread).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name.removesuffix(".weight") + ".weight_scale"] = scale
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
           **({"block_structure": [16, 16]} if strategy == "block" else {})}
    tokens = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return _save_quantized(folder, target, out, {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp8, "input_activations": tokens}},
        "ignore": ["lm_head"], "quantization_status": "compressed"})


def build_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: ``"w5 w9"`` encodes to ``[1, 5, 9]``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_DIMS["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )
    tokenizer.save_pretrained(str(folder))


def hf_greedy(folder: Path, prompt: list[int], max_new_tokens: int, **config_overrides: Any) -> list[int]:
    """transformers ``generate`` (greedy, float32, CPU) on the checkpoint, EOS ignored."""
    model = hf_model(folder, **config_overrides)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
            eos_token_id=None,
        )
    return [int(t) for t in out[0, len(prompt):]]


def prompt_token_ids(length: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_DIMS["vocab_size"], (length,), generator=gen).tolist()


def peft_adapter(base: Path, target: Path, seed: int = 0, scale: float = 20.0, **lora_config: Any) -> Path:
    """A LoRA adapter for the checkpoint at ``base``, saved by PEFT (``adapter_config.json`` and
    ``adapter_model.safetensors``), A and B random (B is zeros at PEFT's default initialization, an
    adapter that changes nothing), B times ``scale``: large enough to change greedy tokens. (On a trained
    model, keep it small and off q and k: a large one drives the model where float32 rounding alone
    changes its tokens, PEFT's own merged weights' among them.)"""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base), LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **lora_config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    model.save_pretrained(str(target))
    return target


def peft_greedy(base: Path, adapter: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """PEFT's ``generate`` (greedy, float32, CPU) on the base checkpoint with the adapter, EOS ignored."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_model(base), str(adapter)).eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
            eos_token_id=None,
        )
    return [int(t) for t in out[0, len(prompt):]]


# A Mistral 3 image-text checkpoint whose images are served: a Pixtral tower of two layers over patches of 8
# pixels (images up to 112 pixels a side), the patch merger over 2 x 2 patches, so an image token stands for
# 16 x 16 pixels. Its tokenizer is ``build_tokenizer``'s with the processor's three tokens at the vocabulary's
# end, and a chat template that writes ``[IMG]`` for an image part (as Mistral's own templates do).
IMAGE_TOKENS = {"[IMG_END]": TINY_DIMS["vocab_size"] - 3, "[IMG_BREAK]": TINY_DIMS["vocab_size"] - 2,
                "[IMG]": TINY_DIMS["vocab_size"] - 1}


def _image_chat_template(placeholder: str) -> str:
    """A chat template over the word-level vocabulary that writes ``placeholder`` for each image part."""
    return (
        "{{ bos_token }}{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ('image', 'image_url') %}" + placeholder + "{% endif %}{% endfor %}{% endif %} "
        "{% endfor %}{% if add_generation_prompt %}w7{% endif %}"
    )


IMAGE_CHAT_TEMPLATE = _image_chat_template("[IMG]")


def image_text_checkpoint(folder: Path, seed: int = 0) -> Path:
    """The Mistral 3 checkpoint above with its tokenizer, image processor (transformers' Pixtral processor's
    files: ``preprocessor_config.json``, ``processor_config.json``) and chat template."""
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    config = Mistral3Config(
        text_config=MistralConfig(**TINY_DIMS, sliding_window=None).to_dict(),
        vision_config=PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, head_dim=16, image_size=112, patch_size=8).to_dict(),
        spatial_merge_size=2, image_token_index=IMAGE_TOKENS["[IMG]"], tie_word_embeddings=False,
    )
    return _pixtral_checkpoint(config, folder, seed, patch_size=8, merge=2)


def _pixtral_checkpoint(config: Any, folder: Path, seed: int, patch_size: int, merge: int) -> Path:
    """A checkpoint of a Pixtral tower with its tokenizer, template and Pixtral's processor files (an image token
    a 16 x 16 pixels: ``patch_size * merge`` is 16)."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    build_checkpoint(config, folder, seed)
    _word_tokenizer(folder, IMAGE_TOKENS, IMAGE_CHAT_TEMPLATE)
    PixtralImageProcessorPil(patch_size=16, size={"longest_edge": 112}).save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": patch_size, "spatial_merge_size": merge,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}, indent=2))
    return folder


def image_pixels(folder: Path, image: Any) -> tuple[torch.Tensor, int, int]:
    """transformers' processing of one PIL image for the checkpoint: pixels ``[3, height, width]`` (float32)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(folder))
    out = processor(images=[image], patch_size={"height": 16, "width": 16}, return_tensors="pt")
    height, width = (int(v) for v in out["image_sizes"][0])
    return out["pixel_values"][0, :, :height, :width].contiguous(), height, width


def expand_image_tokens(prompt: list[int], sizes: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """transformers' Pixtral processor's expansion of each ``[IMG]`` in ``prompt`` (one per image, in order): a
    row of ``[IMG]`` per 16 pixels of height, each row ``[IMG_BREAK]``-ended, the last ``[IMG_END]``-ended;
    the ids and each image's (offset, length)."""
    out: list[int] = []
    spans = []
    images = iter(sizes)
    for token in prompt:
        if token != IMAGE_TOKENS["[IMG]"]:
            out.append(token)
            continue
        height, width = next(images)
        rows = [[IMAGE_TOKENS["[IMG]"]] * (width // 16) + [IMAGE_TOKENS["[IMG_BREAK]"]] for _ in range(height // 16)]
        expanded = [t for row in rows for t in row]
        expanded[-1] = IMAGE_TOKENS["[IMG_END]"]
        spans.append((len(out), len(expanded)))
        out.extend(expanded)
    return out, spans


# LLaVA checkpoints whose images are served: Llama's layer beside a CLIP tower over 28 x 28 pixels in patches of
# 7 (its second-to-last layer's 16 patch rows, the CLS row dropped: 16 image tokens), ``<image>`` the image token
# at the vocabulary's end; or Mistral's layer beside a Pixtral tower (Pixtral 12B's form: images up to 112
# pixels a side, a token per 16 x 16 patch, the last layer's every row), with Pixtral's three tokens.
LLAVA_TOKENS = {"<image>": TINY_DIMS["vocab_size"] - 1}
LLAVA_IMAGE_SIDE = 28
LLAVA_IMAGE_TOKENS = 16


def llava_checkpoint(folder: Path, tower: str = "clip", seed: int = 0) -> Path:
    """The LLaVA checkpoint above (``tower`` "clip" or "pixtral") with its tokenizer, chat template and processor's
    files (CLIP's image processor and LLaVA's processor; or Pixtral's, as ``image_text_checkpoint``'s)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, MistralConfig, PixtralVisionConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if tower == "pixtral":
        config = LlavaConfig(
            text_config=MistralConfig(**TINY_DIMS, sliding_window=None).to_dict(),
            vision_config=PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, head_dim=16, image_size=112,
                                              patch_size=16).to_dict(),
            image_token_index=IMAGE_TOKENS["[IMG]"], vision_feature_layer=-1, vision_feature_select_strategy="full",
        )
        return _pixtral_checkpoint(config, folder, seed, patch_size=16, merge=1)
    config = LlavaConfig(
        text_config=LlamaConfig(**TINY_DIMS).to_dict(),
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=LLAVA_IMAGE_SIDE, patch_size=7).to_dict(),
        image_token_index=LLAVA_TOKENS["<image>"], image_seq_length=LLAVA_IMAGE_TOKENS,
    )
    build_checkpoint(config, folder, seed)
    _word_tokenizer(folder, LLAVA_TOKENS, _image_chat_template("<image>"))
    CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE_SIDE},
                          crop_size={"height": LLAVA_IMAGE_SIDE, "width": LLAVA_IMAGE_SIDE}).save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "patch_size": 7, "num_additional_image_tokens": 1,
        "vision_feature_select_strategy": "default", "image_token": "<image>"}, indent=2))
    return folder


def llava_pixels(folder: Path, image: Any) -> torch.Tensor:
    """transformers' processing of one PIL image for the CLIP checkpoint: pixels ``[3, 28, 28]`` (float32)."""
    from transformers import AutoImageProcessor

    out = AutoImageProcessor.from_pretrained(str(folder), backend="pil")(images=[image], return_tensors="pt")
    return out["pixel_values"][0].float()


# A LLaVA-NeXT checkpoint whose images are served: the LLaVA checkpoint's layer and CLIP tower (16 features a tile of
# 28 x 28 pixels) over grids of 1 x 2, 2 x 1 or 2 x 2 tiles (``image_grid_pinpoints``), after the whole image as one.
LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56]]


def llava_next_checkpoint(folder: Path, seed: int = 0) -> Path:
    """The LLaVA-NeXT checkpoint above with its tokenizer, chat template and processor's files (LLaVA-NeXT's image
    processor and processor)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    config = LlavaNextConfig(
        text_config=LlamaConfig(**TINY_DIMS).to_dict(),
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=LLAVA_IMAGE_SIDE, patch_size=7).to_dict(),
        image_token_index=LLAVA_TOKENS["<image>"], image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        tie_word_embeddings=False,
    )
    build_checkpoint(config, folder, seed)
    _word_tokenizer(folder, LLAVA_TOKENS, _image_chat_template("<image>"))
    LlavaNextImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE_SIDE},
                               crop_size={"height": LLAVA_IMAGE_SIDE, "width": LLAVA_IMAGE_SIDE},
                               image_grid_pinpoints=LLAVA_NEXT_PINPOINTS).save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaNextProcessor", "patch_size": 7, "num_additional_image_tokens": 1,
        "vision_feature_select_strategy": "default", "image_token": "<image>"}, indent=2))
    return folder


def llava_next_pixels(folder: Path, image: Any) -> tuple[torch.Tensor, int, int, int]:
    """transformers' processing of one PIL image for the checkpoint (LLaVA-NeXT's or LLaVA-OneVision's): its tiles
    ``[n, 3, 28, 28]`` (float32), its size as sent, and the image tokens transformers' processor writes for it."""
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaNextProcessor

    image_processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    out = image_processor(images=[image], return_tensors="pt")
    height, width = (int(v) for v in out["image_sizes"][0])
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if json.loads((folder / "config.json").read_text())["model_type"] == "llava_onevision":
        processor = _onevision_processor(image_processor)
    else:
        processor = LlavaNextProcessor(image_processor, tokenizer, patch_size=7,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)
    count = len(processor.replace_image_token({"image_sizes": [[height, width]], "batch_num_images": [1],
                                               "pixel_values": out["pixel_values"]}, 0)) // len("<image>")
    return out["pixel_values"][0].float(), height, width, count


def _onevision_processor(image_processor: Any) -> Any:
    """transformers' LLaVA-OneVision processor of the checkpoint below, not constructed: its constructor wants a
    video processor, which needs torchvision."""
    from transformers import LlavaOnevisionProcessor

    processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    processor.image_processor, processor.num_image_tokens = image_processor, 16
    processor.vision_feature_select_strategy, processor.vision_aspect_ratio = "full", "anyres_max_1"
    processor.image_token = "<image>"
    return processor


def llava_onevision_sample_pixels(folder: Path, images: list[Any]) -> list[tuple[torch.Tensor, int, int, int]]:
    """transformers' processing of a prompt of several images for the LLaVA-OneVision checkpoint, all of them in
    one sample: each image's whole-image tile ``[1, 3, 28, 28]`` (float32), its size as sent, and the image tokens
    transformers' processor writes for it."""
    from transformers import AutoImageProcessor

    image_processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    out = image_processor(images=[list(images)], return_tensors="pt")
    processor = _onevision_processor(image_processor)
    inputs = {"image_sizes": out["image_sizes"], "batch_num_images": [len(images)], "pixel_values": out["pixel_values"]}
    return [(out["pixel_values"][k][:1].float(), *(int(v) for v in out["image_sizes"][k]),
             len(processor.replace_image_token(inputs, k)) // len("<image>")) for k in range(len(images))]


# A LLaVA-OneVision checkpoint whose images are served: the LLaVA-NeXT checkpoint's grids with a SigLIP tower (every
# feature: 16 a tile of 28 x 28 pixels, its last layer's), and ``anyres_max_1``: a grid of more than one tile's
# features (by over 10%) is resized to about one tile's.
def llava_onevision_checkpoint(folder: Path, seed: int = 0) -> Path:
    """The LLaVA-OneVision checkpoint above with its tokenizer, chat template and processor's files."""
    from transformers import LlamaConfig, LlavaOnevisionConfig, SiglipVisionConfig
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    config = LlavaOnevisionConfig(
        text_config=LlamaConfig(**TINY_DIMS).to_dict(),
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=LLAVA_IMAGE_SIDE, patch_size=7).to_dict(),
        image_token_index=LLAVA_TOKENS["<image>"], image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        vision_aspect_ratio="anyres_max_1", tie_word_embeddings=False,
    )
    build_checkpoint(config, folder, seed)
    _word_tokenizer(folder, LLAVA_TOKENS, _image_chat_template("<image>"))
    LlavaOnevisionImageProcessorPil(size={"height": LLAVA_IMAGE_SIDE, "width": LLAVA_IMAGE_SIDE},
                                    image_grid_pinpoints=LLAVA_NEXT_PINPOINTS).save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 16, "vision_feature_select_strategy": "full",
        "vision_aspect_ratio": "anyres_max_1", "image_token": "<image>"}, indent=2))
    return folder


# A Gemma 3 checkpoint whose images are served: gemma3-window-rope-per-type's layer (windows of 12 tokens), a SigLIP
# tower over 56 x 56 pixels in patches of 7, its 8 x 8 patches' features averaged 2 x 2 into 16 image tokens, more
# than a window: within an image both ways and the window bind. Its tokenizer is ``build_tokenizer``'s with runs of
# up to 4 newlines a token each and Gemma's three image tokens at the vocabulary's end, and a template that writes
# ``<start_of_image>`` for an image part, as Gemma 3's own.
GEMMA3_TOKENS = {"<start_of_image>": TINY_DIMS["vocab_size"] - 3, "<end_of_image>": TINY_DIMS["vocab_size"] - 2,
                 "<image_soft_token>": TINY_DIMS["vocab_size"] - 1}
GEMMA3_IMAGE_SIDE = 56
GEMMA3_IMAGE_TOKENS = 16


def gemma3_image_checkpoint(folder: Path, seed: int = 0) -> Path:
    """The Gemma 3 checkpoint above with its tokenizer, chat template and image processor's file
    (``preprocessor_config.json``: transformers' Gemma 3 image processor, images resized to 56 x 56)."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    config = Gemma3Config(
        text_config=Gemma3TextConfig(
            **TINY_DIMS, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ).to_dict(),
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=GEMMA3_IMAGE_SIDE, patch_size=7).to_dict(),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS, boi_token_index=GEMMA3_TOKENS["<start_of_image>"],
        eoi_token_index=GEMMA3_TOKENS["<end_of_image>"], image_token_index=GEMMA3_TOKENS["<image_soft_token>"],
        tie_word_embeddings=False,  # a head of its own: tied, this tiny model's greedy answer repeats its last token
    )
    build_checkpoint(config, folder, seed)
    _word_tokenizer(folder, GEMMA3_TOKENS, _image_chat_template("<start_of_image>"), newlines=4, named={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIDE, "width": GEMMA3_IMAGE_SIDE}).save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma3Processor", "image_seq_length": GEMMA3_IMAGE_TOKENS}, indent=2))
    return folder


def gemma3_pixels(folder: Path, image: Any) -> torch.Tensor:
    """transformers' processing of one PIL image for the checkpoint: pixels ``[3, 56, 56]`` (float32)."""
    from transformers import AutoImageProcessor

    out = AutoImageProcessor.from_pretrained(str(folder), backend="pil")(images=[image], return_tensors="pt")
    return out["pixel_values"][0].float()


def expand_gemma3_tokens(prompt: list[int], num_images: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Each ``<start_of_image>`` in ``prompt`` followed by the image's 16 ``<image_soft_token>`` and
    ``<end_of_image>`` (transformers' Gemma 3 processor's sequence, less the newlines around it, which this
    word-level vocabulary has not); the ids and each image's (offset, length), its span from ``<start_of_image>``."""
    out: list[int] = []
    spans = []
    for token in prompt:
        out.append(token)
        if token == GEMMA3_TOKENS["<start_of_image>"]:
            spans.append((len(out) - 1, GEMMA3_IMAGE_TOKENS + 2))
            out += [GEMMA3_TOKENS["<image_soft_token>"]] * GEMMA3_IMAGE_TOKENS + [GEMMA3_TOKENS["<end_of_image>"]]
    assert len(spans) == num_images
    return out, spans


# SmolVLM and Idefics3 checkpoints whose images are served: Llama's layer beside a SigLIP-like tower over tiles of
# 28 x 28 pixels in patches of 7, each tile's 4 x 4 patches shuffled 2 x 2 into 4 image tokens. Images are resized
# to a longest side of 56 pixels and split into at most 2 x 2 tiles, the whole image one more. Its tokenizer is
# ``build_tokenizer``'s with runs of up to 2 newlines a token each and the processor's tokens at the vocabulary's
# end; its template writes ``<image>`` for an image part.
IDEFICS3_TOKENS = {"<image>": TINY_DIMS["vocab_size"] - 7, "<fake_token_around_image>": TINY_DIMS["vocab_size"] - 6,
                   "<global-img>": TINY_DIMS["vocab_size"] - 5,
                   **{f"<row_{r}_col_{c}>": TINY_DIMS["vocab_size"] - 4 + 2 * (r - 1) + c - 1
                      for r in (1, 2) for c in (1, 2)}}
IDEFICS3_TILE = 28
IDEFICS3_TILE_TOKENS = 4


def idefics3_checkpoint(folder: Path, model_type: str = "smolvlm", seed: int = 0) -> Path:
    """The checkpoint above (``model_type`` "smolvlm" or "idefics3") with its tokenizer, chat template and
    processor's files (its image processor's ``preprocessor_config.json``, ``processor_config.json``)."""
    from transformers import (
        Idefics3Config,
        Idefics3VisionConfig,
        LlamaConfig,
        SmolVLMConfig,
        SmolVLMVisionConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    smol = model_type == "smolvlm"
    vision = (SmolVLMVisionConfig if smol else Idefics3VisionConfig)(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IDEFICS3_TILE,
        patch_size=7)
    config = (SmolVLMConfig if smol else Idefics3Config)(
        text_config=LlamaConfig(**TINY_DIMS).to_dict(), vision_config=vision.to_dict(), scale_factor=2,
        image_token_id=IDEFICS3_TOKENS["<image>"])
    build_checkpoint(config, folder, seed)
    _word_tokenizer(folder, IDEFICS3_TOKENS, _image_chat_template("<image>"), newlines=2, named={
        "image_token": "<image>", "fake_image_token": "<fake_token_around_image>", "global_image_token": "<global-img>"})
    (SmolVLMImageProcessorPil if smol else Idefics3ImageProcessorPil)(
        size={"longest_edge": 2 * IDEFICS3_TILE}, max_image_size={"longest_edge": IDEFICS3_TILE},
    ).save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "SmolVLMProcessor" if smol else "Idefics3Processor",
        "image_seq_len": IDEFICS3_TILE_TOKENS}, indent=2))
    return folder


def idefics3_pixels(folder: Path, image: Any, **settings: Any) -> tuple[torch.Tensor, int, int]:
    """transformers' processing of one PIL image for the checkpoint (its image processor's file, ``settings`` over
    it): its tiles ``[n, 3, 28, 28]`` (float32) and its grid's height and width in pixels (one tile: 28 x 28)."""
    from transformers import AutoImageProcessor

    out = AutoImageProcessor.from_pretrained(str(folder), backend="pil", **settings)(
        images=[image], return_tensors="pt", return_row_col_info=True)
    rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
    return out["pixel_values"][0].float(), max(rows, 1) * IDEFICS3_TILE, max(cols, 1) * IDEFICS3_TILE


def expand_idefics3_tokens(folder: Path, prompt: list[int], grids: list[tuple[int, int]]
                           ) -> tuple[list[int], list[tuple[int, int]]]:
    """Each ``<image>`` in ``prompt`` replaced by transformers' processor's text for its image's grid (rows,
    columns; (0, 0): one tile) tokenized by the folder's tokenizer; the ids and each image's (offset, length)."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    processor = Idefics3Processor(image_processor=AutoImageProcessor.from_pretrained(str(folder), backend="pil"),
                                  tokenizer=tokenizer, image_seq_len=IDEFICS3_TILE_TOKENS)
    out: list[int] = []
    spans = []
    images = iter(grids)
    for token in prompt:
        if token != IDEFICS3_TOKENS["<image>"]:
            out.append(token)
            continue
        rows, cols = next(images)
        text = processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        spans.append((len(out), len(ids)))
        out.extend(ids)
    return out, spans


# A Qwen2.5-VL checkpoint whose images are served: Qwen2's layer under M-RoPE (sections [2, 3, 3] of each head's 8
# frequencies), a vision tower of two blocks (one windowed, one full) over patches of 14 pixels merged 2 x 2, so an
# image token stands for 28 x 28 pixels; images resized to between 4 and 64 tokens. Its tokenizer is
# ``build_tokenizer``'s with Qwen's three vision tokens at the vocabulary's end and a template that writes
# ``<|vision_start|><|image_pad|><|vision_end|>`` for an image part, as Qwen2.5-VL's own.
QWEN_VL_TOKENS = {"<|vision_start|>": TINY_DIMS["vocab_size"] - 3, "<|vision_end|>": TINY_DIMS["vocab_size"] - 2,
                  "<|image_pad|>": TINY_DIMS["vocab_size"] - 1}
QWEN_VL_PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16}
QWEN_VL_CHAT_TEMPLATE = _image_chat_template(" <|vision_start|><|image_pad|><|vision_end|> ")


# InternVL: tiles of 28 pixels in patches of 7 (16 patches, 4 features a tile after the shuffle), at most 3 tiles
# and the whole image.
INTERNVL_TOKENS = {"<img>": TINY_DIMS["vocab_size"] - 3, "<IMG_CONTEXT>": TINY_DIMS["vocab_size"] - 2,
                   "</img>": TINY_DIMS["vocab_size"] - 1}
INTERNVL_TILE = 28
INTERNVL_TILE_TOKENS = 4


def internvl_checkpoint(folder: Path, seed: int = 0) -> Path:
    """An InternVL checkpoint in transformers' form (a Qwen2 inside, a two-layer InternViT), its tokenizer (the three
    image tokens named as InternVL's tokenizer names them), chat template and processor's files (GOT-OCR2's image
    processor, up to 3 tiles; ``processor_config.json``'s ``image_seq_length``)."""
    from transformers import InternVLConfig, Qwen2Config
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": [INTERNVL_TILE, INTERNVL_TILE], "patch_size": [7, 7], "use_qk_norm": False}
    config = InternVLConfig(text_config=Qwen2Config(**TINY_DIMS).to_dict(), vision_config=vision,
                            image_token_id=INTERNVL_TOKENS["<IMG_CONTEXT>"], downsample_ratio=0.5)
    build_checkpoint(config, folder, seed)
    _word_tokenizer(folder, INTERNVL_TOKENS, _image_chat_template("<IMG_CONTEXT>"), named={
        "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"})
    GotOcr2ImageProcessorPil(size={"height": INTERNVL_TILE, "width": INTERNVL_TILE}, max_patches=3).save_pretrained(
        str(folder))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "InternVLProcessor", "image_seq_length": INTERNVL_TILE_TOKENS}, indent=2))
    return folder


def internvl_pixels(folder: Path, image: Any, **settings: Any) -> torch.Tensor:
    """transformers' processing of one PIL image for the checkpoint, as InternVL's processor runs it (its image
    processor's file, ``settings`` over it): its tiles ``[n, 3, 28, 28]`` (float32)."""
    from transformers import AutoImageProcessor

    out = AutoImageProcessor.from_pretrained(str(folder), backend="pil", **{"crop_to_patches": True, **settings})(
        images=[image], return_tensors="pt")
    return out["pixel_values"].float()


def expand_internvl_tokens(prompt: list[int], tiles: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Each ``<IMG_CONTEXT>`` in ``prompt`` replaced as InternVL's processor replaces it for an image of that many
    tiles (``<img>``, 4 context tokens a tile, ``</img>``), and each image's (offset, length), its span from
    ``<img>`` to ``</img>``."""
    context, out, spans = INTERNVL_TOKENS["<IMG_CONTEXT>"], [], []
    images = iter(tiles)
    for token in prompt:
        if token != context:
            out.append(token)
            continue
        n = next(images) * INTERNVL_TILE_TOKENS
        spans.append((len(out), n + 2))
        out += [INTERNVL_TOKENS["<img>"], *[context] * n, INTERNVL_TOKENS["</img>"]]
    return out, spans


def _word_tokenizer(folder: Path, special: dict[str, int], chat_template: str, newlines: int = 0,
                    named: dict[str, str] | None = None) -> None:
    """``build_tokenizer``'s word-level tokenizer with ``special`` tokens at the vocabulary's end, and a template.
    ``newlines``: runs of up to that many newlines are tokens of their own (one token a run, as Gemma's
    vocabulary has them), before the special tokens; ``named``: special tokens the tokenizer names (Gemma's
    ``boi_token``...)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab_size = TINY_DIMS["vocab_size"]
    words_end = vocab_size - len(special) - newlines
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, words_end)},
             **{"\n" * k: words_end + k - 1 for k in range(1, newlines + 1)}, **special}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n+"), "isolated"), pre_tokenizers.Split(" ", "removed"),
    ]) if newlines else pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>",
        additional_special_tokens=list(special), **({"extra_special_tokens": named} if named else {}),
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(folder))


def qwen_vl_checkpoint(folder: Path, seed: int = 0, model_type: str = "qwen2_5_vl") -> Path:
    """The Qwen2.5-VL checkpoint above (or, ``model_type`` "qwen3_vl", a Qwen3-VL one: Qwen3's layer under M-RoPE
    over interleaved columns, a tower over patches of 16 pixels whose two blocks' features also join the first two
    layers, the deepstack; "qwen3_vl_moe": the same around Qwen3-MoE's layer; "qwen2_vl": Qwen2-VL's, its tower's blocks
    all of full attention, its merger's norm a LayerNorm) with its tokenizer, chat template and image processor's file (``preprocessor_config.json``:
    transformers' Qwen2-VL image processor, images of 4 to 64 tokens)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLTextConfig,
        Qwen2VLConfig,
        Qwen2VLTextConfig,
        Qwen3VLConfig,
        Qwen3VLMoeConfig,
        Qwen3VLMoeTextConfig,
        Qwen3VLTextConfig,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokens = {"image_token_id": QWEN_VL_TOKENS["<|image_pad|>"], "vision_start_token_id": QWEN_VL_TOKENS["<|vision_start|>"],
              "vision_end_token_id": QWEN_VL_TOKENS["<|vision_end|>"], "tie_word_embeddings": False}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision3 = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
               "out_hidden_size": TINY_DIMS["hidden_size"], "deepstack_visual_indexes": [0, 1],
               "num_position_embeddings": 64}
    if model_type == "qwen3_vl":
        config: Any = Qwen3VLConfig(
            text_config=Qwen3VLTextConfig(**TINY_DIMS, rope_parameters={**rope, "mrope_interleaved": True}).to_dict(),
            vision_config=vision3, **tokens,
        )
    elif model_type == "qwen3_vl_moe":  # Qwen3-MoE's layer (a dense one at 1) under the same
        config = Qwen3VLMoeConfig(
            text_config=Qwen3VLMoeTextConfig(**TINY_DIMS, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                             mlp_only_layers=[1],
                                             rope_parameters={**rope, "mrope_interleaved": True}).to_dict(),
            vision_config=vision3, **tokens,
        )
    elif model_type == "qwen2_vl":
        config = Qwen2VLConfig(
            text_config=Qwen2VLTextConfig(**TINY_DIMS, rope_parameters=rope).to_dict(),
            vision_config={"depth": 2, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 2,
                           "hidden_size": TINY_DIMS["hidden_size"]},
            **tokens,
        )
    else:
        config = Qwen2_5_VLConfig(
            text_config=Qwen2_5_VLTextConfig(**TINY_DIMS, rope_parameters=rope).to_dict(),
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "window_size": 56,
                           "out_hidden_size": TINY_DIMS["hidden_size"], "fullatt_block_indexes": [1]},
            **tokens,
        )
    build_checkpoint(config, folder, seed)
    _word_tokenizer(folder, QWEN_VL_TOKENS, QWEN_VL_CHAT_TEMPLATE)
    step = 2 * QWEN_VL_PATCH[model_type]
    Qwen2VLImageProcessorPil(patch_size=QWEN_VL_PATCH[model_type], min_pixels=step * step * 4,
                             max_pixels=step * step * 64).save_pretrained(str(folder))
    return folder


def qwen_vl_pixels(folder: Path, image: Any, **settings: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """transformers' processing of one PIL image for the checkpoint (its image processor's file, ``settings`` over
    it): its patches ``[t * h * w, 3 * 2 * p * p]`` (float32) and their grid (t, h, w)."""
    from transformers import AutoImageProcessor

    out = AutoImageProcessor.from_pretrained(str(folder), backend="pil", **settings)(images=[image],
                                                                                     return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    return out["pixel_values"].float(), (t, h, w)


def qwen_vl_one_frame(patches: torch.Tensor) -> torch.Tensor:
    """The frame of a still image's patches the router sends (``[n, 3 * p * p]``): each patch's values are channel,
    frame, row and column, its two frames equal."""
    frames = patches.view(patches.shape[0], 3, 2, -1)
    assert torch.equal(frames[:, :, 0], frames[:, :, 1])
    return frames[:, :, 0].reshape(patches.shape[0], -1).contiguous()


def expand_qwen_vl_tokens(prompt: list[int], grids: list[tuple[int, int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """transformers' Qwen2.5-VL processor's expansion of each ``<|image_pad|>`` in ``prompt`` (one per image, in
    order) into t * h * w / 4 of them; the ids and each image's (offset, length)."""
    out: list[int] = []
    spans = []
    images = iter(grids)
    pad = QWEN_VL_TOKENS["<|image_pad|>"]
    for token in prompt:
        if token != pad:
            out.append(token)
            continue
        t, h, w = next(images)
        spans.append((len(out), t * h * w // 4))
        out.extend([pad] * (t * h * w // 4))
    return out, spans
