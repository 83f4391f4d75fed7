"""DeepSeek's Multi-head Latent Attention (``common.model.mla``) beyond the families' shared tests
(``test_model_families.py`` runs the ``deepseek-*`` checkpoints' logits, engine greedy and prefill -> KV ->
decode hand-off against transformers): the cache is one latent head per token; the absorbed attention's
logits agree with transformers' to float rounding, a decode step's too; each feature of the configs changes
transformers' logits, so those tests could see it done wrong; the interleaved pairs' rotation is transformers'
bit for bit in 16-bit; and what is not built is refused by name."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from common.model.arch import ROUTER_SIGMOID_GROUPS, ROUTER_SOFTMAX_GROUPS, ModelArch, UnsupportedConfig
from common.model.llama import AttentionMetadata, LlamaForCausalLM
from common.model.parallel import TensorParallel
from common.model.weights import load_hf_config, load_model
from pdserve_kernels import reference
from tests.engine.test_model_families import PROMPT_LEN, _changes_transformers_logits
from tests.engine.tiny_models import build_checkpoint, family_configs, hf_model, prompt_token_ids

MLA = sorted(name for name in family_configs() if name.startswith("deepseek"))
V2_LITE, V2_GROUPS, V3_YARN, V3_HALVES = (
    "deepseek-v2-lite-mla-moe-greedy", "deepseek-v2-mla-moe-group-limited-yarn", "deepseek-v3-mla-moe-yarn",
    "deepseek-v3-mla-moe-halves")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("mla")

    @functools.cache
    def build(name: str) -> Path:
        return build_checkpoint(family_configs()[name], root / name)

    return build


def _load(folder: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return load_model(folder, load_hf_config(folder), reference, dtype, torch.device("cpu"))


def test_the_configs_ask_for_what_they_say() -> None:
    configs = family_configs()
    arch = {name: ModelArch.from_config(configs[name]) for name in MLA}
    assert all(a.mla and a.rotary_dim == 8 and a.moe_layers == (1, 2) for a in arch.values())
    lite, groups, v3, halves = (arch[n] for n in (V2_LITE, V2_GROUPS, V3_YARN, V3_HALVES))
    assert lite.router == groups.router == ROUTER_SOFTMAX_GROUPS and not lite.norm_topk_prob
    assert (lite.num_expert_groups, lite.topk_groups, lite.routed_scaling_factor) == (1, 1, 1.5)
    assert (groups.num_expert_groups, groups.topk_groups, groups.routed_scaling_factor) == (2, 1, 2.0)
    assert groups.qkv_bias and groups.o_bias and groups.mlp_bias and not lite.qkv_bias
    assert lite.rope_interleaved and lite.rope_float32 and lite.rope_tables_float32 and lite.routing_weights_float32
    assert v3.router == halves.router == ROUTER_SIGMOID_GROUPS and v3.norm_topk_prob and not halves.norm_topk_prob
    assert v3.rope_interleaved and not halves.rope_interleaved and not v3.rope_float32
    assert halves.qkv_bias and halves.o_bias and not halves.mlp_bias
    assert v3.shared_expert_intermediate_size == 32 and groups.shared_expert_intermediate_size == 64


@pytest.mark.parametrize("name", MLA)
def test_the_cache_holds_one_latent_head_per_token(checkpoint, name: str) -> None:  # type: ignore[no-untyped-def]
    """One vector of qk_rope_head_dim + kv_lora_rank (8 + 32) entries per token and layer, its halves in the K
    and V slots (one KV head of 20): the engine sizes the cache, and the transfer moves its blocks, from these
    two numbers alone. What a prefill wrote there, joined, is the rotated key and the normed latent."""
    model = _load(checkpoint(name))
    assert (model.num_kv_heads, model.head_size) == (1, 20)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj is None) == (name in (V2_GROUPS, V3_YARN))
    seen: list[torch.Tensor] = []
    handle = attn.register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
    n, block_size = 6, 8
    kv_cache = torch.zeros(len(model.model.layers), 2, 2, block_size, 1, 20)
    meta = AttentionMetadata(slot_mapping=torch.arange(block_size, block_size + n), block_tables=torch.tensor([[1]]),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             context_lens=torch.tensor([n], dtype=torch.int32), max_query_len=n)
    with torch.inference_mode():
        model(torch.tensor(prompt_token_ids(n)), torch.arange(n), meta, kv_cache)
        handle.remove()
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(seen[0])[:, :32])
    joined = torch.cat((kv_cache[0, 0, 1, :n, 0], kv_cache[0, 1, 1, :n, 0]), dim=-1)
    torch.testing.assert_close(joined[:, 8:], latent)
    assert not kv_cache[0, :, 0].any()  # nothing written outside the slots given


def _prefill_then_decode(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    """Logits over ``prompt[:-1]`` in one prefill, then over its last token in a decode step that reads the
    cache the prefill wrote (8-token blocks, in reverse order: the block table is read)."""
    n, block_size = len(prompt), 8
    blocks = -(-n // block_size)
    kv_cache = torch.zeros(len(model.model.layers), 2, blocks + 2, block_size, model.num_kv_heads, model.head_size)
    table = torch.arange(blocks + 1, 1, -1, dtype=torch.int32)[None]
    slots = (table[0].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
    prefill = AttentionMetadata(slot_mapping=slots[:-1], block_tables=table,
                                query_start_loc=torch.tensor([0, n - 1], dtype=torch.int32),
                                context_lens=torch.tensor([n - 1], dtype=torch.int32), max_query_len=n - 1)
    decode = AttentionMetadata(slot_mapping=slots[-1:], block_tables=table,
                               query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                               context_lens=torch.tensor([n], dtype=torch.int32), max_query_len=1)
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt[:-1]), torch.arange(n - 1), prefill, kv_cache)
        last = model(torch.tensor(prompt[-1:]), torch.tensor([n - 1]), decode, kv_cache)
        return model.compute_logits(torch.cat((hidden, last)))


@pytest.mark.parametrize("name", MLA)
def test_absorbed_attention_agrees_with_transformers_to_float_rounding(checkpoint, name: str) -> None:  # type: ignore[no-untyped-def]
    """Prefill and a decode step: each score is transformers' sum of products, grouped otherwise."""
    folder = checkpoint(name)
    prompt = prompt_token_ids(PROMPT_LEN)
    got = _prefill_then_decode(_load(folder), prompt)
    with torch.inference_mode():
        expected = hf_model(folder)(torch.tensor([prompt])).logits[0].float()
    assert (got - expected).abs().max() < 5e-5
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("expanded", [True, False], ids=["expanded", "absorbed"])
def test_prefill_in_either_form_agrees_with_transformers(checkpoint, monkeypatch, expanded: bool) -> None:  # type: ignore[no-untyped-def]
    """The prefill of ``_prefill_then_decode`` expanded (transformers' form) or absorbed, a decode absorbed."""
    from common.model import mla

    monkeypatch.setattr(mla, "EXPANDED_PREFILL", expanded)
    calls: list[int] = []
    real = mla.MLAttention._expanded
    monkeypatch.setattr(mla.MLAttention, "_expanded", lambda self, *a: calls.append(1) or real(self, *a))
    folder = checkpoint(V3_YARN)
    prompt = prompt_token_ids(PROMPT_LEN)
    got = _prefill_then_decode(_load(folder), prompt)
    with torch.inference_mode():
        expected = hf_model(folder)(torch.tensor([prompt])).logits[0].float()
    assert (got - expected).abs().max() < 5e-5
    assert bool(calls) == expanded  # one call per layer where expanded


