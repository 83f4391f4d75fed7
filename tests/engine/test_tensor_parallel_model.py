"""Tensor parallelism inside the model (``common.model.parallel``): two ranks, real processes summing over
torch.distributed's gloo on the CPU, each holding its share of a tiny checkpoint, compute the single
process's logits for each family tested (and the same bits on both ranks); what does not divide among the
ranks is refused by name; the shard rules' shares put back together are the whole tensor; and one process
(no ``tp``, or a group of one) dispatches the very operations, and computes the very bits, it did before."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.model.arch import UnsupportedConfig, language_model_config
from common.model.llama import AttentionMetadata, LlamaForCausalLM
from common.model.parallel import SINGLE, Shard, TensorParallel, shard_of, shard_rules
from pdserve_kernels import reference
from tests.engine.tiny_models import WINDOW, build_checkpoint, family_configs, prompt_token_ids

SIZE = 2
PROMPT_LEN = 2 * WINDOW + 7  # longer than the windows, ending inside a block
# One family per feature that sharding meets: q/k/v, o and MLP biases (Llama); q/k/v biases alone and
# windows (Qwen2); per-head q/k norms of a head's width (Qwen3) and stored per head (Cohere, StableLM, the
# first with its q/k rows reordered for RoPE); sandwich norms and soft-caps (Gemma 2); an ungated MLP with o
# and down biases (StarCoder2); side-by-side blocks (Phi, GPT-NeoX, whose q/k/v the loader splits head by
# head; Falcon's grouped by KV head); mixtures: Mixtral's, Qwen2-MoE's with a gated shared expert, gpt-oss's
# (sinks, expert biases), AFMoE's (the attention's output gate, shared experts), Qwen3-VL-MoE's (experts
# input-major in the checkpoint), Granite MoE Shared's (its shared expert's own width).
FAMILIES = (
    "llama-bias", "qwen2-window-layers", "qwen3-qk-norm", "cohere-interleaved-rope-parallel-qk-norm",
    "stablelm-parallel-qk-layernorm", "gemma2-window-softcap", "starcoder2-layernorm-bias-window",
    "phi-parallel-partial-rope-layernorm", "gpt-neox-parallel-two-norms", "falcon-new-arch-grouped-qkv-two-norms",
    "mixtral-moe-window", "qwen2-moe-shared-expert", "gpt-oss-moe-sinks-window", "afmoe-moe-gated-attention-window",
    "qwen3-vl-moe-image-text-text-only", "granitemoeshared-shared-expert", "llama4-moe-chunked-nope-qk-norm",
    # Multi-head Latent Attention: each rank's heads over the latent every rank holds whole.
    "deepseek-v2-lite-mla-moe-greedy", "deepseek-v3-mla-moe-yarn",
    # One KV head (multi-query), replicated on both ranks.
    "falcon-multi-query-parallel",
)
RANK_TIMEOUT_S = 120


@functools.cache
def _configs() -> dict[str, Any]:
    return family_configs()


def _logits(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    """The model's logits over ``prompt`` in one prefill, then over one token more in a decode step, its K
    and V in 8-token blocks of a cache with the model's KV heads (a rank's own)."""
    n, block_size = len(prompt), 8
    blocks = -(-(n + 1) // block_size)
    kv_cache = torch.zeros(len(model.model.layers), 2, blocks, block_size, model.num_kv_heads, model.head_size)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    prefill = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=table, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32), max_query_len=n)
    decode = AttentionMetadata(
        slot_mapping=torch.tensor([n]), block_tables=table, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        context_lens=torch.tensor([n + 1], dtype=torch.int32), max_query_len=1)
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(n), prefill, kv_cache)
        last = model(torch.tensor(prompt[:1]), torch.tensor([n]), decode, kv_cache)
        return model.compute_logits(torch.cat((hidden, last)))


def _load(folder: Path, tp: TensorParallel | None = None) -> LlamaForCausalLM:
    from common.model.weights import load_hf_config, load_model

    return load_model(folder, load_hf_config(folder), reference, torch.float32, torch.device("cpu"), tp)


def _rank_main(rank: str, port: str, job: str) -> None:
    """One rank's process: joins the group, loads each family's share, and writes its logits
    (``rank<r>.safetensors``) and, per family, its KV heads and the sums each forward ran (``rank<r>.json``)."""
    from datetime import timedelta

    import torch.distributed as dist
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    spec = json.loads(Path(job).read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=SIZE,
                            timeout=timedelta(seconds=RANK_TIMEOUT_S))
    tp = TensorParallel(int(rank), SIZE, dist.group.WORLD)
    sums = [0]
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        sums[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted  # what ``TensorParallel.all_reduce`` calls
    logits, facts = {}, {}
    for name, folder in spec["folders"].items():
        model = _load(Path(folder), tp)
        sums[0] = 0
        logits[name] = _logits(model, spec["prompt"])
        facts[name] = {"num_kv_heads": model.num_kv_heads, "sums": sums[0], "layers": len(model.model.layers),
                       "tp": [model.tp.rank, model.tp.size]}
    out = Path(spec["out"])
    save_file(logits, str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every family of ``FAMILIES`` run once in one process and once over two ranks (both started once, for
    all families): the single process's logits, each rank's, each rank's facts."""
    from safetensors.torch import load_file

    from ops.launcher import die_with_parent
    from tests.conftest import collect_lines, free_port

    root = tmp_path_factory.mktemp("tensor-parallel")
    folders = {name: build_checkpoint(_configs()[name], root / name) for name in FAMILIES}
    prompt = prompt_token_ids(PROMPT_LEN)
    job = root / "job.json"
    job.write_text(json.dumps({"folders": {n: str(f) for n, f in folders.items()}, "prompt": prompt, "out": str(root)}))
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(root / "cache"), "GLOO_SOCKET_IFNAME": os.environ.get(
        "GLOO_SOCKET_IFNAME", "lo")}
    port = free_port()
    code = "import sys; from tests.engine.test_tensor_parallel_model import _rank_main; _rank_main(*sys.argv[1:])"
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port), str(job)], cwd=Path(__file__).parents[2],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              preexec_fn=die_with_parent) for r in range(SIZE)]
    stderr = [collect_lines(proc.stderr) for proc in procs]
    # Meanwhile (the ranks take seconds to import), the single process's logits.
    single = {name: _logits(_load(folder), prompt) for name, folder in folders.items()}
    # Until both are done; one that failed leaves the other waiting in a sum: stopped then, not at the timeout.
    while (any(proc.poll() is None for proc in procs) and not any(proc.returncode for proc in procs)
           and time.monotonic() < started + RANK_TIMEOUT_S):
        time.sleep(0.05)
    stopped = [proc.poll() is None for proc in procs]
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    errors = [f"rank {r} {'stopped (timed out, or the other failed)' if stopped[r] else f'exited {proc.returncode}'}: "
              f"{''.join(stderr[r])[-3000:]}" for r, proc in enumerate(procs) if proc.returncode]
    assert not errors, "\n".join(errors)
    return {"single": single, "logits": [load_file(str(root / f"rank{r}.safetensors")) for r in range(SIZE)],
            "facts": [json.loads((root / f"rank{r}.json").read_text()) for r in range(SIZE)]}


