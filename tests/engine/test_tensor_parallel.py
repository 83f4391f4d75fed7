"""A tensor-parallel engine (``--tensor-parallel-size``): rank 0 in this process, its workers real processes
over gloo, each step's inputs sent over ZeroMQ. Greedy output equals transformers; a prefill engine of
two ranks hands its blocks (every rank's heads) to a decode engine of two; the ranks end together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.tensor_parallel import shared_cache, sweep_stale_workdirs
from common.model.arch import UnsupportedConfig
from common.sampling_params import SamplingParams
from kvtransfer.blocks.layout import KVLayout
from tests.engine.test_disaggregated_lifecycle import _drain, _prefill
from tests.engine.test_kv_offloading import cached_kv
from tests.engine.tiny_models import TINY_DIMS, build_checkpoint, family_configs, hf_greedy, prompt_token_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
FAMILIES = ["llama-bias", "qwen2-moe-shared-expert", "gemma2-window-softcap", "phi-parallel-partial-rope-layernorm"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    configs = family_configs()
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = build_checkpoint(configs[name], tmp_path_factory.mktemp(name))
        return built[name]

    return build


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        engine.close()


def _engine(engines: list[LLMEngine], folder: Path, **overrides: object) -> LLMEngine:
    config = {"model": str(folder), "device": "cpu", "dtype": "float32", "block_size": 8, "num_blocks": 64,
              "tensor_parallel_size": 2, **overrides}
    engine = LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]
    engines.append(engine)
    return engine


def _children() -> set[int]:
    """This process's child processes (Linux)."""
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return {int(pid) for pid in path.read_text().split()}


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_over_two_ranks_equals_transformers(checkpoint, engines, name: str) -> None:  # type: ignore[no-untyped-def]
    """Chunked prefill (12 tokens a step over three prompts), a prefix shared between two of them (its
    blocks cached once), and decode: every request's tokens equal transformers'."""
    folder = checkpoint(name)
    long = prompt_token_ids(37)
    prompts = [long, long[:29] + prompt_token_ids(5, seed=4), prompt_token_ids(11, seed=2)]
    engine = _engine(engines, folder, max_num_batched_tokens=12)
    assert engine.runner.tp.size == 2 and engine.runner.tp_leader is not None
    # Each rank holds half the KV heads: the transfer cache counts both ranks' layers.
    assert engine.runner.kv_cache.shape[4] == TINY_DIMS["num_key_value_heads"] // 2
    assert engine.runner.transfer_cache is not None
    assert engine.runner.transfer_cache.shape[0] == 2 * TINY_DIMS["num_hidden_layers"]
    outs = engine.generate(prompts, GREEDY)
    assert [o[0] for o in outs] == [hf_greedy(folder, p, GREEDY.max_tokens) for p in prompts]
    assert engine.stats().prefix_cache_hits > 0  # the shared prefix was read from cached blocks


