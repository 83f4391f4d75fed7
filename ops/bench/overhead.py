"""``pdserve bench overhead``: the engine's own host time per step, with a null forward.

The model runner keeps its real input preparation but its forward is replaced by one that computes
nothing and returns rows of preallocated logits (random, fixed: Gaussian with ``--logit-std``, 3 by
default, which puts a few hundred tokens in a top-p 0.9 nucleus, as the default model's flatter
positions do). No weights are loaded and no KV cache is allocated. What a step then costs is the
engine's own work, split with a clock read around the calls inside one ``LLMEngine.step``
(instance wrappers set up here; the engine's code path is unchanged):

* schedule: ``Scheduler.schedule``
* prepare: ``ModelRunner.execute`` less the forward (block tables, slots, input tensors, logits rows)
* forward: the null forward
* sample: the sampler
* outputs: the rest of the step (progress, slot tracking, appending tokens, stop checks, outputs)

Cases, each at every ``--batch-sizes`` B with ``--prompt-len`` token prompts:

* greedy: B requests decoding, temperature 0; every measured step decodes one token for each.
* mixed: the same with sampling parameters cycling through ``MIXED`` (temperature, top-p, top-k,
  min-p, penalties; some rows seeded, some asking for logprobs).
* prefill: each measured step prefills B new prompts whole (B x prompt-len tokens) and samples their
  one token (greedy); adding the requests happens between steps and is not counted in the step: it
  is reported apart, per request ("admission": ``LLMEngine.add_request``, with its validation and
  block hashes).

Each case also counts the torch operations one more step dispatches (views, which launch no
kernel, left out), in all and in the sampler: beside a GPU each is a kernel launch the host pays
for, and unlike a time the count does not move with the host's load. And the minor page faults per
measured step: fresh pages the C heap took from the kernel for the step's temporaries (the engine
sets malloc's thresholds so that it reuses them, ``common.glibc_env``; ``--glibc-defaults`` leaves
glibc's own, to measure what that does).

``--clock wall`` (the default) reads ``time.perf_counter``; ``--clock cpu`` reads the thread's CPU time
(``time.thread_time``), which other processes on a shared host disturb far less. ``--baseline`` takes
the JSON of an earlier run (say, before a change, made in the same session) and prints its totals
beside the new ones.

Each case runs with the batched sampler (``common.engine.sampler``) and with ``_PerRowSampler``, a
copy of the per-row sampler it replaced, kept here for comparison only. "floor" is the sampler's
argmax (``argmax_rows``) over the step's ``[B, vocab]`` logits: about one pass over them on this
machine, what an all-greedy step's sampling cannot go below.

The host's share. On this machine the CPU is also the device, so the sample phase includes the
sampler's tensor work over ``[B, vocab]`` logits, which beside a GPU runs on the GPU while the host
waits only for the sampled ids. ``--host-vocab N`` (1,024 by default; 0 skips it) runs every case
once more with the batched sampler over ``N``-column logits (prompt ids drawn below ``N``): the same
calls, conditions and Python, with the per-entry work made small. That total is what a GPU would
wait on per step, to within the launch cost of the sampler's kernels (a seeded row's noise is
computed where its row is: on a GPU, on the GPU). That run takes the CPU's branches of the sampler;
a GPU takes others (``ops.bench.gpu_branches``): its Triton kernels for the penalties, for top-k /
top-p / min-p and for the draw, no block maxima, no chunks. So each case also runs over the same
few logits with the sampler on those branches, its kernels recorded instead of run (sampler
``gpu-path``): the host's share of a step on a GPU, but for what each kernel launch costs there
(counted: the step's torch operations and Triton launches).

On a GPU, ``--device cuda`` puts the engine's tensors, the fixed logits and the sampler there: a
step's wall time is then the host's own work plus its waits for the sampler's kernels and the
sampled ids' copy, measured rather than stood in for (``--host-vocab`` does not apply there).

    pdserve bench overhead --batch-sizes 1,16,64,256,512

Part two, ``pdserve bench overhead router ...``: the router's CPU per streamed token in front of fake
engines (``ops.bench.router_overhead``). ``pdserve bench overhead overlap ...``: step times with and
without async scheduling beside a simulated device (``ops.bench.overlap``). ``pdserve bench overhead
forward ...``: the operations and kernel launches of one forward of the model (``ops.bench.forward_ops``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from msgspec.structs import replace
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import common.engine.engine as engine_module
from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.model_runner import ModelRunner
from common.engine.request import Request
from common.engine.row_ops import argmax_rows
from common.engine.sampler import Sampler, SampleResult
from common.engine.seeded_draws import draw_keys, exponentials
from common.glibc_env import keep_malloc_defaults, malloc_thresholds_state
from common.model.arch import ModelArch
from common.model.loader import model_identity, resolve_model_path
from common.model.weights import load_hf_config
from common.protocol import PositionLogprobs, TokenLogprob
from common.sampling_params import SamplingParams
from ops.bench.gpu_branches import gpu_branches
from ops.bench.host_speed import cpu_ticks, describe, describe_steal, host_speed, steal_during
from pdserve_kernels import get_kernels, resolve_backend

PHASES = ("schedule", "prepare", "forward", "sample", "outputs")
CASES = ("greedy", "mixed", "prefill")
SAMPLERS = ("batched", "per-row")
# The targets: host ms per decode step (median) for (case, batch size).
TARGETS_MS = {("greedy", 64): 1.0, ("greedy", 256): 2.0, ("mixed", 256): 4.0}
RESULTS_DIR = Path(__file__).parent / "results"
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=50, seed=0),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, logprobs=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.1),
    SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=0),
    SamplingParams(temperature=1.0, top_p=0.9, logprobs=1, seed=0),
    SamplingParams(temperature=0.6, repetition_penalty=1.2, top_k=100, logprobs=3),
]


class _Sampled:
    """``SampledTokens``' interface over a result the per-row sampler already has on the host."""

    def __init__(self, result: SampleResult) -> None:
        self._result = result
        self.token_ids = torch.tensor(result.token_ids)

    def result(self) -> SampleResult:
        return self._result