@pytest.mark.parametrize("name", FAMILIES)
def test_each_rank_s_logits_equal_the_single_process_s(ranks: dict[str, Any], name: str) -> None:
    """Equal but for the rounding of sums split in two (float32): at most 2.2e-5 here (Granite MoE Shared's
    scalings), where a bias added on both ranks or a head's rows on the wrong rank moves logits by tenths."""
    want = ranks["single"][name]
    assert want.shape == (PROMPT_LEN + 1, _configs()[name].get_text_config().vocab_size)
    torch.testing.assert_close({f"rank {r}": ranks["logits"][r][name] for r in range(SIZE)},  # names the rank
                               {f"rank {r}": want for r in range(SIZE)}, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_both_ranks_compute_the_same_bits(ranks: dict[str, Any], name: str) -> None:
    """After each sum every rank holds the same hidden states, and everything after it is whole on each."""
    assert torch.equal(ranks["logits"][0][name], ranks["logits"][1][name])


@pytest.mark.parametrize("name", FAMILIES)
def test_each_rank_holds_its_kv_heads_and_sums_once_per_block(ranks: dict[str, Any], name: str) -> None:
    """Its share of the KV heads (its cache's), and one sum per attention and one per MLP or mixture (the
    shared expert's share summed with the experts'), in each of the two forwards."""
    text = _configs()[name].get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    for r, facts in enumerate(ranks["facts"]):
        assert facts[name]["tp"] == [r, SIZE]
        # (Multi-head Latent Attention's one latent head is every rank's whole.)
        # (One KV head whole on each rank: Multi-head Latent Attention's latent, or one replicated over ranks.)
        assert facts[name]["num_kv_heads"] == (1 if name.startswith("deepseek") else max(1, kv_heads // SIZE))
        assert facts[name]["sums"] == 2 * 2 * facts[name]["layers"]


def _meta(config: Any, tp: TensorParallel | None) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(config, reference, tp)


_TWO = TensorParallel(1, SIZE, group=object())  # rank 1 of 2; these models are only built, never run


@pytest.mark.parametrize("name", sorted(family_configs()))
def test_every_parameter_is_whole_or_its_rule_s_share(name: str) -> None:
    """Built for rank 1 of 2, each family's parameters are the single model's shapes, or those cut by the
    parameter's rule: no parameter is cut that no rule puts back, none is whole where a rule cuts it."""
    config = language_model_config(copy.deepcopy(_configs()[name]))  # an image-text checkpoint's language model's
    try:
        sharded = _meta(config, _TWO)
    except UnsupportedConfig as e:
        assert "--tensor-parallel-size 2" in str(e)
        assert name.startswith(("olmo2", "olmo3", "olmoe", "flex-olmo", "minimax-m2"))
        return
    whole = dict(_meta(config, None).named_parameters())
    rules = shard_rules(config.num_attention_heads, sharded.total_kv_heads, sharded.head_size,
                        sharded.arch.qk_norm_per_head, sharded.arch.mla, SIZE)
    cut = 0
    for param_name, param in sharded.named_parameters():
        shard = shard_of(rules, param_name)
        full = tuple(param.shape) if shard is None else shard.full_shape(param.shape, SIZE)
        assert full == tuple(whole[param_name].shape), param_name
        cut += shard is not None and not shard.once
    assert cut >= 3 * len(sharded.model.layers)  # q/k/v, o and down at least, in every layer
    assert sharded.head_size == _meta(config, None).head_size


def _put_back(shard: Shard, shares: list[torch.Tensor], full: torch.Tensor) -> torch.Tensor:
    """The whole tensor from the ranks' shares: each stacked part's blocks, rank by rank, part by part."""
    if shard.once:
        return torch.stack(shares).sum(0)
    length = full.shape[shard.dim]
    widths = shard.parts if isinstance(shard.parts, tuple) else (length // shard.parts,) * shard.parts
    per_rank = [share.split([w // SIZE for w in widths], shard.dim) for share in shares]
    return torch.cat([torch.cat([parts[i] for parts in per_rank], shard.dim) for i in range(len(widths))], shard.dim)


HEADS, KV_HEADS, HEAD = 4, 2, 3
_EXAMPLES = {  # a parameter of each rule's, with its whole shape
    "model.layers.0.self_attn.qkv_proj.weight": (HEAD * (HEADS + 2 * KV_HEADS), 5),
    "model.layers.0.self_attn.qkv_proj.bias": (HEAD * (HEADS + 2 * KV_HEADS),),
    "model.layers.0.self_attn.o_proj.weight": (5, HEAD * HEADS),
    "model.layers.0.self_attn.o_proj.bias": (5,),
    "model.layers.0.self_attn.sinks": (HEADS,),
    "model.layers.0.self_attn.output_gate.weight": (HEAD * HEADS, 5),
    "model.layers.0.self_attn.q_norm.weight": (HEADS, HEAD),
    "model.layers.0.self_attn.k_norm.weight": (KV_HEADS, HEAD),
    "model.layers.0.mlp.gate_up_proj.weight": (8, 5),
    "model.layers.0.mlp.gate_up_proj.bias": (8,),
    "model.layers.0.mlp.up_proj.weight": (4, 5),
    "model.layers.0.mlp.down_proj.weight": (5, 4),
    "model.layers.0.mlp.down_proj.bias": (5,),
    "model.layers.0.mlp.shared_expert.gate_up_proj.weight": (8, 5),
    "model.layers.0.mlp.shared_expert.down_proj.weight": (5, 4),
    "model.layers.0.mlp.shared_expert.down_proj.bias": (5,),
    "model.layers.0.mlp.experts.gate_up_proj": (3, 8, 5),
    "model.layers.0.mlp.experts.gate_up_proj_bias": (3, 8),
    "model.layers.0.mlp.experts.down_proj": (3, 5, 4),
    "model.layers.0.mlp.experts.down_proj_bias": (3, 5),
}
_WHOLE = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
          "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.gate.e_score_correction_bias",
          "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.self_attn.query_layernorm.weight")


@pytest.mark.parametrize("name", sorted(_EXAMPLES))
def test_the_ranks_shares_put_back_together_are_the_whole_tensor(name: str) -> None:
    rules = shard_rules(HEADS, KV_HEADS, HEAD, per_head_norms=True)
    shard = shard_of(rules, name)
    assert shard is not None, name
    full = torch.arange(torch.Size(_EXAMPLES[name]).numel(), dtype=torch.float32).reshape(_EXAMPLES[name]) + 1
    shares = [shard.of(full, TensorParallel(r, SIZE, group=object())) for r in range(SIZE)]
    assert all(share.is_contiguous() for share in shares)
    if not shard.once:
        assert all(share.numel() * SIZE == full.numel() for share in shares)
        assert shard.full_shape(shares[0].shape, SIZE) == tuple(full.shape)
    else:  # a row-parallel bias: added once to the sum
        assert torch.equal(shares[0], full) and not shares[1].any()
    assert torch.equal(_put_back(shard, shares, full), full)


def test_a_rank_s_q_k_v_rows_are_its_heads_and_its_gate_up_rows_its_share_of_each() -> None:
    rules = shard_rules(HEADS, KV_HEADS, HEAD, per_head_norms=False)
    rank1 = TensorParallel(1, SIZE, group=object())
    qkv = torch.arange(HEAD * (HEADS + 2 * KV_HEADS))
    q, k, v = HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD
    got = shard_of(rules, "model.layers.2.self_attn.qkv_proj.bias").of(qkv, rank1)  # type: ignore[union-attr]
    # q heads 2 and 3, k head 1, v head 1
    assert got.tolist() == [*range(2 * HEAD, q), *range(q + HEAD, q + k), *range(q + k + HEAD, q + k + v)]
    gate_up = torch.arange(8)
    assert shard_of(rules, "model.layers.0.mlp.gate_up_proj.bias").of(gate_up, rank1).tolist() == [2, 3, 6, 7]  # type: ignore[union-attr]
    # Without per-head norms, q and k norms are a head's width: whole, as every other norm and the routers.
    for name in (*_WHOLE, "model.layers.0.self_attn.q_norm.weight"):
        assert shard_of(rules, name) is None, name


def _refused(name: str, **changes: Any) -> Any:
    config = copy.deepcopy(_configs()[name])
    for field, value in changes.items():
        setattr(config, field, value)
    return config


@pytest.mark.parametrize(("config", "field"), [
    (lambda: _refused("llama-bias", num_attention_heads=3, num_key_value_heads=3), "num_attention_heads=3"),
    (lambda: _refused("llama-bias", num_attention_heads=6, num_key_value_heads=3), "num_key_value_heads=3"),
    (lambda: _configs()["olmo2-post-norms"], "model_type='olmo2'"),
    (lambda: _configs()["olmoe-qk-norm"], "model_type='olmoe'"),
    (lambda: _refused("llama-bias", intermediate_size=129), "intermediate_size=129"),
    (lambda: _refused("falcon-new-arch-one-norm", ffn_hidden_size=129), "ffn_hidden_size=129"),
    (lambda: _refused("mixtral-moe-window", intermediate_size=129), "intermediate_size=129"),
    (lambda: _refused("qwen2-moe-shared-expert", moe_intermediate_size=33), "moe_intermediate_size=33"),
    (lambda: _refused("qwen2-moe-shared-expert", shared_expert_intermediate_size=33),
     "shared_expert_intermediate_size=33"),
    (lambda: _refused("granitemoeshared-shared-expert", shared_intermediate_size=49), "shared_intermediate_size=49"),
], ids=["heads", "kv-heads", "olmo2-full-width-qk-norm", "olmoe-full-width-qk-norm",
        "mlp-width", "falcon-mlp-width", "expert-width", "moe-expert-width", "shared-expert-width",
        "granite-shared-expert-width"])
def test_a_model_that_does_not_divide_among_the_ranks_is_refused_by_name(config: Callable[[], Any], field: str) -> None:
    built = config()
    _meta(built, None)  # one process serves it
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2") as refused:
        _meta(built, TensorParallel(0, SIZE, group=object()))
    assert f"unsupported model config: {field} " in str(refused.value)
    if field.startswith("num_k"):  # neither divides the other: no replication of whole heads either
        assert "or divide it (each KV head then replicated" in str(refused.value)


class _Ops(TorchDispatchMode):
    """The operations dispatched under it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama-bias", "qwen2-moe-shared-expert"])
def test_one_process_runs_the_same_operations_with_or_without_a_group_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A group of one rank is no group: the same modules, the same dispatched operations, the same bits,
    and no call to sum anything."""
    folder = build_checkpoint(_configs()[name], tmp_path / name)
    calls = []
    all_reduce = TensorParallel.all_reduce

    def counted(self: TensorParallel, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return all_reduce(self, x)

    monkeypatch.setattr(TensorParallel, "all_reduce", counted)
    prompt = prompt_token_ids(PROMPT_LEN)
    runs = []
    for tp in (None, TensorParallel(), SINGLE):
        model = _load(folder, tp)
        assert model.tp == SINGLE and model.num_kv_heads == _configs()[name].num_key_value_heads
        assert all(getattr(m, "tp", None) is None for m in model.model.modules())
        with _Ops() as ops:
            logits = _logits(model, prompt)
        runs.append((ops.ops, logits))
    assert len(runs[0][0]) > 100 and not calls
    for ops, logits in runs[1:]:
        assert ops == runs[0][0]
        assert torch.equal(logits, runs[0][1])