def test_one_kv_head_replicated_on_both_ranks_equals_transformers(checkpoint, engines) -> None:  # type: ignore[no-untyped-def]
    """Multi-query attention (Falcon's: one KV head) over two ranks: each holds half the query heads and the KV
    head whole (as vLLM replicates KV heads fewer than the ranks)."""
    folder = checkpoint("falcon-multi-query-parallel")
    prompts = [prompt_token_ids(23), prompt_token_ids(10, seed=4)]
    engine = _engine(engines, folder, max_num_batched_tokens=12)
    assert engine.runner.kv_cache.shape[4] == 1 and engine.runner.model.total_kv_heads == 1
    assert [o[0] for o in engine.generate(prompts, GREEDY)] == [hf_greedy(folder, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("method", ["gptq", "gptq-desc-act", "fp8"])
def test_packed_weights_over_two_ranks_equal_transformers(checkpoint, engines, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                          method: str) -> None:
    """A GPTQ checkpoint (4 bits, groups of 16) or an FP8 one (blocks of 16 x 16) on the Triton kernels over two
    ranks: each rank keeps its share of every projection packed (q/k/v and gate/up by their outputs, o and down by
    their inputs: words and groups, or blocks, alike), and the tokens are transformers' on the dequantized model.
    With ``desc_act``'s groups out of order, o and down are widened (the ranks would split their groups) and
    q/k/v and gate/up keep each input's group."""
    from common.model.packed_linear import Fp8Linear, IntLinear
    from tests.engine.test_lora import fp8_dequantized
    from tests.engine.tiny_models import fp8_checkpoint, gptq_checkpoint

    folder, reference = tmp_path / method, tmp_path / "dequantized"
    if method == "fp8":
        reference = fp8_dequantized(fp8_checkpoint(checkpoint("llama-bias"), folder), reference)
    else:
        gptq_checkpoint(checkpoint("llama-bias"), folder, reference, bits=4, desc_act=method == "gptq-desc-act")
    prompts = [prompt_token_ids(23), prompt_token_ids(10, seed=4)]
    engine = _engine(engines, folder, max_num_batched_tokens=12, kernel_backend="triton")
    packed = {n: m for n, m in engine.runner.model.named_modules() if isinstance(m, (IntLinear, Fp8Linear))}
    assert len(packed) == (2 if method == "gptq-desc-act" else 4) * TINY_DIMS["num_hidden_layers"]
    down = packed.get("model.layers.0.mlp.down_proj")
    if isinstance(down, IntLinear):
        assert down.in_features == TINY_DIMS["intermediate_size"] // 2 and down.scales.shape[1] * 16 == down.in_features
    elif isinstance(down, Fp8Linear):
        assert down.weight.shape == (TINY_DIMS["hidden_size"], TINY_DIMS["intermediate_size"] // 2)
        assert down.weight_scale_inv.shape == (TINY_DIMS["hidden_size"] // 16, TINY_DIMS["intermediate_size"] // 32)
    assert all(getattr(m, "g_idx", None) is not None for m in packed.values()) == (method == "gptq-desc-act")
    assert [o[0] for o in engine.generate(prompts, GREEDY)] == [hf_greedy(reference, p, GREEDY.max_tokens)
                                                               for p in prompts]


@pytest.mark.parametrize("method", ["gptq", "fp8", "mxfp4"])
def test_packed_experts_over_two_ranks_equal_transformers(checkpoint, engines, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                          method: str) -> None:
    """A mixture's experts quantized one by one (GPTQ 4 bits in groups of 16, or FP8 in blocks of 16 x 16), or
    gpt-oss's in MXFP4 (groups of 32), on the Triton kernels over two ranks: each rank keeps its share of every expert
    packed (gate/up by their outputs, down by its inputs), and the tokens are transformers' on the dequantized
    model."""
    from transformers import Mxfp4Config

    from common.model.llama import Experts
    from tests.engine.test_lora import fp8_dequantized
    from tests.engine.tiny_models import experts_one_by_one, fp8_checkpoint, gptq_checkpoint, mxfp4_checkpoint

    prompts = [prompt_token_ids(23), prompt_token_ids(10, seed=4)]
    if method == "mxfp4":  # gpt-oss's experts 128 wide: 64 on each rank, two groups of their inputs
        folder = mxfp4_checkpoint(checkpoint("gpt-oss-moe-sinks-window"), tmp_path / method)
        engine = _engine(engines, folder, max_num_batched_tokens=12, kernel_backend="triton")
        experts = [m for m in engine.runner.model.modules() if isinstance(m, Experts)]
        assert len(experts) == TINY_DIMS["num_hidden_layers"] and all(e.mxfp4 == {"gate_up_proj", "down_proj"}
                                                                       for e in experts)
        assert all(e.down_proj_blocks.shape[2] == 32 and e.down_proj_scales.shape[2] == 2 for e in experts)
        dequantize = {"quantization_config": Mxfp4Config(dequantize=True)}
        assert [o[0] for o in engine.generate(prompts, GREEDY)] == [
            hf_greedy(folder, p, GREEDY.max_tokens, **dequantize) for p in prompts]
        return
    source = experts_one_by_one(checkpoint("qwen3-moe-dense-layer"), tmp_path / "one-by-one")
    folder, reference = tmp_path / method, tmp_path / "dequantized"
    if method == "fp8":
        reference = fp8_dequantized(fp8_checkpoint(source, folder), reference)
    else:
        gptq_checkpoint(source, folder, reference, bits=4, desc_act=False)
    engine = _engine(engines, folder, max_num_batched_tokens=12, kernel_backend="triton")
    experts = [m for m in engine.runner.model.modules() if isinstance(m, Experts)]
    assert len(experts) == 2
    for e in experts:  # each expert's 32 of the intermediate width: 16 on each rank
        if method == "fp8":
            assert e.fp8 == {"gate_up_proj", "down_proj"} and e.down_proj.shape[2] == 16
            assert e.down_proj_scale_inv.shape[2] == 1 and e.gate_up_proj_scale_inv.shape[1] == 2
        else:
            assert e.bits == {"gate_up_proj": 4, "down_proj": 4} and e.down_proj_qweight.shape[2] == 16 * 4 // 32
            assert e.down_proj_scales.shape[2] == 1 and e.gate_up_proj_qweight.shape[1] == 2 * 16
    assert [o[0] for o in engine.generate(prompts, GREEDY)] == [hf_greedy(reference, p, GREEDY.max_tokens)
                                                               for p in prompts]


@pytest.mark.parametrize("name", ["deepseek-v2-lite-mla-moe-greedy", "deepseek-v3-mla-moe-yarn"])
def test_multi_head_latent_attention_over_two_ranks_equals_transformers(checkpoint, engines, name: str) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek's heads split over two ranks, the latent head whole on each: greedy equals transformers, with
    chunked prefill."""
    folder = checkpoint(name)
    prompts = [prompt_token_ids(27), prompt_token_ids(9, seed=3)]
    engine = _engine(engines, folder, max_num_batched_tokens=12)
    assert engine.runner.kv_cache.shape[4] == 1  # the latent, whole on each rank
    assert [o[0] for o in engine.generate(prompts, GREEDY)] == [hf_greedy(folder, p, GREEDY.max_tokens) for p in prompts]


def test_a_classifier_over_two_ranks_scores_as_transformers(checkpoint, engines) -> None:  # type: ignore[no-untyped-def]
    """A causal LM made a classifier by ``hf_overrides`` (given to the workers with the rest of the config):
    rank 0's score head, whole, gives the two tokens' logit difference of transformers' causal LM."""
    from transformers import AutoModelForCausalLM

    from tests.engine.tiny_models import build_tokenizer

    folder = checkpoint("llama-bias")
    build_tokenizer(folder)
    overrides = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["w10", "w11"],
                 "method": "from_2_way_softmax"}
    engine = _engine(engines, folder, hf_overrides=overrides, max_num_batched_tokens=8)
    prompt = prompt_token_ids(19)
    engine.add_request("c", prompt, SamplingParams(max_tokens=1, temperature=0.0), pooling="classify")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].embedding is not None
    with torch.inference_mode():
        logits = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()(
            torch.tensor([prompt])).logits[0, -1]
    np.testing.assert_allclose(np.frombuffer(outputs[-1].embedding, dtype="<f4"), [float(logits[11] - logits[10])],
                               rtol=1e-4, atol=1e-5)


def test_preemption_async_scheduling_and_drafts_over_two_ranks_equal_transformers(checkpoint, engines) -> None:  # type: ignore[no-untyped-def]
    """Too few blocks for all four at once (recompute after preemption), the next step scheduled while one
    runs (input ids from the step in flight, broadcast to the workers), and n-gram drafts verified."""
    folder = checkpoint("llama-bias")
    prompts = [prompt_token_ids(21, seed=s) for s in range(4)]
    expected = [hf_greedy(folder, p, 20) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tight = _engine(engines, folder, num_blocks=12, async_scheduling=True)
    assert [o[0] for o in tight.generate(prompts, params)] == expected
    assert tight.stats().num_preemptions > 0
    repeating = [p[:8] * 3 for p in prompts]
    drafting = _engine(engines, folder, speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                           '"prompt_lookup_max": 3, "prompt_lookup_min": 1}')
    assert [o[0] for o in drafting.generate(repeating, params)] == [hf_greedy(folder, p, 20) for p in repeating]
    assert drafting.spec_num_accepted_tokens > 0


def _run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[object]]:
    """Every output of each request, in order (tokens, logprobs, prompt logprobs), by request id."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    seen: dict[str, list[object]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(
                (out.new_token_ids, out.logprobs, out.prompt_logprobs, out.finish_reason))
    return seen


def test_seeded_choices_logprobs_and_prompt_logprobs_over_two_ranks_equal_one_rank_s(checkpoint, engines) -> None:  # type: ignore[no-untyped-def]
    """n = 2 seeded (the choices fork from a shared partial block: a copy-on-write copy on every rank), with
    top logprobs and prompt logprobs: the same as the engine of one rank, value for value."""
    folder = checkpoint("gemma2-window-softcap")
    prompts = [prompt_token_ids(19, seed=5), prompt_token_ids(26, seed=6)]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=2, max_tokens=10, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    split = _run_all(_engine(engines, folder), prompts, params)
    whole = _run_all(_engine(engines, folder, tensor_parallel_size=1), prompts, params)
    assert split.keys() == whole.keys() and len(split) == 4  # two choices each
    for rid, outs in whole.items():
        for (tokens, logprobs, prompt_lps, reason), (s_tokens, s_logprobs, s_prompt_lps, s_reason) in zip(
                outs, split[rid], strict=True):
            assert s_tokens == tokens and s_reason == reason
            for got, want in ((s_logprobs, logprobs), (s_prompt_lps, prompt_lps)):
                assert (got is None) == (want is None)
                if got is not None:  # the sums' order differs between one rank and two: float32 rounding
                    assert repr(got).count("(") == repr(want).count("(")
                    for g, w in zip(_numbers(got), _numbers(want), strict=True):
                        assert abs(g - w) <= 1e-4 * max(1.0, abs(w))


def _numbers(value: object) -> list[float]:
    """Every number inside nested logprob records, in order."""
    import msgspec

    out: list[float] = []

    def walk(v: object) -> None:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return
        if isinstance(v, (int, float)):
            out.append(float(v))
        elif isinstance(v, dict):
            for item in v.items():
                walk(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        else:
            walk(msgspec.to_builtins(v))

    walk(value)
    return out


def test_a_prefill_of_two_ranks_hands_every_rank_s_heads_to_a_decode_of_two(checkpoint, engines) -> None:  # type: ignore[no-untyped-def]
    """Blocks moved as the KV transfer moves them, through each engine's transfer cache (both ranks' layers):
    the decode's tokens after the prefill's first equal transformers'; the layouts name their ranks."""
    folder = checkpoint("qwen2-moe-shared-expert")
    prompt = prompt_token_ids(30)
    prefill, decode = _engine(engines, folder, max_num_batched_tokens=16), _engine(engines, folder)
    out = _prefill(prefill, prompt, GREEDY)
    assert out.kv_handoff is not None
    handoff = decode.add_remote_request("r", list(prompt), out.new_token_ids[0], GREEDY)
    assert handoff is not None
    src, dst = torch.tensor(out.kv_handoff.block_ids), torch.tensor(handoff.block_ids)
    assert prefill.runner.transfer_cache is not None and decode.runner.transfer_cache is not None
    moved = prefill.runner.kernels.gather_blocks(prefill.runner.transfer_cache, src)
    decode.runner.kernels.scatter_blocks(decode.runner.transfer_cache, dst, moved)
    assert prefill.release_kv("r")
    decode.remote_kv_arrived("r")
    assert [out.new_token_ids[0], *_drain(decode)["r"]] == hf_greedy(folder, prompt, GREEDY.max_tokens)
    two = KVLayout.from_kv_cache(decode.runner.transfer_cache, decode.model_id, 2)
    one = KVLayout.from_kv_cache(torch.zeros(3, 2, 4, 8, 2, 16), decode.model_id)
    assert "tensor_parallel_size: 2 != 1" in (two.mismatch(one) or "")


def test_zeroed_blocks_are_zeroed_on_every_rank(checkpoint, engines) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(engines, checkpoint("llama-bias"))
    cache = engine.runner.transfer_cache
    assert cache is not None
    cache.fill_(1.0)
    engine.runner.zero_blocks([3, 5])
    # Rank 1's share is zeroed by rank 1, on its own time.
    _wait_until(lambda: bool((cache[:, :, [3, 5]] == 0).all()), "every rank's blocks 3 and 5 zeroed")
    assert bool((cache[:, :, 4] == 1).all())


def test_a_model_the_ranks_cannot_share_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    folder = build_checkpoint(LlamaConfig(**{**TINY_DIMS, "hidden_size": 48, "num_attention_heads": 3,
                                             "num_key_value_heads": 3}),
                              tmp_path / "three-heads")
    before = _children()
    with pytest.raises(UnsupportedConfig, match="num_attention_heads=3.*--tensor-parallel-size 2"):
        LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", num_blocks=8, tensor_parallel_size=2))
    assert _children() == before
    with pytest.raises(ValueError, match="--enable-lora with --tensor-parallel-size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be in"):
        EngineConfig(tensor_parallel_size=0)


_ENGINE_SCRIPT = textwrap.dedent("""
    import sys, time
    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32", block_size=8, num_blocks=64,
                                    tensor_parallel_size=2))
    print(" ".join(str(p.pid) for p in engine.runner.tp_leader.workers), flush=True)
    print(engine.runner.tp_leader.workdir, flush=True)
    while True:  # steps run on every rank until something ends
        engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        time.sleep(0.01)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("killed", ["worker", "rank 0"])
def test_the_ranks_end_together(checkpoint, killed: str) -> None:  # type: ignore[no-untyped-def]
    """A worker killed mid-run ends its engine's process (exit 70, its other ranks with it: whoever sent it
    requests continues them elsewhere); rank 0 killed ends its workers (they would wait for it forever)."""
    proc = subprocess.Popen([sys.executable, "-c", _ENGINE_SCRIPT, str(checkpoint("llama-bias"))],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert proc.stdout is not None
        workers = [int(pid) for pid in proc.stdout.readline().split()]
        workdir = Path(proc.stdout.readline().strip())
        assert len(workers) == 1 and _alive(workers[0]) and workdir.is_dir()
        if killed == "worker":
            os.kill(workers[0], signal.SIGKILL)
            assert proc.wait(60) == 70
            assert not workdir.exists()  # its sockets' folder removed as it ended
        else:
            proc.kill()
            proc.wait(60)
            assert workdir.exists()
            sweep_stale_workdirs(workdir.parent)  # as the next tensor-parallel engine starting here does
            assert not workdir.exists()
        _wait_until(lambda: not _alive(workers[0]), "the worker to end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_checkpoint_is_read_a_layer_at_a_time(checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Each part the loader renames, stacks (and, on a rank, cuts to its share) holds one layer's tensors, or
    only tensors of no layer: a rank never holds the whole checkpoint beside its share."""
    import re

    import common.model.weights as weights
    from common.model.weights import load_hf_config, load_model
    from pdserve_kernels import reference

    parts: list[set[str]] = []
    prepare = weights._prepare

    def recorded(state, *args):  # type: ignore[no-untyped-def]
        parts.append({m[1] if (m := re.search(r"\.layers\.(\d+)\.", name)) else "none" for name in state})
        prepare(state, *args)

    monkeypatch.setattr(weights, "_prepare", recorded)
    folder = checkpoint("qwen2-moe-shared-expert")
    load_model(folder, load_hf_config(folder), reference, torch.float32, torch.device("cpu"))
    assert sorted(parts, key=sorted) == sorted(({"none"}, *({str(i)} for i in range(TINY_DIMS["num_hidden_layers"]))),
                                               key=sorted)


def test_a_shared_cache_larger_than_its_folder_s_free_room_is_refused_by_name(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Not a SIGBUS at the first write past a full tmpfs, long after start: a clear error at start."""
    import shutil

    cache = shared_cache(tmp_path / "fits", (2, 3, 4), torch.float32)
    cache[1] = 7.0
    assert bool((shared_cache(tmp_path / "fits", (2, 3, 4), torch.float32)[1] == 7.0).all())  # one memory
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 95 << 20))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="needs 128 MiB in .* which has 95 MiB free: lower --kv-cache-memory"):
        shared_cache(tmp_path / "too-big", (32, 1 << 20), torch.float32)
    assert not (tmp_path / "too-big").exists()


def _service(role: str, folder: Path, redis_url: str) -> object:
    import argparse

    from common.service import add_service_args

    parser = argparse.ArgumentParser()
    add_service_args(parser, role)
    args = parser.parse_args(["--model", str(folder), "--device", "cpu", "--dtype", "float32", "--block-size", "8",
                              "--num-blocks", "64", "--tensor-parallel-size", "2", "--redis-url", redis_url])
    if role == "decode":
        from decode_svc.service import DecodeService

        return DecodeService(args)
    from prefill_svc.service import PrefillService

    return PrefillService(args)


def test_an_engine_whose_ranks_cannot_move_kv_serves_as_a_decode_of_whole_requests_only(  # type: ignore[no-untyped-def]
        checkpoint, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no transfer can read the ranks' caches (GPUs: each rank's heads on its own device; here made so),
    a decode instance starts without a KV receiver and publishes ``NO_KV_TRANSFER`` (routers then send it
    whole requests: ``tests/router/test_kv_layout_pairing.py``); a prefill instance is refused by name."""
    from common.engine.model_runner import ModelRunner
    from common.registry import NO_KV_TRANSFER

    allocate = ModelRunner._allocate_cache

    def without_transfer(self, cache_path):  # type: ignore[no-untyped-def]
        return allocate(self, cache_path)[0], None

    monkeypatch.setattr(ModelRunner, "_allocate_cache", without_transfer)
    folder = checkpoint("llama-bias")
    decode = _service("decode", folder, redis_url)
    try:
        assert decode.receiver is None and decode.kv_address == ""  # type: ignore[attr-defined]
        assert decode.info().kv_layout == NO_KV_TRANSFER  # type: ignore[attr-defined]
        assert not decode.poll_transfers() and not decode.busy()  # type: ignore[attr-defined]
        decode.on_abort("never-seen")  # type: ignore[attr-defined]
    finally:
        decode.close()  # type: ignore[attr-defined]
        decode.engine.close()  # type: ignore[attr-defined]
        decode.ctx.destroy(linger=0)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"KV transfer from a tensor-parallel engine on cpu \(--tensor-parallel-size "
                                         r"2\) is not implemented.*pdserve up --prefill 0"):
        _service("prefill", folder, redis_url)


def test_the_host_tier_saves_and_loads_every_rank_s_share(checkpoint, engines) -> None:  # type: ignore[no-untyped-def]
    """``--kv-offloading-size`` over two ranks: each keeps its share of a block in its own host memory, told the
    copies by rank 0 in order. A prompt whose blocks the cache took back loads both ranks' shares back, bit-equal
    to what they computed, and answers as transformers does."""
    from common.engine.request import Request

    folder = checkpoint("llama-bias")
    engine = _engine(engines, folder, num_blocks=12, kv_offloading_size=0.01)
    assert engine.kv.host is not None
    prompt = prompt_token_ids(40)
    hashes = Request("probe", prompt, GREEDY, block_size=8, model_id=engine.model_id).block_hashes[:4]
    engine.add_request("a", prompt, GREEDY)
    first = _drain(engine)["a"]
    computed = cached_kv(engine, prompt, 4)
    for k in range(4):
        engine.add_request(f"o{k}", prompt_token_ids(40, seed=10 + k), GREEDY)
        _drain(engine)
    assert all(engine.kv.pool.get_cached_block(h) is None and h in engine.kv.host for h in hashes)
    engine.add_request("a2", prompt, GREEDY)
    again = _drain(engine)["a2"]
    assert engine.kv.host.num_loaded >= len(hashes)
    assert torch.equal(cached_kv(engine, prompt, 4), computed), "a rank's share did not come back as it was computed"
    assert again == first == hf_greedy(folder, prompt, GREEDY.max_tokens)


def test_a_decode_of_two_ranks_saves_what_a_transfer_takes_on_every_rank_before_it_writes(  # type: ignore[no-untyped-def]
        checkpoint, engines) -> None:
    """A decode of two ranks with a host tier: a prefill's request takes every block of the pool, each cached. Rank 1
    saves its share of them too before ``add_remote_request`` returns (the ranks meet after the copies), so the
    hand-over, which writes both ranks' shares at once, does not land in the host tier: the prompt run again finds
    its own KV there, on both ranks, and answers as transformers does."""
    from common.engine.request import Request

    folder = checkpoint("llama-bias")
    mine, theirs = prompt_token_ids(40), prompt_token_ids(40, seed=5)
    decode = _engine(engines, folder, num_blocks=7, kv_offloading_size=0.01)
    prefill = _engine(engines, folder)
    hashes = Request("probe", mine, GREEDY, block_size=8, model_id=decode.model_id).block_hashes
    cache = decode.runner.transfer_cache
    assert cache is not None and prefill.runner.transfer_cache is not None
    decode.add_request("mine", mine, GREEDY)
    first = _drain(decode)["mine"]
    computed = cached_kv(decode, mine)
    out = _prefill(prefill, theirs, GREEDY)
    handoff = decode.add_remote_request("r", list(theirs), out.new_token_ids[0], GREEDY)
    assert handoff is not None and handoff.num_cached_blocks == 0
    assert sum(decode.kv.pool.get_cached_block(h) is None for h in hashes) >= 2, "the transfer took none of them"
    src, dst = torch.tensor(out.kv_handoff.block_ids), torch.tensor(handoff.block_ids)
    decode.runner.kernels.scatter_blocks(cache, dst, prefill.runner.kernels.gather_blocks(prefill.runner.transfer_cache, src))
    assert prefill.release_kv("r")
    decode.remote_kv_arrived("r")
    _drain(decode)
    decode.add_request("mine2", mine, GREEDY)
    again = _drain(decode)["mine2"]
    assert torch.equal(cached_kv(decode, mine), computed), "a rank's host tier kept the transfer's KV"
    assert again == first == hf_greedy(folder, mine, GREEDY.max_tokens)
