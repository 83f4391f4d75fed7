"""Correct or refused: a config field the model does not implement stops loading, naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.model.arch import ModelArch, UnsupportedConfig
from common.model.weights import load_hf_config
from tests.engine.tiny_models import TINY_DIMS


def _config(class_name: str, **fields: Any) -> Any:
    """A tiny config of transformers' class ``class_name`` with ``fields`` over ``TINY_DIMS``."""
    import transformers

    return getattr(transformers, class_name)(**{**TINY_DIMS, **fields})


def _falcon(**fields: Any) -> Any:
    """A tiny Falcon config: its heads are hidden_size / num_attention_heads wide (``head_dim`` is read-only)."""
    import transformers

    dims = {k: v for k, v in TINY_DIMS.items() if k not in ("num_key_value_heads", "head_dim", "intermediate_size")}
    return transformers.FalconConfig(**{**dims, **fields})


def _gemma3(**fields: Any) -> Any:
    return _config("Gemma3TextConfig", layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   **fields)


def _llama4(**fields: Any) -> Any:
    return _config("Llama4TextConfig", intermediate_size_mlp=96, num_local_experts=4, **fields)


def _compressed(**scheme: Any) -> dict[str, Any]:
    """A compressed-tensors quantization config of one scheme: W4A16 by groups of 16, ``scheme`` over it."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **scheme}}}


REFUSED = [
    ("rope-dynamic", lambda: _config("LlamaConfig", rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type"),
    ("rope-longrope", lambda: _config("LlamaConfig", rope_parameters={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "rope_theta": 1e4,
        "original_max_position_embeddings": 64}), "rope_parameters.rope_type"),
    ("partial-rotary", lambda: _config("LlamaConfig", partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("activation", lambda: _config("LlamaConfig", hidden_act="gelu"), "hidden_act"),
    ("final-softcap", lambda: _config("LlamaConfig", final_logit_softcapping=30.0), "final_logit_softcapping"),
    ("attn-softcap", lambda: _config("LlamaConfig", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("quantized", lambda: _config("LlamaConfig", quantization_config={"quant_method": "bitsandbytes"}),
     "quantization_config.quant_method"),
    ("gptq-3-bits", lambda: _config("LlamaConfig", quantization_config={"quant_method": "gptq", "bits": 3}),
     "quantization_config.bits"),
    ("gptq-marlin", lambda: _config("LlamaConfig", quantization_config={
        "quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}), "quantization_config.checkpoint_format"),
    ("awq-no-zero-point", lambda: _config("LlamaConfig", quantization_config={"quant_method": "awq", "bits": 4,
                                                                              "zero_point": False}),
     "quantization_config.zero_point"),
    ("awq-gemv", lambda: _config("LlamaConfig", quantization_config={"quant_method": "awq", "bits": 4,
                                                                     "version": "gemv"}), "quantization_config.version"),
    ("compressed-tensors-w8a8", lambda: _config("LlamaConfig", quantization_config=_compressed(input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True})),
     "quantization_config.config_groups.group_0.input_activations"),
    ("compressed-tensors-float-format-int-weights", lambda: _config("LlamaConfig", quantization_config=_compressed(
        format="float-quantized")), "quantization_config.config_groups.group_0.weights.type"),
    ("compressed-tensors-fp8-static-activations", lambda: _config("LlamaConfig", quantization_config=_compressed(
        format="float-quantized", weights={"num_bits": 8, "type": "float", "strategy": "channel"},
        input_activations={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})),
     "quantization_config.config_groups.group_0.input_activations"),
    ("compressed-tensors-int-and-float", lambda: _config("LlamaConfig", quantization_config={**_compressed(), "config_groups": {
        "group_0": _compressed()["config_groups"]["group_0"],
        "group_1": {"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}),
     "quantization_config.config_groups"),
    ("compressed-tensors-nvfp4", lambda: _config("LlamaConfig", quantization_config=_compressed(
        format="nvfp4-pack-quantized")), "quantization_config.config_groups.group_0.format"),
    ("compressed-tensors-sparse", lambda: _config("LlamaConfig", quantization_config={
        **_compressed(), "sparsity_config": {"format": "sparse-24-bitmask"}}), "quantization_config.sparsity_config"),
    ("compressed-tensors-block", lambda: _config("LlamaConfig", quantization_config=_compressed(weights={
        "num_bits": 4, "type": "int", "strategy": "block", "block_structure": [16, 16]})),
     "quantization_config.config_groups.group_0.weights.strategy"),
    ("llama-mxfp4", lambda: _config("LlamaConfig", quantization_config={"quant_method": "mxfp4"}),
     "quantization_config.quant_method"),
    ("fp8-static-activations", lambda: _config("LlamaConfig", quantization_config={
        "quant_method": "fp8", "activation_scheme": "static"}), "quantization_config.activation_scheme"),
    ("gemma2-activation", lambda: _config("Gemma2Config", hidden_activation="gelu"), "hidden_activation"),
    ("gemma2-bidirectional", lambda: _config("Gemma2Config", use_bidirectional_attention=True),
     "use_bidirectional_attention"),
    ("llama-attn-scalar", lambda: _config("LlamaConfig", query_pre_attn_scalar=24), "query_pre_attn_scalar"),
    ("llama-residual-multiplier", lambda: _config("LlamaConfig", residual_multiplier=0.5), "residual_multiplier"),
    ("smollm3-no-rope-flags", lambda: _config("SmolLM3Config", no_rope_layers=[1, 2, 1]), "no_rope_layers"),
    ("smollm3-no-rope-length", lambda: _config("SmolLM3Config", no_rope_layers=[1, 0],
                                                layer_types=["full_attention"] * 3),
     "no_rope_layers"),
    ("hunyuan-dynamic-without-alpha", lambda: _config("HunYuanDenseV1Config", rope_parameters={
        "rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters.rope_type"),
    ("hunyuan-negative-alpha", lambda: _config("HunYuanDenseV1Config", rope_parameters={
        "rope_type": "dynamic", "rope_theta": 1e4, "factor": 1.0, "alpha": -2.0}), "rope_parameters.alpha"),
    ("arcee-silu", lambda: _config("ArceeConfig", hidden_act="silu"), "hidden_act"),
    ("granite-zero-logits-scaling", lambda: _config("GraniteConfig", logits_scaling=0.0), "logits_scaling"),
    ("rope-per-type-qwen2", lambda: _config("Qwen2Config", rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e4}}), "rope_parameters"),
    ("gemma3-rope-longrope", lambda: _gemma3(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}),
     "rope_parameters.full_attention.rope_type"),
    ("olmo2-activation", lambda: _config("Olmo2Config", hidden_act="gelu"), "hidden_act"),
    ("olmo3-rope-dynamic", lambda: _config("Olmo3Config", sliding_window=8, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}),
     "rope_parameters.full_attention.rope_type"),
    ("olmoe-clip-qkv", lambda: _config("OlmoeConfig", clip_qkv=8.0), "clip_qkv"),
    ("olmoe-window", lambda: _config("OlmoeConfig", sliding_window=8), "sliding_window"),
    ("mixtral-activation", lambda: _config("MixtralConfig", hidden_act="gelu"), "hidden_act"),
    ("mixtral-more-experts-per-token-than-experts", lambda: _config(
        "MixtralConfig", num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    ("qwen3-moe-dense-layer-out-of-range", lambda: _config(
        "Qwen3MoeConfig", mlp_only_layers=[3]), "mlp_only_layers"),
    ("qwen2-moe-no-shared-expert", lambda: _config(
        "Qwen2MoeConfig", shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    ("glm4-moe-groups-do-not-divide", lambda: _config("Glm4MoeConfig", n_routed_experts=8, n_group=3), "n_group"),
    ("glm4-moe-more-groups-than-groups", lambda: _config(
        "Glm4MoeConfig", n_routed_experts=8, n_group=2, topk_group=3), "topk_group"),
    ("glm4-moe-odd-rotary-width", lambda: _config("Glm4MoeConfig", rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2}), "partial_rotary_factor"),
    ("ernie-moe-norm-min-that-binds", lambda: _config(
        "Ernie4_5_MoeConfig", moe_num_experts=8, moe_k=2, moe_norm_min=0.5), "moe_norm_min"),
    ("ernie-moe-interval-zero", lambda: _config("Ernie4_5_MoeConfig", moe_layer_interval=0), "moe_layer_interval"),
    ("glm-odd-rotary-width", lambda: _config("GlmConfig", partial_rotary_factor=0.2), "partial_rotary_factor"),
    ("cohere-no-layer-norm-eps", lambda: _config("CohereConfig", layer_norm_eps=None), "layer_norm_eps"),
    ("ministral3-no-query-scale-beta", lambda: _config("Ministral3Config", rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}),
     "rope_parameters.llama_4_scaling_beta"),
    ("gpt-oss-awq", lambda: _config("GptOssConfig", quantization_config={"quant_method": "awq", "bits": 4}),
     "quantization_config.quant_method"),
    ("helium-activation", lambda: _config("HeliumConfig", hidden_act="gelu"), "hidden_act"),
    ("phi-qk-layernorm", lambda: _config("PhiConfig", qk_layernorm=True), "qk_layernorm"),
    ("stablelm-activation", lambda: _config("StableLmConfig", hidden_act="gelu"), "hidden_act"),
    ("gpt-neox-activation", lambda: _config("GPTNeoXConfig", hidden_act="gelu_fast"), "hidden_act"),
    ("olmo-clip-qkv-zero", lambda: _config("OlmoConfig", clip_qkv=0.0), "clip_qkv"),
    ("olmo-activation", lambda: _config("OlmoConfig", hidden_act="gelu"), "hidden_act"),
    ("persimmon-activation", lambda: _config("PersimmonConfig", hidden_act="gelu", num_key_value_heads=4), "hidden_act"),
    ("persimmon-grouped-query", lambda: _config("PersimmonConfig"), "num_key_value_heads"),
    ("persimmon-head-dim", lambda: _config("PersimmonConfig", num_key_value_heads=4, head_dim=32), "head_dim"),
    ("falcon-alibi", lambda: _falcon(alibi=True), "alibi"),
    ("falcon-activation", lambda: _falcon(activation="gelu_new"), "activation"),
    ("falcon-new-arch-in-turn", lambda: _falcon(new_decoder_architecture=True, parallel_attn=False), "parallel_attn"),
    ("falcon-old-arch-two-norms", lambda: _falcon(num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn"),
    ("falcon-multi-head-kv-heads", lambda: _falcon(multi_query=False, num_kv_heads=2), "num_kv_heads"),
    ("phi-activation", lambda: _config("PhiConfig", hidden_act="gelu"), "hidden_act"),
    ("starcoder2-activation", lambda: _config("Starcoder2Config", hidden_act="gelu"), "hidden_act"),
    ("llama4-sliding-layer", lambda: _llama4(layer_types=["chunked_attention", "sliding_attention", "full_attention"]),
     "layer_types"),
    ("llama4-chunked-without-a-size", lambda: _llama4(attention_chunk_size=None, layer_types=[
        "chunked_attention", "full_attention", "full_attention"]), "attention_chunk_size"),
    ("llama4-temperature-without-a-floor", lambda: _llama4(floor_scale=0), "floor_scale"),
    ("llama4-expert-layer-out-of-range", lambda: _llama4(moe_layers=[3]), "moe_layers"),
    ("llama4-activation", lambda: _llama4(hidden_act="gelu"), "hidden_act"),
    ("chunked-layer", lambda: _config("Qwen2Config", sliding_window=8,
                                      layer_types=["chunked_attention", "full_attention", "full_attention"]),
     "layer_types"),
]


@pytest.mark.parametrize(("make", "field"), [(m, f) for _, m, f in REFUSED], ids=[i for i, _, _ in REFUSED])
def test_unimplemented_config_fields_are_refused_by_name(make, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnsupportedConfig, match=f"unsupported model config: {field}=") as info:
        ModelArch.from_config(make())
    assert info.value.field == field


@pytest.mark.parametrize("model_type", ["mpt", "bloom", "gptj", "qwen3_next", "phimoe", "deepseek_v32", "idefics2"])
def test_other_families_are_refused_when_loading_their_config(tmp_path: Path, model_type: str) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedConfig, match=f"model_type='{model_type}'"):
        load_hf_config(tmp_path)


def test_an_image_text_checkpoint_whose_language_model_is_not_served_is_refused_by_its_family(tmp_path: Path) -> None:
    """Mistral 3's wrapper around a language model of a family not served: refused, naming that family."""
    from transformers import AutoConfig, Mistral3Config

    text = AutoConfig.for_model("bloom").to_dict()
    Mistral3Config(text_config=text).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedConfig, match="model_type='bloom'"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("class_name", ["GptOssConfig", "AfmoeConfig"])