class _PerRowSampler:
    """The sampler as it was before it was batched (one row at a time); for comparison only."""

    def __init__(self, eos_token_ids: set[int], seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def sample(self, logits: Tensor, requests: list[Request]) -> _Sampled:
        """The engine's interface: the result, done at once."""
        return _Sampled(self(logits, requests))

    def __call__(self, logits: Tensor, requests: list[Request]) -> SampleResult:
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()
        for row, req in enumerate(requests):
            self._apply_penalties(logits[row], req)
        token_ids: list[int] = []
        for row, req in enumerate(requests):
            if req.sampling_params.greedy:
                token_ids.append(int(torch.argmax(logits[row])))
                continue
            token_ids.append(self._sample_row(logits[row], req))
        logprobs: list[PositionLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for row, req in enumerate(requests):
                k = req.sampling_params.logprobs
                if k is None:
                    continue
                lp = raw_logprobs[row]
                top: list[TokenLogprob] = []
                if k > 0:
                    values, ids = torch.topk(lp, k)
                    top = [TokenLogprob(int(i), float(v)) for v, i in zip(values, ids, strict=True)]
                tok = token_ids[row]
                logprobs[row] = PositionLogprobs(tok, float(lp[tok]), top)
        return SampleResult(token_ids, logprobs)

    def _apply_penalties(self, logits: Tensor, req: Request) -> None:
        p = req.sampling_params
        if req.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            if banned:
                logits[banned] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
            ids, counts = torch.unique(torch.tensor(req.output_token_ids, dtype=torch.long), return_counts=True)
            logits[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty

    def _sample_row(self, logits: Tensor, req: Request) -> int:
        p = req.sampling_params
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            drop_sorted = (cum - sorted_probs) >= p.top_p
            probs = probs.clone()
            probs[order[drop_sorted]] = 0.0
        if p.min_p > 0.0:
            probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
        if req.draw_seed is not None:  # the draw contract of ``common.engine.seeded_draws``
            keys = draw_keys([req.draw_seed], [req.num_output_tokens])
            noise = exponentials(keys, torch.arange(probs.shape[-1]))
        else:
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
        return int(torch.argmax(probs / noise))


class PhaseClock:
    """Seconds spent in each wrapped call during the current step, and each call's last result."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.current: dict[str, float] = {}
        self.last: dict[str, Any] = {}

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.now()
            try:
                result = self.last[phase] = fn(*args, **kwargs)
                return result
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + self.now() - start

        return timed


class OpCounter(TorchDispatchMode):
    """Counts the torch operations dispatched while active, views apart, by ``phase``."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "other"
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
        return func(*args, **(kwargs or {}))

    def counting(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.phase = phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = "other"

        return counted


class NullModel:
    """Stands in for the model: no compute; the logits are the first rows of a fixed tensor (a view)."""

    def __init__(self, logits: Tensor, clock: PhaseClock) -> None:
        self.logits = logits
        self.forward = clock.wrap("forward", lambda input_ids: torch.empty((input_ids.shape[0], 1),
                                                                          device=input_ids.device))
        self.compute_logits = clock.wrap("forward", lambda hidden: self.logits[: hidden.shape[0]])

    def __call__(self, input_ids: Tensor, positions: Tensor, meta: Any, kv_cache: Tensor) -> Tensor:
        out: Tensor = self.forward(input_ids)
        return out


class NullModelRunner(ModelRunner):
    """A ``ModelRunner`` with its own ``execute`` but no weights and no KV cache; see ``NullModel``."""

    def __init__(self, config: EngineConfig, logits: Tensor, clock: PhaseClock) -> None:
        # Not ModelRunner.__init__: only what ``execute`` and the engine read.
        self.config = config
        self.device = config.torch_device
        self.dtype = torch.float32
        self.model_path = resolve_model_path(config.model)
        self.model_id = model_identity(self.model_path)
        self.hf_config = load_hf_config(self.model_path)
        self.max_model_len = config.max_model_len or int(getattr(self.hf_config, "max_position_embeddings", 8192))
        self.vocab_size = int(self.hf_config.vocab_size)
        self.block_size = config.block_size
        assert config.num_blocks is not None
        self.num_blocks = config.num_blocks
        # The sampler's backend, as an engine on this device resolves it (on a GPU the seeded rows' race
        # is then one Triton kernel); the runner's own kernels: copy_blocks only, and no case here forks.
        self.kernel_backend = resolve_backend(self.device, config.kernel_backend)
        self.kernels = get_kernels(self.device, "torch")
        self.kv_cache = torch.empty(0, device=self.device)
        self.model = NullModel(logits, clock)  # type: ignore[assignment]
        # The model's window, so the engine keeps its blocks as it would with the real forward.
        self.kv_window = ModelArch.from_config(self.hf_config).kv_window
        self.num_host_blocks = 0  # no host tier of the prefix cache
        self.init_input_batch()


def null_engine(args: argparse.Namespace, batch_size: int, max_tokens: int, logits: Tensor, clock: PhaseClock,
                device: str = "cpu", **config: Any) -> LLMEngine:
    """An engine on ``device`` (that of ``logits``) with ``NullModelRunner``, room for ``batch_size``
    requests of ``--prompt-len`` tokens and ``max_tokens`` more, twice over; ``config``: more
    ``EngineConfig`` fields."""
    block_size = 16
    blocks_per_request = -(-(args.prompt_len + max_tokens) // block_size)
    engine_config = EngineConfig(
        model=args.model, device=device, block_size=block_size, max_num_seqs=batch_size,
        max_num_batched_tokens=batch_size * args.prompt_len, num_blocks=2 * batch_size * blocks_per_request + 16,
        seed=args.seed, **config,
    )
    runner = NullModelRunner(engine_config, logits, clock)
    with mock.patch.object(engine_module, "ModelRunner", lambda _config: runner):
        return LLMEngine(engine_config)


def case_params(case: str, index: int, max_tokens: int) -> SamplingParams:
    """The ``index``-th request's parameters: greedy, or the ``MIXED`` ones in turn (a seeded one seeded
    with ``index``); EOS ignored."""
    params = MIXED[index % len(MIXED)] if case == "mixed" else SamplingParams(temperature=0.0)
    if params.seed is not None:
        params = replace(params, seed=index)
    return replace(params, max_tokens=max_tokens, ignore_eos=True)


def time_sampler(engine: LLMEngine, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any]:
    """Wrap, as phase "sample", the engine's sampling calls: ``sample`` and the ``result`` of what it returns
    (waiting for the ids and building the lists); returns the unwrapped ``sample``."""
    sample = engine.sampler.sample

    def sample_and_wrap(logits: Tensor, requests: list[Request]) -> Any:
        sampled = sample(logits, requests)
        sampled.result = wrap("sample", sampled.result)  # type: ignore[method-assign]
        return sampled

    engine.sampler.sample = wrap("sample", sample_and_wrap)  # type: ignore[method-assign]
    return sample


def _percentile(values: list[float], q: int) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * q // 100) - 1)]


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values) * 1e3, "p90": _percentile(values, 90) * 1e3}


def run_case(
    case: str, batch_size: int, sampler_kind: str, args: argparse.Namespace, logits: Tensor
) -> dict[str, Any]:
    """Build an engine with a null forward, bring it to the measured state, time ``--num-steps`` steps.
    ``sampler_kind``: ``SAMPLERS``, or ``gpu-path`` (the batched sampler on a GPU's branches, its
    Triton kernels recorded; ``ops.bench.gpu_branches``)."""
    with contextlib.ExitStack() as stack:
        launches = stack.enter_context(gpu_branches()) if sampler_kind == "gpu-path" else None
        return _run_case(case, batch_size, sampler_kind, args, logits, launches)


def _run_case(
    case: str, batch_size: int, sampler_kind: str, args: argparse.Namespace, logits: Tensor,
    launches: list[Any] | None,
) -> dict[str, Any]:
    prompt_len, num_steps, warmup = args.prompt_len, args.num_steps, args.warmup
    vocab = int(logits.shape[1])
    profile_steps = args.profile_steps if case != "prefill" else 0
    max_tokens = 1 if case == "prefill" else warmup + num_steps + 2 + profile_steps
    clock = PhaseClock(CLOCKS[args.clock])
    engine = null_engine(args, batch_size, max_tokens, logits, clock, device=args.device)
    runner = engine.runner
    if sampler_kind == "per-row":
        engine.sampler = _PerRowSampler(engine.eos_token_ids, args.seed)  # type: ignore[assignment]
    elif launches is not None:
        engine.sampler = Sampler(engine.eos_token_ids, args.seed, kernel_backend="triton")
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    runner.execute = clock.wrap("execute", runner.execute)  # type: ignore[method-assign]
    time_sampler(engine, clock.wrap)
    gen = torch.Generator().manual_seed(args.seed)
    num_added = 0

    def add_requests() -> float:
        """Add ``batch_size`` requests; the clock's seconds per ``add_request``."""
        nonlocal num_added
        prompts = torch.randint(3, vocab, (batch_size, prompt_len), generator=gen).tolist()
        added = [(f"{case}-{num_added + i}", prompt, case_params(case, num_added + i, max_tokens))
                 for i, prompt in enumerate(prompts)]
        num_added += batch_size
        start = clock.now()
        for request_id, prompt, params in added:
            engine.add_request(request_id, prompt, params)
        return (clock.now() - start) / batch_size

    if case != "prefill":
        add_requests()
        while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()
    num_tokens = batch_size * (prompt_len if case == "prefill" else 1)
    steps: list[dict[str, float]] = []
    admits: list[float] = []  # per request, the prefill case's (outside the step)
    faults = 0
    for i in range(warmup + num_steps):
        if case == "prefill":
            admits.append(add_requests())
        clock.current = {}
        faults_before = minor_faults()
        start = clock.now()
        outputs = engine.step()
        total = clock.now() - start
        if launches is not None:
            launches.clear()  # each holds its tensors
        if i >= warmup:
            faults += minor_faults() - faults_before
        t = clock.current
        if clock.last["schedule"].num_tokens != num_tokens or len(outputs) != batch_size:
            raise RuntimeError(f"{case}: a step ran {clock.last['schedule'].num_tokens} tokens and "
                               f"{len(outputs)} outputs, not {num_tokens} and {batch_size}")
        if i >= warmup:
            steps.append({
                "schedule": t["schedule"], "prepare": t["execute"] - t["forward"], "forward": t["forward"],
                "sample": t["sample"], "outputs": total - t["schedule"] - t["execute"] - t["sample"],
                "total": total,
            })
    # One more step, counted (every case has room for it: max_tokens allows one step more).
    if case == "prefill":
        add_requests()
    counter = OpCounter()
    untimed = time_sampler(engine, counter.counting)
    with counter:
        engine.step()
    kernels = {"triton_launches": len(launches)} if launches is not None else {}
    engine.sampler.sample = untimed  # type: ignore[method-assign]
    profile = profile_ops(engine, profile_steps) if profile_steps else None
    return {
        **({"profile": profile} if profile is not None else {}),
        "case": case, "batch_size": batch_size, "sampler": sampler_kind, "vocab": vocab, "num_steps": num_steps,
        "phases_ms": {name: _summary([s[name] for s in steps]) for name in (*PHASES, "total")},
        "torch_ops": {"step": sum(counter.counts.values()), "sample": counter.counts.get("sample", 0), **kernels},
        "minor_faults_per_step": faults / num_steps,
        **({"admit_us_per_request": statistics.median(admits[warmup:]) * 1e6} if admits else {}),
    }


# Operations a profile keeps, by host time.
PROFILE_TOP = 25


def profile_ops(engine: LLMEngine, num_steps: int) -> list[dict[str, Any]]:
    """``num_steps`` more decode steps under torch's profiler (and CUDA's activity, on a GPU): per
    operation and per step, its calls, its own host time (µs) and, on a GPU, its own device time; the
    ``PROFILE_TOP`` with the most host time. Where a step's host time goes, operation by operation: on
    a GPU most of it is launches (``cudaLaunchKernel`` is a row of its own)."""
    rows: list[dict[str, Any]] = []
    with profiling(engine.runner.device.type == "cuda", num_steps, rows):
        for _ in range(num_steps):
            engine.step()
    return rows


@contextlib.contextmanager
def profiling(cuda: bool, num_steps: int, rows: list[dict[str, Any]]) -> Iterator[None]:
    """Torch's profiler (and CUDA's activity, with ``cuda``: the device's queue drained at both ends)
    over ``num_steps`` steps run within; on exit, ``rows`` takes its operations per step, as
    ``profile_ops`` returns them."""
    from torch.profiler import ProfilerActivity, profile

    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    found = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))
        found.append({"name": event.key, "calls": event.count / num_steps,
                      "self_host_us": event.self_cpu_time_total / num_steps, "self_device_us": device_us / num_steps})
    found.sort(key=lambda r: -r["self_host_us"])
    rows += found[:PROFILE_TOP]


def minor_faults() -> int:
    """Minor page faults of this process so far (its torch threads touch a buffer's pages too): fresh
    pages the kernel handed out, each a trap and a zeroed page."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def floor_ms(logits: Tensor, batch_size: int, num_iters: int = 10, clock: str = "wall") -> float:
    """Median ms of the sampler's argmax over ``batch_size`` rows of the logits: about one pass over them."""
    rows = logits[:batch_size]
    now = CLOCKS[clock]
    times = []
    for _ in range(num_iters):
        start = now()
        argmax_rows(rows).tolist()
        times.append(now() - start)
    return statistics.median(times) * 1e3


def _find(
    results: list[dict[str, Any]], case: str, batch_size: int, sampler: str, host_share: bool = False
) -> dict[str, Any] | None:
    """The result of that case; with ``host_share``, of its ``--host-vocab`` run (older reports have none)."""
    for r in results:
        if (r["case"], r["batch_size"], r["sampler"], _is_host_share(r)) == (case, batch_size, sampler, host_share):
            return r
    return None


def _is_host_share(result: dict[str, Any]) -> bool:
    return bool(result.get("host_share", False))


def _without_sampling(result: dict[str, Any]) -> float:
    """Median ms of the step's own work besides sampling and the forward."""
    return float(sum(result["phases_ms"][p]["median"] for p in ("schedule", "prepare", "outputs")))


def format_report(report: dict[str, Any]) -> str:
    results: list[dict[str, Any]] = report["results"]
    header = (f"{'case':<8}{'batch':>6}  {'sampler':<8}{'vocab':>7}{'total (p90)':>17}"
              + "".join(f"{p:>10}" for p in PHASES) + f"{'no sample':>11}{'floor':>9}{'sample x':>10}"
              + f"{'torch ops':>11}{'(sample)':>9}{'faults':>9}")
    lines = [f"host ms per step, median (p90 of the total); null forward, {report['machine']['torch_threads']} "
             f"torch thread(s), {report['machine']['device']}", header, "-" * len(header)]
    for r in results:
        ph = r["phases_ms"]
        speedup = ""
        batched = _find(results, r["case"], r["batch_size"], "batched")
        if r["sampler"] == "per-row" and batched is not None and not _is_host_share(r):
            speedup = f"{ph['sample']['median'] / batched['phases_ms']['sample']['median']:.1f}x"
        total = f"{ph['total']['median']:.2f} ({ph['total']['p90']:.2f})"
        vocab = r.get("vocab", report.get("vocab_size", 0))
        lines.append(
            f"{r['case']:<8}{r['batch_size']:>6}  {r['sampler']:<8}{vocab:>7}{total:>17}"
            + "".join(f"{ph[p]['median']:>10.2f}" for p in PHASES)
            + f"{_without_sampling(r):>11.2f}{report['floor_ms'][str(r['batch_size'])]:>9.2f}{speedup:>10}"
            + (f"{r['torch_ops']['step']:>11}{r['torch_ops']['sample']:>9}" if "torch_ops" in r else "")
            + (f"{r['minor_faults_per_step']:>9.0f}" if "minor_faults_per_step" in r else "")
        )
    lines += ["", "no sample: schedule + prepare + outputs (what is left with a free sampler and forward); "
              "floor: the sampler's argmax over the step's [batch, vocab] logits; sample x: per-row sample time / batched; "
              "torch ops: dispatched in one step, views apart (on a GPU, kernel launches), and in its sampler; "
              "faults: minor page faults per step (fresh pages the C heap took from the kernel; malloc's "
              f"thresholds: {report['machine'].get('malloc_thresholds', 'not recorded')})"]
    lines += [f"admission, prefill batch {r['batch_size']} ({r['vocab']} vocab): add_request (validation, block "
              f"hashes, queueing; between steps, not in them) {r['admit_us_per_request']:.1f} us per request of "
              f"{report['config']['prompt_len']} tokens, median" for r in results if "admit_us_per_request" in r]
    for r in results:
        if "profile" in r:
            top = ", ".join(f"{op['name']} {op['calls']:g}x {op['self_host_us']:.0f}us" for op in r["profile"][:8])
            lines.append(f"profile, {r['case']} batch {r['batch_size']} ({r['sampler']}, {r['vocab']} vocab), host "
                         f"time per step by operation: {top}")
    if any(_is_host_share(r) for r in results):
        lines += ["rows at the small vocab: the host's share, the sampler's calls over few logits (what a GPU "
                  "would wait on); gpu-path: the same on the sampler's GPU branches, its Triton kernels recorded, "
                  "not run"]
    lines += [describe(speed) for speed in report.get("host_speed", [])]
    if report.get("host_steal"):
        lines.append(f"host, over the cases: {describe_steal(report['host_steal'])}")
    baseline: dict[str, Any] | None = report.get("baseline")
    if baseline is not None:
        lines += ["", f"against the baseline {baseline['path']} ({baseline['clock']} clock): median ms per step, "
                  "baseline -> this run", f"{'case':<8}{'batch':>6}  {'sampler':<8}{'total':>28}{'sample':>28}"
                  f"{'no sample':>28}"]
        lines += [f"  baseline's {describe(speed)}" for speed in baseline.get("host_speed") or []]
        for r in results:
            b = _find(baseline["results"], r["case"], r["batch_size"], r["sampler"], _is_host_share(r))
            if b is None:
                continue
            cells = [(b["phases_ms"][p]["median"], r["phases_ms"][p]["median"]) for p in ("total", "sample")]
            cells.append((_without_sampling(b), _without_sampling(r)))
            share = " (host share)" if _is_host_share(r) else ""
            lines.append(f"{r['case']:<8}{r['batch_size']:>6}  {r['sampler']:<8}{share}" + "".join(
                f"{f'{old:.2f} -> {new:.2f} ({old / new:.1f}x)':>28}" for old, new in cells))
    for (case, batch_size), target in TARGETS_MS.items():
        new = _find(results, case, batch_size, "batched")
        if new is None:
            lines.append(f"target {case}, batch {batch_size}: <= {target:g} ms: not measured in this run")
            continue
        got = new["phases_ms"]["total"]["median"]
        old = _find(results, case, batch_size, "per-row")
        host = _find(results, case, batch_size, "batched", host_share=True)
        gpu = _find(results, case, batch_size, "gpu-path", host_share=True)
        lines.append(
            f"target {case}, batch {batch_size}: <= {target:g} ms: measured {got:.2f} ms "
            + ("(met)" if got <= target else "(NOT met)")
            + ("" if old is None else f"; per-row sampler {old['phases_ms']['total']['median']:.2f} ms")
            + f"; without sampling {_without_sampling(new):.2f} ms"
            + ("" if host is None else _host_note(host, target))
            + ("" if gpu is None else _gpu_path_note(gpu, target))
            + _baseline_note(baseline, case, batch_size)
        )
    return "\n".join(lines)


def _host_note(host: dict[str, Any], target: float) -> str:
    got = host["phases_ms"]["total"]["median"]
    return (f"; host's share (sampler over {host['vocab']} logits) {got:.2f} ms "
            + ("(met)" if got <= target else "(NOT met)"))


def _gpu_path_note(gpu: dict[str, Any], target: float) -> str:
    got = gpu["phases_ms"]["total"]["median"]
    ops = gpu["torch_ops"]
    return (f"; on the GPU path's branches {got:.2f} ms " + ("(met)" if got <= target else "(NOT met)")
            + f" with each of its {ops['step'] + ops['triton_launches']} launches a step still to pay "
            f"({ops['step']} torch operations, {ops['triton_launches']} Triton kernels)")


def _baseline_note(baseline: dict[str, Any] | None, case: str, batch_size: int) -> str:
    b = None if baseline is None else _find(baseline["results"], case, batch_size, "batched")
    if b is None:
        return ""
    return f"; baseline {b['phases_ms']['total']['median']:.2f} ms, without sampling {_without_sampling(b):.2f} ms"


def write_plot(report: dict[str, Any], path: Path) -> bool:
    """Median host ms per step against the batch size, one panel per case; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = list(dict.fromkeys(r["case"] for r in report["results"]))
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):
        for sampler, style in (("batched", "-o"), ("per-row", "--s")):
            rows = [r for r in report["results"]
                    if r["case"] == case and r["sampler"] == sampler and not _is_host_share(r)]
            if rows:
                ax.plot([r["batch_size"] for r in rows], [r["phases_ms"]["total"]["median"] for r in rows],
                        style, label=f"total, {sampler} sampler")
                ax.plot([r["batch_size"] for r in rows], [r["phases_ms"]["sample"]["median"] for r in rows],
                        style, alpha=0.4, label=f"sample, {sampler} sampler")
                if sampler == "batched":
                    ax.plot([r["batch_size"] for r in rows], [_without_sampling(r) for r in rows], ":^",
                            label="schedule + prepare + outputs")
                    found = [_find(report.get("baseline", {}).get("results", []), case, r["batch_size"], sampler)
                             for r in rows]
                    base = [b for b in found if b is not None]
                    if base and len(base) == len(rows):
                        ax.plot([r["batch_size"] for r in rows], [b["phases_ms"]["total"]["median"] for b in base],
                                "-x", color="gray", label="total, baseline")
                        ax.plot([r["batch_size"] for r in rows], [_without_sampling(b) for b in base], ":x",
                                color="gray", label="schedule + prepare + outputs, baseline")
        shares = [r for r in report["results"] if r["case"] == case and _is_host_share(r)]
        if shares:
            ax.plot([r["batch_size"] for r in shares], [r["phases_ms"]["total"]["median"] for r in shares], "-D",
                    label=f"total, host's share (vocab {shares[0]['vocab']})")
        for (target_case, batch_size), target in TARGETS_MS.items():
            if target_case == case:
                ax.plot([batch_size], [target], "r*", markersize=12, label=f"target, batch {batch_size}")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="host ms per step (median)", title=case)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def add_case_args(p: argparse.ArgumentParser, batch_sizes: str, cases: tuple[str, ...], num_steps: int) -> None:
    """The flags every null-forward bench shares (this one and ``ops.bench.overlap``)."""
    p.add_argument("--model", default=None, help="checkpoint folder (its config only); default SmolLM2-135M-Instruct")
    p.add_argument("--batch-sizes", default=batch_sizes, help="comma-separated")
    p.add_argument("--cases", default=",".join(cases), help=f"comma-separated, of {','.join(cases)}")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--num-steps", type=int, default=num_steps, help="measured steps per case")
    p.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(p, "1,16,64,256,512", CASES, 20)
    p.add_argument("--samplers", default=",".join(SAMPLERS), help=f"comma-separated, of {','.join(SAMPLERS)}")
    p.add_argument("--logit-std", type=float, default=3.0, help="standard deviation of the fixed random logits")
    p.add_argument("--host-vocab", type=int, default=1024,
                   help="also run each case with the batched sampler over this many logits per row: the "
                        "host's share of sampling (0: skip)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: time.perf_counter; cpu: this thread's CPU time (steadier on a shared host)")
    p.add_argument("--baseline", default=None, metavar="PATH",
                   help="JSON of an earlier run whose totals are printed beside this run's")
    p.add_argument("--glibc-defaults", action="store_true",
                   help="leave malloc's thresholds at glibc's own (the engine sets them otherwise; "
                        "common.glibc_env): to measure what they do")
    p.add_argument("--profile-steps", type=int, default=0, metavar="K",
                   help="after the measured steps of each decode case, K more under torch's profiler: its "
                        "operations by host time (and device time on a GPU), in the JSON and printed")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda[:N]: the engine, its logits and the sampler on that GPU")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="default: ops/bench/results/overhead-<device type>-<date>[-<card>].json")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG next to the JSON")
    return p


def _parse_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [s for s in text.split(",") if s]
    if not items or not set(items) <= set(allowed):
        raise SystemExit(f"{flag} takes a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return items


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "router":  # part two: the router's cost per streamed token
        from ops.bench import router_overhead

        return router_overhead.main(argv[1:])
    if argv and argv[0] == "forward":  # what one forward of the model launches, counted
        from ops.bench import forward_ops

        return forward_ops.main(argv[1:])
    if argv and argv[0] == "overlap":  # what async scheduling hides, beside a simulated device
        from ops.bench import overlap

        return overlap.main(argv[1:])
    args = build_parser().parse_args(argv)
    cases = _parse_list(args.cases, CASES, "--cases")
    samplers = _parse_list(args.samplers, SAMPLERS, "--samplers")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if not batch_sizes or min(batch_sizes) < 1 or args.prompt_len < 1 or args.num_steps < 1 or args.warmup < 0:
        raise SystemExit("batch sizes, --prompt-len and --num-steps must be positive, --warmup not negative")
    if args.host_vocab and args.host_vocab < 128:
        raise SystemExit("--host-vocab is 0 (skip) or at least 128 (top-k 100 needs that many logits)")
    if args.glibc_defaults and not keep_malloc_defaults():
        raise SystemExit("--glibc-defaults: this process has already set malloc's thresholds")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise SystemExit(f"--device {args.device}: cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {args.device}: cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: no CUDA device is available")
        args.host_vocab = 0  # the sampler's kernels run on the GPU: the step's time is the host's share
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        vocab_size = int(load_hf_config(resolve_model_path(args.model)).vocab_size)
        gen = torch.Generator().manual_seed(args.seed)
        logits = (torch.randn(max(batch_sizes), vocab_size, generator=gen) * args.logit_std).to(device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        card = f" ({name}, CUDA {torch.version.cuda})" if name else ""
        report: dict[str, Any] = {
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["pdserve bench overhead", *(argv if argv is not None else sys.argv[1:])]),
            "config": vars(args),
            "machine": {"device": f"{device}{card}", "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                        "torch": torch.__version__},
            "vocab_size": vocab_size,
            "phases": list(PHASES),
            "targets_ms": [{"case": c, "batch_size": b, "max_ms": t} for (c, b), t in TARGETS_MS.items()],
            "floor_ms": {str(b): floor_ms(logits, b, clock=args.clock) for b in batch_sizes},
            "host_speed": [host_speed()],  # before the cases, and after them
            "results": [],
        }
        if args.baseline:
            base = json.loads(Path(args.baseline).read_text())
            report["baseline"] = {"path": args.baseline, "command": base["command"],
                                  "clock": base["config"].get("clock", "wall"), "floor_ms": base["floor_ms"],
                                  "host_speed": base.get("host_speed"), "results": base["results"]}
        host_ticks = [(time.monotonic(), cpu_ticks())]
        for case in cases:
            for batch_size in batch_sizes:
                for sampler in samplers:
                    print(f"{case}, batch {batch_size}, {sampler} sampler ...", file=sys.stderr, flush=True)
                    report["results"].append(run_case(case, batch_size, sampler, args, logits))
                if args.host_vocab and args.host_vocab < vocab_size:
                    print(f"{case}, batch {batch_size}, host's share ...", file=sys.stderr, flush=True)
                    few = logits[:, : args.host_vocab].contiguous()
                    share = run_case(case, batch_size, "batched", args, few)
                    report["results"].append({**share, "host_share": True})
                    print(f"{case}, batch {batch_size}, host's share, GPU path ...", file=sys.stderr, flush=True)
                    share = run_case(case, batch_size, "gpu-path", args, few)
                    report["results"].append({**share, "host_share": True})
        host_ticks.append((time.monotonic(), cpu_ticks()))
        report["host_steal"] = steal_during(host_ticks, host_ticks[0][0], host_ticks[-1][0])
        report["host_speed"].append(host_speed())
        report["machine"]["malloc_thresholds"] = malloc_thresholds_state()
    finally:
        torch.set_num_threads(threads)
    print(format_report(report))
    slug = "".join(f"-{word}" for word in re.findall(r"[A-Za-z0-9]+", name))  # the card, on a GPU
    path = Path(args.json) if args.json else RESULTS_DIR / f"overhead-{device.type}-{report['date']}{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plot and write_plot(report, path.with_suffix(".png")):
        report["plot"] = str(path.with_suffix(".png").name)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