def test_a_step_mixing_decode_rows_and_chunks_runs_each_in_its_form(checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One forward over a decode row, a whole 12-token prompt (expanded) and a 4-token chunk after a 26-token
    cached prefix (its context longer than the step's 17 tokens: absorbed) gives each row what a step of its
    own, all absorbed, gives."""
    from common.model import mla

    model = _load(checkpoint(V3_YARN))
    block_size, layers = 8, len(model.model.layers)
    prompts = [prompt_token_ids(10, seed=1), prompt_token_ids(12, seed=2), prompt_token_ids(30, seed=3)]
    cached = [9, 0, 26]  # tokens of each already in the cache before the mixed step
    tables = torch.tensor([[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 7, 8]], dtype=torch.int32)

    def slots(seq: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return tables[seq, pos // block_size].long() * block_size + pos % block_size

    def step(cache: torch.Tensor, seqs: list[int], starts: list[int], ends: list[int]) -> torch.Tensor:
        lens = [e - b for b, e in zip(starts, ends, strict=True)]
        meta = AttentionMetadata(
            slot_mapping=torch.cat([slots(s, b, e) for s, b, e in zip(seqs, starts, ends, strict=True)]),
            block_tables=tables[seqs], query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
            context_lens=torch.tensor(ends, dtype=torch.int32), max_query_len=max(lens))
        ids = torch.tensor([t for s, b, e in zip(seqs, starts, ends, strict=True) for t in prompts[s][b:e]])
        pos = torch.cat([torch.arange(b, e) for b, e in zip(starts, ends, strict=True)])
        with torch.inference_mode():
            return model(ids, pos, meta, cache)

    cache = torch.zeros(layers, 2, 9, block_size, 1, model.head_size)
    for seq in (0, 2):  # the cached prefixes
        step(cache, [seq], [0], [cached[seq]])
    expanded: list[int] = []
    real = mla.MLAttention._expanded
    monkeypatch.setattr(mla.MLAttention, "_expanded", lambda self, *a: expanded.append(a[-1]) or real(self, *a))
    mixed = step(cache.clone(), [0, 1, 2], [9, 0, 26], [10, 12, 30])
    assert set(expanded) == {12}  # the whole prompt only, in every layer
    monkeypatch.setattr(mla, "EXPANDED_PREFILL", False)
    alone = torch.cat([step(cache.clone(), [s], [cached[s]], [len(prompts[s])]) for s in range(3)])
    torch.testing.assert_close(mixed, alone, rtol=1e-5, atol=1e-5)


def test_the_form_of_a_chunk_is_the_one_with_fewer_multiply_adds(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek-V3's dims (rank 512, nope 128, rope 64, v 128): a prompt's chunk of 512 expands, a decode row
    and a short chunk over a long context do not, nor a context longer than the step's tokens."""
    attn = _load(checkpoint(V3_YARN)).model.layers[0].self_attn
    attn.kv_lora_rank, attn.nope_dim, attn.rope_dim, attn.v_dim = 512, 128, 64, 128
    assert attn.expands(512, 512, 512) and attn.expands(2048, 4096, 4096)
    assert not attn.expands(1, 100, 100)  # a decode row
    assert not attn.expands(64, 4096, 4096)  # a short chunk over a long context: carrying it all out costs more
    assert not attn.expands(512, 1024, 512)  # more context than the step's tokens (the profiled bound)


def _attentions(model: Any) -> list[Any]:
    return [layer.self_attn for layer in model.model.layers]


def _unscaled(model: Any) -> None:  # the attention's scale without YaRN's mscale_all_dim
    for attn in _attentions(model):
        attn.scaling = attn.qk_head_dim ** -0.5


def _latent_norms_eps(eps: float):  # type: ignore[no-untyped-def]
    def change(model: Any) -> None:
        for attn in _attentions(model):
            attn.kv_a_layernorm.variance_epsilon = eps
            if attn.q_a_layernorm is not None:
                attn.q_a_layernorm.variance_epsilon = eps
    return change


def _without_q_norm(model: Any) -> None:
    for attn in _attentions(model):
        attn.q_a_layernorm = torch.nn.Identity()


def _no_attention_biases(model: Any) -> None:
    for attn in _attentions(model):
        for proj in (attn.q_a_proj, attn.kv_a_proj_with_mqa, attn.o_proj):
            if proj is not None and proj.bias is not None:
                proj.bias.zero_()


def _no_correction_bias(model: Any) -> None:
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()


def _set(field: str, value: Any):  # type: ignore[no-untyped-def]
    return lambda config: setattr(config, field, value)


@pytest.mark.parametrize(("name", "change_config", "change_model"), [
    (V3_YARN, None, _unscaled),
    (V2_GROUPS, None, _unscaled),
    (V3_YARN, _set("rope_interleave", False), None),
    (V3_HALVES, _set("rope_interleave", True), None),
    (V3_YARN, None, _latent_norms_eps(0.05)),  # its rms_norm_eps
    (V2_LITE, None, _latent_norms_eps(0.5)),
    (V3_YARN, None, _without_q_norm),
    (V2_GROUPS, None, _no_attention_biases),
    (V3_HALVES, None, _no_attention_biases),
    (V2_GROUPS, _set("topk_group", 2), None),
    (V2_GROUPS, _set("routed_scaling_factor", 1.0), None),
    (V2_LITE, _set("routed_scaling_factor", 1.0), None),
    (V2_GROUPS, _set("mlp_bias", False), None),
    (V3_YARN, _set("topk_group", 2), None),
    (V3_YARN, None, _no_correction_bias),
    (V3_YARN, _set("norm_topk_prob", False), None),
], ids=["v3-no-mscale", "v2-no-mscale", "v3-halves", "v3-interleaved", "v3-latent-norms-eps", "v2-latent-norms-eps",
        "v3-no-q-norm", "v2-no-attention-biases", "v3-no-attention-biases", "v2-all-groups", "v2-unscaled-routes",
        "v2-lite-unscaled-routes", "v2-no-mlp-bias", "v3-all-groups", "v3-no-correction-bias", "v3-not-renormalized"])
def test_each_mla_feature_changes_transformers_logits(checkpoint, name, change_config, change_model) -> None:  # type: ignore[no-untyped-def]
    """Each feature undone (YaRN's mscale_all_dim on the scale, the pairs' layout, the latent norms' own
    epsilon, the low-rank q's norm, biases, the routers' groups, scaling, correction bias, renormalization)
    moves transformers' logits: the equality tests would see it done wrong."""
    assert _changes_transformers_logits(checkpoint(name), change_config, change_model)


def test_deepseek_v2_s_interleaved_pairs_change_transformers_logits(checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek-V2 always turns interleaved pairs (complex numbers): turned by halves, the logits move."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as modeling

    def by_halves(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = freqs_cis.real.unsqueeze(1), freqs_cis.imag.unsqueeze(1)

        def turn(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)
        return turn(xq), turn(xk)

    folder = checkpoint(V2_LITE)
    prompt = torch.tensor([prompt_token_ids(PROMPT_LEN)])
    with torch.inference_mode():
        model = hf_model(folder)
        interleaved = model(prompt).logits
        monkeypatch.setattr(modeling, "apply_rotary_emb", by_halves)
        halves = model(prompt).logits
    assert (interleaved - halves).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_deepseek_v3_s_interleaved_rotation_is_transformers_bit_for_bit(checkpoint, dtype: torch.dtype) -> None:
    """In 16-bit, the kernels' rotation of halves on q and k whose rotated entries were reordered as the loader
    reorders the rows gives transformers' interleaved rotation's bits (which leaves them in that order)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    folder = checkpoint(V3_YARN)
    ours, hf = _load(folder, dtype), hf_model(folder, dtype)
    gen = torch.Generator().manual_seed(4)
    n, heads, rope_dim = 40, 4, 8
    q = (3 * torch.randn(n, heads, rope_dim, generator=gen)).to(dtype)
    k = (3 * torch.randn(n, 1, rope_dim, generator=gen)).to(dtype)
    positions = torch.arange(n)
    order = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    with torch.inference_mode():
        cos, sin = hf.model.rotary_emb(q[None], positions[None])
        want_q, want_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        got_q, got_k = reference.rope(q[..., order], k[..., order], *ours.rope_tables(positions, dtype)["all_layers"])
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_deepseek_v2_s_rotation_is_transformers_in_float32(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek-V2's complex rotation of interleaved pairs, in float32 against its float32 tables: the kernels'
    rotation of halves on reordered entries gives the same numbers (to the bit on this CPU), reordered."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    folder = checkpoint(V2_GROUPS)
    ours, hf = _load(folder), hf_model(folder)
    gen = torch.Generator().manual_seed(5)
    n, heads, rope_dim = 40, 4, 8
    q, k = 3 * torch.randn(n, heads, rope_dim, generator=gen), 3 * torch.randn(n, 1, rope_dim, generator=gen)
    positions = torch.arange(n)
    order = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    with torch.inference_mode():
        freqs_cis = hf.model.rotary_emb(q[None], positions[None])
        want_q, want_k = apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis)
        got_q, got_k = reference.rope(q[..., order], k[..., order], *ours.rope_tables(positions, torch.float32)["all_layers"])
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1)[..., order], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1)[..., order], atol=1e-6, rtol=1e-6)


def _refused(name: str, **changes: Any) -> Any:
    config = copy.deepcopy(family_configs()[name])
    for field, value in changes.items():
        object.__setattr__(config, field, value)
    return config


@pytest.mark.parametrize(("name", "changes", "message"), [
    (V3_YARN, {"num_key_value_heads": 2}, "num_key_value_heads=2 (Multi-head Latent Attention gives every head"),
    (V2_LITE, {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' (implemented: greedy, group_limited_greedy)"),
    (V2_LITE, {"norm_topk_prob": True}, "norm_topk_prob=True (transformers' DeepSeek-V2 router never renormalizes"),
    (V2_LITE, {"scoring_func": "sigmoid"}, "scoring_func='sigmoid' (transformers scores deepseek_v2's experts by softmax"),
    (V3_YARN, {"scoring_func": "softmax"}, "scoring_func='softmax' (transformers scores deepseek_v3's experts by sigmoid"),
    (V3_YARN, {"topk_method": "greedy"}, "topk_method='greedy' (transformers routes deepseek_v3 as noaux_tc only)"),
    (V3_YARN, {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    (V2_GROUPS, {"n_group": 3}, "n_group=3 (must divide the 8 experts into groups)"),
    (V2_GROUPS, {"topk_group": 5}, "topk_group=5"),
    (V3_YARN, {"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 (RoPE turns pairs: must be even)"),
    (V3_YARN, {"kv_lora_rank": 0}, "kv_lora_rank=0 (must be a positive integer)"),
    (V3_YARN, {"kv_lora_rank": 33}, "kv_lora_rank=33 (the cache holds the latent in two halves: must be even)"),
    (V2_LITE, {"q_lora_rank": 0}, "q_lora_rank=0"),
], ids=["kv-heads", "v2-noaux-tc", "v2-norm-topk-prob", "v2-sigmoid", "v3-softmax", "v3-greedy", "moe-layer-freq",
        "v2-groups", "v2-topk-group", "odd-rope", "no-latent", "odd-latent",
        "q-lora-rank-0"])
def test_what_is_not_built_is_refused_by_name(name: str, changes: dict[str, Any], message: str) -> None:
    config = _refused(name, **changes)
    with pytest.raises(UnsupportedConfig, match="unsupported model config: ") as refused:
        ModelArch.from_config(config)
    assert message in str(refused.value)
    assert "refusing to load the model" in str(refused.value)


@pytest.mark.parametrize("name", MLA)
def test_over_two_ranks_each_holds_its_heads_and_the_whole_latent(name: str) -> None:
    """Tensor parallelism splits the heads (their rows of q's and of the latent's up-projections, their columns of
    o_proj); the projections down to the latent and the one cached latent head are every rank's whole. (Each
    rank's logits equal one process's: ``tests/engine/test_tensor_parallel_model.py``.)"""
    config = family_configs()[name]
    with torch.device("meta"):
        whole = LlamaForCausalLM(config, reference)
        half = LlamaForCausalLM(config, reference, TensorParallel(1, 2, group=object()))
    full, share = whole.model.layers[0].self_attn, half.model.layers[0].self_attn
    assert share.num_heads * 2 == full.num_heads and (half.num_kv_heads, half.head_size) == (1, whole.head_size)
    assert share.kv_b_proj.weight.shape[0] * 2 == full.kv_b_proj.weight.shape[0]
    assert share.o_proj.weight.shape[1] * 2 == full.o_proj.weight.shape[1]
    assert share.kv_a_proj_with_mqa.weight.shape == full.kv_a_proj_with_mqa.weight.shape
    with torch.device("meta"), pytest.raises(UnsupportedConfig, match="num_attention_heads=4 .*--tensor-parallel-size 8"):
        LlamaForCausalLM(config, reference, TensorParallel(1, 8, group=object()))


def test_lora_adapts_the_output_projection_and_refuses_the_latent_projections(checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """o_proj is a plain projection (as the MLPs are): an adapter of it is served, equal to PEFT's greedy output;
    one of the q, latent or up-projections is refused by name. (PEFT saves adapters of these checkpoints' MLPs as
    ``target_parameters``, refused for every family.)"""
    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.lora_modules import LoRAModule
    from common.model.lora import UnsupportedAdapter
    from common.sampling_params import SamplingParams
    from tests.engine.tiny_models import hf_greedy, peft_adapter, peft_greedy

    base = checkpoint(V3_YARN)
    latent = peft_adapter(base, tmp_path / "kv", r=2, lora_alpha=2, target_modules=["kv_b_proj"])
    with pytest.raises(UnsupportedAdapter, match="LoRA on model.layers.0.self_attn.kv_b_proj is not implemented: of "
                                                 "Multi-head Latent Attention's projections"):
        LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", num_blocks=8, enable_lora=True,
                               lora_modules=(LoRAModule("kv", str(latent)),)))
    served = peft_adapter(base, tmp_path / "o", r=2, lora_alpha=4, target_modules=["o_proj"])
    engine = LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32", num_blocks=16, block_size=8,
                                    enable_lora=True, lora_modules=(LoRAModule("o", str(served)),)))
    prompt = prompt_token_ids(13, seed=3)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), lora_name="o")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert tokens == peft_greedy(base, served, prompt, 8)
    assert tokens != hf_greedy(base, prompt, 8)  # the adapter changes them


def test_the_triton_kernels_take_the_latent_head(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The Triton kernels (here under Triton's CPU interpreter) take the latent in its two 20-wide halves (each
    padded to 32 lanes, as V3's 288 to 512), every query head reading it: the engine's greedy tokens are
    transformers'."""
    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.sampling_params import SamplingParams
    from tests.engine.tiny_models import hf_greedy

    folder = checkpoint(V3_YARN)
    prompt = prompt_token_ids(13, seed=4)
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", num_blocks=16, block_size=8,
                                    max_num_batched_tokens=8, kernel_backend="triton"))
    tokens = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0][0]
    assert tokens == hf_greedy(folder, prompt, 6)