def test_a_family_that_keeps_its_norms_in_float32_under_float16_is_refused_in_float16(class_name: str) -> None:
    arch = ModelArch.from_config(_config(class_name))
    with pytest.raises(UnsupportedConfig, match="dtype='float16'"):
        arch.check_dtype("float16")
    arch.check_dtype("bfloat16")
    ModelArch.from_config(_config("LlamaConfig")).check_dtype("float16")


def test_a_refused_field_in_config_json_stops_loading_before_weights(tmp_path: Path) -> None:
    _config("LlamaConfig").save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfig, match="rope_type"):
        load_hf_config(tmp_path)  # no weights in the folder: refused before they are looked for


def test_supported_static_rope_kinds_and_biases_load() -> None:
    assert ModelArch.from_config(_config("LlamaConfig")).rope_type == "default"
    for kind in ("linear", "llama3", "yarn"):
        params = {"rope_type": kind, "factor": 2.0, "rope_theta": 1e4, "original_max_position_embeddings": 64,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        assert ModelArch.from_config(_config("LlamaConfig", rope_parameters=params)).rope_type == kind


def test_norms_kept_one_per_head_are_stacked_in_head_order_and_a_gap_is_a_broken_checkpoint() -> None:
    import torch

    from common.model.weights import stack_head_norms

    state = {f"m.q_norm.heads.{i}.weight": torch.full((4,), float(i)) for i in (1, 0, 2)}
    state["m.q_proj.weight"] = torch.zeros(2, 2)
    stack_head_norms(state)
    assert set(state) == {"m.q_norm.weight", "m.q_proj.weight"}
    assert state["m.q_norm.weight"][:, 0].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match=r"checkpoint mismatch: m.k_norm has the norms of heads \[0, 2\]"):
        stack_head_norms({f"m.k_norm.heads.{i}.weight": torch.zeros(4) for i in (0, 2)})
    with pytest.raises(ValueError, match="only a weight per head"):
        stack_head_norms({"m.k_norm.heads.0.bias": torch.zeros(4)})


