"""``pdserve bench offline``: the engine's output tokens/s and model FLOP utilisation on one offline
workload, beside ``transformers`` static batching, ``transformers``' own continuous batching and the bare
decode forward.

Workload: ``--num-requests`` prompts of uniformly 20..500 random token ids (special ids left out), each
asking for uniformly 8..256 new tokens, EOS ignored, greedy, fixed ``--seed``. Everything runs in this
process, one system after the other, with the same torch thread count.

* engine: ``LLMEngine`` with every request queued at once, stepped until all finish. Also reports the
  peak KV slot use (tokens held / slots allocated at the peak), which measures block fragmentation.
* static: ``transformers`` ``generate``, batches of 16 in arrival order, left padding, each batch
  generating as many tokens as its longest request asks for; only each request's own max_tokens count.
* continuous: ``transformers``' ``ContinuousBatchingManager`` (paged KV cache), every request with its
  own max_new_tokens, the same token budget and batch size limit as the engine.
* ceiling: the engine's model alone, one decode forward (logits included) of B sequences at a typical
  context length; tokens/s = B / step time. No scheduling, no sampling, no Python bookkeeping.
* MFU: the model FLOPs of the workload (``ops.bench.model_flops.workload_flops``: 2 x the matmul weights
  per token, QK^T and PV over each token's actual context, the LM head per sampled token) per second
  of the engine's run, over the GEMM peak measured in this process at the same thread count (the best
  of a few ``torch.matmul`` of a (2048, hidden) by a (hidden, intermediate) matrix in the engine's dtype).

The transformers baselines run on every request by default, so the ratios compare the same work;
they are slow on a CPU, and ``--baseline-requests N`` runs them on the first N requests only (the
table then says so and adds the engine's figure on that subset).

    python -m ops.bench.offline --num-requests 64 --json offline.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from common.config import EngineConfig, parse_size
from common.engine.engine import LLMEngine
from common.engine.scheduler import SchedulerOutput
from common.model.llama import AttentionMetadata
from common.sampling_params import SamplingParams
from ops.bench.model_flops import ModelShape, decode_token_flops, measure_gemm_peak, workload_flops

TARGET_VS_CONTINUOUS = 3.0
TARGET_KV_SLOT_USE = 0.96
STATIC_BATCH_SIZE = 16
GEMM_ROWS = 2048  # tokens in the peak-measuring matmul: as many as a large prefill step


@dataclass(frozen=True)
class OfflineRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def build_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    special_ids: set[int],
    prompt_lens: tuple[int, int] = (20, 500),
    output_lens: tuple[int, int] = (8, 256),
) -> list[OfflineRequest]:
    """Random prompts and lengths, the same for a given seed on every machine."""
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab_size) if t not in special_ids]
    return [
        OfflineRequest(
            prompt_token_ids=[rng.choice(ordinary) for _ in range(rng.randint(*prompt_lens))],
            max_tokens=rng.randint(*output_lens),
        )
        for _ in range(num_requests)
    ]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_engine(engine: LLMEngine, workload: list[OfflineRequest]) -> dict[str, Any]:
    """Queue every request at once and step until all finish; tokens/s and what each step looked like.

    Starts from an idle engine with an empty prefix cache and fresh peak counters.
    """
    if not engine.kv.reset_prefix_cache():
        raise RuntimeError("the engine is not idle")
    engine.peak_kv_tokens_held = engine.peak_kv_slots_allocated = 0
    preemptions_before = engine.scheduler.num_preemptions
    steps: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        steps.append(out)
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    counts: dict[str, int] = {}
    start = time.perf_counter()
    for i, req in enumerate(workload):
        engine.add_request(f"bench-{i}", req.prompt_token_ids, _greedy(req.max_tokens))
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    duration = time.perf_counter() - start
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]

    expected = {f"bench-{i}": r.max_tokens for i, r in enumerate(workload)}
    if counts != expected:
        raise RuntimeError("the engine did not produce exactly max_tokens for every request")
    busy = [s for s in steps if not s.is_empty]
    decode_steps = [s for s in busy if all(x.num_new_tokens == 1 for x in s.scheduled)]
    output_tokens = sum(expected.values())
    held, slots = engine.peak_kv_tokens_held, engine.peak_kv_slots_allocated
    return {
        "num_requests": len(workload),
        "output_tokens": output_tokens,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
        "duration_s": duration,
        "tokens_per_s": output_tokens / duration,
        "num_steps": len(busy),
        "mean_batch": statistics.fmean(len(s.scheduled) for s in busy),
        "mean_decode_batch": statistics.fmean(len(s.scheduled) for s in decode_steps) if decode_steps else None,
        "num_decode_only_steps": len(decode_steps),
        "num_preemptions": engine.scheduler.num_preemptions - preemptions_before,
        "num_blocks": engine.kv.pool.num_blocks,
        "peak_kv_tokens_held": held,
        "peak_kv_slots_allocated": slots,
        "kv_slot_use": held / slots if slots else None,
    }


@torch.inference_mode()
def run_ceiling(engine: LLMEngine, batch_size: int, context_len: int, num_steps: int = 8,
                num_warmup: int = 2) -> dict[str, Any]:
    """Decode tokens/s of the engine's model alone: ``batch_size`` sequences, one new token each."""
    runner, bs = engine.runner, engine.block_size
    blocks_per_seq = math.ceil((context_len + num_warmup + num_steps) / bs)
    batch_size = max(1, min(batch_size, runner.num_blocks // blocks_per_seq))
    dev = runner.device
    tables = torch.arange(batch_size * blocks_per_seq, dtype=torch.int32, device=dev).view(batch_size, -1)
    gen = torch.Generator().manual_seed(0)
    times = []
    for step in range(num_warmup + num_steps):
        pos = context_len - 1 + step
        slots = tables[:, pos // bs].long() * bs + pos % bs
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=dev),
            context_lens=torch.full((batch_size,), pos + 1, dtype=torch.int32, device=dev),
            max_query_len=1,
        )
        input_ids = torch.randint(100, runner.vocab_size, (batch_size,), generator=gen).to(dev)
        positions = torch.full((batch_size,), pos, dtype=torch.long, device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        logits = runner.model.compute_logits(runner.model(input_ids, positions, meta, runner.kv_cache))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if step >= num_warmup:
            times.append(time.perf_counter() - t0)
        del logits
    step_s = statistics.median(times)
    return {"batch_size": batch_size, "context_len": context_len, "step_ms": step_s * 1000,
            "tokens_per_s": batch_size / step_s}


def measure_mfu(shape: ModelShape, workload: list[OfflineRequest], engine_report: dict[str, Any],
                ceiling: dict[str, Any] | None, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The engine's model FLOP/s on ``workload`` (and the bare forward's) over the GEMM peak measured now.

    Call it in the process and at the torch thread count the engine ran with, so the peak is the same
    hardware budget the engine had.
    """
    peak = measure_gemm_peak(GEMM_ROWS, shape.hidden_size, shape.intermediate_size, device, dtype)
    model_flops = workload_flops(shape, ((len(r.prompt_token_ids), r.max_tokens) for r in workload))
    engine_flops_per_s = model_flops / engine_report["duration_s"]
    out: dict[str, Any] = {
        "model_flops": model_flops,
        "engine_flops_per_s": engine_flops_per_s,
        "gemm_peak": peak,
        "engine_mfu": engine_flops_per_s / peak["flops_per_s"],
    }
    if ceiling is not None:
        step_flops = ceiling["batch_size"] * decode_token_flops(shape, ceiling["context_len"])
        out["ceiling_flops_per_s"] = step_flops / (ceiling["step_ms"] / 1000)
        out["ceiling_mfu"] = out["ceiling_flops_per_s"] / peak["flops_per_s"]
    return out


def _load_hf_model(model_path: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@torch.inference_mode()
def run_hf_static(model_path: str, workload: list[OfflineRequest], device: torch.device, dtype: torch.dtype,
                  batch_size: int = STATIC_BATCH_SIZE) -> dict[str, Any]:
    """``generate`` on left-padded batches in arrival order; only each request's max_tokens count."""
    model = _load_hf_model(model_path, device, dtype)
    pad_id = 0

    def generate(batch: list[OfflineRequest]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        num_new = max(r.max_tokens for r in batch)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=num_new,
                             do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        if out.shape[1] != width + num_new:
            raise RuntimeError("transformers stopped early: EOS was not ignored")

    generate([OfflineRequest(workload[0].prompt_token_ids[:8], 2)])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        generate(workload[i:i + batch_size])
    duration = time.perf_counter() - start
    useful = sum(r.max_tokens for r in workload)
    return {"num_requests": len(workload), "batch_size": batch_size, "output_tokens": useful,
            "duration_s": duration, "tokens_per_s": useful / duration}


def run_hf_continuous(model_path: str, workload: list[OfflineRequest], device: torch.device, dtype: torch.dtype,
                      max_num_seqs: int, max_num_batched_tokens: int, timeout_s: float) -> dict[str, Any]:
    """``transformers``' continuous batching (paged attention); ``{"error": why}`` if it cannot run."""
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as exc:
        return {"error": f"this transformers has no continuous batching ({exc})"}
    model = _load_hf_model(model_path, device, dtype)
    if not hasattr(model, "init_continuous_batching"):
        return {"error": "this transformers has no continuous batching"}
    page = 256  # tokens per page, transformers' default
    # Enough pages for every request at once, so the baseline never has to evict.
    num_pages = sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / page) for r in workload) + 4
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=max(r.max_tokens for r in workload))
    cb_config = ContinuousBatchingConfig(
        page_size=page, num_blocks=num_pages, max_batch_tokens=max_num_batched_tokens,
        max_requests_per_batch=max_num_seqs, use_cuda_graph=device.type == "cuda",
    )
    results: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
        manager.start()
    except Exception as exc:  # noqa: BLE001 - any failure is the baseline's answer
        return {"error": f"continuous batching did not start: {type(exc).__name__}: {exc}"}
    timed_out = False
    try:
        for i, r in enumerate(workload):
            manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
        while len(results) < len(workload):
            if time.perf_counter() - start > timeout_s:
                timed_out = True
                break
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    break
                continue
            if out.is_finished():
                results[out.request_id] = out
        duration = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30, hard_stop=timed_out)
        manager.destroy()
    if timed_out:
        return {"error": f"did not finish {len(workload)} requests in {timeout_s:.0f} s "
                         f"({len(results)} done)"}
    errors = [o.error for o in results.values() if o.error]
    if len(results) < len(workload) or errors:
        return {"error": f"{len(workload) - len(results)} requests lost, errors: {errors[:2]}"}
    produced = {rid: len(o.generated_tokens) for rid, o in results.items()}
    useful = sum(min(produced[f"r{i}"], r.max_tokens) for i, r in enumerate(workload))
    if useful < sum(r.max_tokens for r in workload):
        return {"error": "continuous batching stopped requests before their max_tokens"}
    return {"num_requests": len(workload), "output_tokens": useful, "duration_s": duration,
            "tokens_per_s": useful / duration, "page_size": page, "num_pages": num_pages}


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or "tokens_per_s" not in a or "tokens_per_s" not in b:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def format_table(report: dict[str, Any]) -> str:
    eng: dict[str, Any] = report["engine"]
    static, cont, ceil = report.get("static"), report.get("continuous"), report.get("ceiling")
    subset = report.get("baseline_requests")

    def rate(r: dict[str, Any] | None) -> str:
        if r is None:
            return "skipped"
        if "error" in r:
            return "n/a"
        return f"{r['tokens_per_s']:.1f}"

    def gflops(flops_per_s: float) -> str:
        return f"{flops_per_s / 1e9:.1f} GFLOP/s"

    def ratio(x: float | None, target: float | None = None) -> str:
        if x is None:
            return "-"
        return f"{x:.2f}x" + ("" if target is None else (f"  (target >= {target:g}x: " + ("met" if x >= target else "NOT met") + ")"))

    n = eng["num_requests"]
    rows: list[tuple[str, str, str]] = [
        ("pdserve engine", rate(eng), f"{n} requests, {eng['output_tokens']} output tokens in {eng['duration_s']:.1f} s, "
         f"{eng['num_steps']} steps, mean batch {eng['mean_batch']:.1f}, {eng['num_preemptions']} preemptions"),
    ]
    if "engine_subset" in report:
        es = report["engine_subset"]
        rows.append(("pdserve engine, baseline subset", rate(es), f"the first {es['num_requests']} requests only"))
    sub = f"first {subset} of {n} requests" if subset and subset < n else f"all {n} requests"
    for name, r, note in (
        ("transformers static batching", static, f"batches of {STATIC_BATCH_SIZE}, left padding; {sub}"),
        ("transformers continuous batching", cont, f"generation manager, paged KV; {sub}"),
    ):
        rows.append((name, rate(r), r["error"] if r and "error" in r else note))
    if ceil is not None:
        rows.append(("bare decode forward (ceiling)", rate(ceil), f"batch {ceil['batch_size']}, context {ceil['context_len']}, "
                     f"{ceil['step_ms']:.1f} ms/step, no scheduling or sampling"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'system':<{width}}  {'output tok/s':>12}  notes", "-" * (width + 16 + 40)]
    lines += [f"{name:<{width}}  {value:>12}  {note}" for name, value, note in rows]
    slot_use = eng.get("kv_slot_use")
    lines += [
        "",
        f"engine / static batching      {ratio(_ratio(eng, static))}",
        f"engine / continuous batching  {ratio(_ratio(eng, cont), TARGET_VS_CONTINUOUS)}",
        f"engine / ceiling              {ratio(_ratio(eng, ceil))}",
        "peak KV slot use              "
        + ("-" if slot_use is None else f"{slot_use:.1%} ({eng['peak_kv_tokens_held']} tokens in "
           f"{eng['peak_kv_slots_allocated']} slots)  (target >= {TARGET_KV_SLOT_USE:.0%}: "
           + ("met" if slot_use >= TARGET_KV_SLOT_USE else "NOT met") + ")"),
    ]
    mfu = report.get("mfu")
    if mfu is not None:
        peak = mfu["gemm_peak"]
        m, k, n = peak["shape"]
        lines.append(
            f"engine MFU                    {mfu['engine_mfu']:.1%}  ({gflops(mfu['engine_flops_per_s'])} of model "
            f"FLOPs / GEMM peak {gflops(peak['flops_per_s'])}: {m}x{k} @ {k}x{n} {peak['dtype']}, "
            f"{peak['threads']} threads)"
        )
        if "ceiling_mfu" in mfu:
            lines.append(f"bare decode forward MFU       {mfu['ceiling_mfu']:.1%}  ({gflops(mfu['ceiling_flops_per_s'])})")
    if "engine_subset" in report and (static or cont):
        lines.append(
            f"same subset: engine / static {ratio(_ratio(report['engine_subset'], static))}, "
            f"engine / continuous {ratio(_ratio(report['engine_subset'], cont))}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench offline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf; default SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    defaults = EngineConfig()
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=parse_size, default=parse_size("1G"), help="KV cache on the CPU")
    p.add_argument("--num-blocks", type=int, default=None, help="fixed number of KV blocks (overrides the size)")
    p.add_argument("--skip-baselines", action="store_true", help="only the engine and the ceiling")
    p.add_argument("--baseline-requests", type=int, default=0,
                   help="run the transformers baselines on the first N requests only, for a quicker run (0: all)")
    p.add_argument("--baseline-timeout", type=float, default=600.0, help="seconds before a baseline gives up")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.num_requests < 1:
        print("error: --num-requests must be at least 1", file=sys.stderr)
        return 2
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks,
    )
    engine = LLMEngine(config)
    from transformers import AutoTokenizer

    model_path = str(engine.runner.model_path)
    special = set(AutoTokenizer.from_pretrained(model_path).all_special_ids)
    workload = build_workload(args.num_requests, args.seed, engine.vocab_size, special)
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": {"device": str(engine.runner.device), "dtype": str(engine.runner.dtype),
                    "torch_threads": torch.get_num_threads(), "platform": platform.platform()},
        "workload": {"num_requests": len(workload), "prompt_lens": "uniform 20..500",
                     "max_tokens": "uniform 8..256", "seed": args.seed},
    }
    engine.generate([workload[0].prompt_token_ids[:32]], _greedy(4))  # warm-up, not counted
    print(f"engine: {len(workload)} requests ...", file=sys.stderr, flush=True)
    report["engine"] = eng = run_engine(engine, workload)

    typical_context = round(statistics.fmean(len(r.prompt_token_ids) + r.max_tokens / 2 for r in workload))
    batch = round(eng["mean_decode_batch"] or args.max_num_seqs)
    print(f"ceiling: batch {batch}, context {typical_context} ...", file=sys.stderr, flush=True)
    report["ceiling"] = run_ceiling(engine, batch, typical_context)  # writes over cached blocks: run_engine resets
    print("GEMM peak ...", file=sys.stderr, flush=True)
    report["mfu"] = measure_mfu(ModelShape.from_config(engine.runner.hf_config), workload, eng, report["ceiling"],
                                engine.runner.device, engine.runner.dtype)

    subset_n = len(workload) if args.baseline_requests <= 0 else min(args.baseline_requests, len(workload))
    report["baseline_requests"] = subset_n
    if not args.skip_baselines:
        subset = workload[:subset_n]
        if subset_n < len(workload):
            print(f"engine on the first {subset_n} requests ...", file=sys.stderr, flush=True)
            report["engine_subset"] = run_engine(engine, subset)
        device, dtype = engine.runner.device, engine.runner.dtype
        del engine
        print(f"transformers static batching: {subset_n} requests ...", file=sys.stderr, flush=True)
        report["static"] = run_hf_static(model_path, subset, device, dtype)
        print(f"transformers continuous batching: {subset_n} requests ...", file=sys.stderr, flush=True)
        report["continuous"] = run_hf_continuous(
            model_path, subset, device, dtype, args.max_num_seqs, args.max_num_batched_tokens, args.baseline_timeout
        )
    report["ratios"] = {
        "engine_vs_static": _ratio(report["engine"], report.get("static")),
        "engine_vs_continuous": _ratio(report["engine"], report.get("continuous")),
        "engine_vs_ceiling": _ratio(report["engine"], report["ceiling"]),
        "engine_mfu": report["mfu"]["engine_mfu"],
        "targets": {"vs_continuous": TARGET_VS_CONTINUOUS, "kv_slot_use": TARGET_KV_SLOT_USE},
    }
    print(format_table(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