def test_gpt_neox_s_fused_qkv_is_split_head_by_head_and_a_wrong_width_is_a_broken_checkpoint() -> None:
    import torch

    from common.model.weights import split_neox_qkv

    heads, size = 2, 3
    # Rows head by head, each head's q, k and v in turn: row value = 100 * head + 10 * part + entry.
    rows = [100 * h + 10 * p + e for h in range(heads) for p in range(3) for e in range(size)]
    state = {"l.self_attn.query_key_value.bias": torch.tensor(rows, dtype=torch.float32)}
    split_neox_qkv(state, heads, size)
    assert state["l.self_attn.k_proj.bias"].tolist() == [10, 11, 12, 110, 111, 112]
    assert set(state) == {f"l.self_attn.{p}_proj.bias" for p in "qkv"}
    with pytest.raises(ValueError, match="checkpoint mismatch"):
        split_neox_qkv({"l.self_attn.query_key_value.weight": torch.zeros(17, 4)}, heads, size)


def test_falcon_s_fused_qkv_is_split_by_kv_head_in_each_of_its_layouts() -> None:
    """Rows grouped by kv head, each group its queries, then its k, then its v: the new layout (a group per kv
    head), the multi-query one (one group: every query, then the one k and v), the multi-head one (a group per
    head, GPT-NeoX's)."""
    import torch

    from common.model.weights import split_neox_qkv

    heads, size = 4, 2
    for kv_heads in (2, 1, 4):
        per_group = heads // kv_heads
        # Row value = 100 * group + 10 * slot (queries 0.., then k, then v) + entry.
        rows = [100 * g + 10 * s + e for g in range(kv_heads) for s in range(per_group + 2) for e in range(size)]
        state = {"l.self_attn.query_key_value.weight": torch.tensor(rows, dtype=torch.float32)[:, None].repeat(1, 3)}
        split_neox_qkv(state, heads, size, kv_heads)
        q = [100 * g + 10 * s + e for g in range(kv_heads) for s in range(per_group) for e in range(size)]
        k = [100 * g + 10 * per_group + e for g in range(kv_heads) for e in range(size)]
        v = [100 * g + 10 * (per_group + 1) + e for g in range(kv_heads) for e in range(size)]
        assert state["l.self_attn.q_proj.weight"][:, 0].tolist() == q
        assert state["l.self_attn.k_proj.weight"][:, 2].tolist() == k
        assert state["l.self_attn.v_proj.weight"][:, 1].tolist() == v
        with pytest.raises(ValueError, match="checkpoint mismatch"):
            split_neox_qkv({"l.self_attn.query_key_value.bias": torch.zeros(len(rows) + size)}, heads, size, kv_heads)
