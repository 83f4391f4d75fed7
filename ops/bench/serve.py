"""``pdserve bench serve``: an online serving benchmark against OpenAI-compatible URLs.

It streams a workload (``random``, ``shared-prefix``, ``long-prompt-interference``) to one or
more targets and prints throughput, TTFT, ITL, end-to-end latency (p50/p90/p99) and goodput
under an SLO, then the ratios between targets. Targets: ``--url URL`` (a running server),
stacks it launches itself (``pd``: 1 prefill + 1 decode; ``pd-nocache``: the same with prefix
caching off; ``pd-cap256``: the same with at most 256 prompt tokens per request per step; ``pd-offload``: the same with
a host tier of the prefix cache, ``--kv-offloading-size 1``;
``single``: one decode instance doing its own prefill) and ``hf`` (the same requests through
``transformers`` ``generate`` in this process, output tokens/s only).

    pdserve bench serve --targets pd,pd-nocache --workload shared-prefix --num-prompts 32 \\
        --concurrency 4 --json results.json
    pdserve bench serve --url http://127.0.0.1:8000 --workload random --concurrency 1,4,16

For ``shared-prefix`` it reads the engines' prefix-cache counters before and after each run and
reports the share of prefix tokens served from the cache. For ``random`` it also measures the
engine's bare batched decode forward at the batch size the decode instance ran (the ceiling)
and compares the served output tokens/s with it and with ``transformers``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from ops.bench import serve_report as report
from ops.bench.serve_metrics import SLO
from ops.bench.serve_runner import run_hf, run_served
from ops.bench.serve_targets import IN_PROCESS, STACKS
from ops.bench.serve_workloads import (
    WORKLOADS,
    PromptBuilder,
    Workload,
    long_prompt_interference_workload,
    random_workload,
    shared_prefix_workload,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description="Online serving benchmark of OpenAI URLs.")
    t = p.add_argument_group("targets")
    t.add_argument("--url", action="append", default=[], help="an existing OpenAI-compatible server (repeatable)")
    t.add_argument("--launch", action="append", default=[], choices=sorted(STACKS), help="launch a stack (repeatable)")
    t.add_argument("--targets", default="", help=f"comma list of {','.join([*STACKS, *IN_PROCESS])}")
    t.add_argument("--redis-url", default=None, help="registry of a --url stack, to read its engines' metrics")
    t.add_argument("--engine-args", default="--kv-cache-memory 2G", help="flags for launched engines")
    t.add_argument(
        "--threads", type=int, default=1,
        help="torch threads of each launched service and of the in-process baselines (0: torch's default)",
    )
    t.add_argument("--model", default=None, help="model of launched stacks, the tokenizer and the baselines")
    t.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    t.add_argument("--served-model-name", default=None, help="'model' field sent (default: the first of /v1/models)")
    t.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    t.add_argument("--api-key", default=None)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="random", choices=WORKLOADS)
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--random-input-len", type=int, default=256)
    w.add_argument("--random-output-len", type=int, default=128)
    w.add_argument("--random-range-ratio", type=float, default=0.5)
    w.add_argument("--prefix-len", type=int, default=2000, help="shared-prefix: tokens of the common prefix")
    w.add_argument("--question-len", type=int, default=32, help="shared-prefix: tokens of each question")
    w.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: distinct prefixes, taken in turn (more than a KV cache holds: see pd-offload)")
    w.add_argument("--long-prompt-len", type=int, default=2000)
    w.add_argument("--long-output-len", type=int, default=16)
    w.add_argument("--num-long-prompts", type=int, default=8)
    w.add_argument("--long-prompt-rate", type=float, default=0.5, help="long prompts per second")
    w.add_argument("--urgent-fraction", type=float, default=0.0,
                   help="this share of the requests (evenly spread) are of kind 'urgent', reported apart")
    w.add_argument("--urgent-priority", type=int, default=-1,
                   help="the 'priority' urgent requests carry (a server with --scheduling-policy priority "
                        "serves lower first; 0: none sent, for a first-come-first-served baseline)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    a = p.add_argument_group("arrival and report")
    a.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: at once)")
    a.add_argument("--concurrency", default=None, help="closed loop: requests in flight, or a list like 1,4,16")
    a.add_argument("--warmup", type=int, default=2, help="short requests sent (not measured) before each target")
    a.add_argument("--request-timeout", type=float, default=600.0)
    a.add_argument("--slo-ttft-ms", type=float, default=None)
    a.add_argument("--slo-itl-ms", type=float, default=None, help="bound on each request's mean inter-token latency")
    a.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch (default: each concurrency)")
    a.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="skip the bare-forward ceiling")
    a.add_argument("--json", default=None, help="write the report here")
    a.add_argument("--plots", default=None, help="PNG path prefix (default: the --json path without .json)")
    return p


def parse_targets(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """``[(name, url or None)]`` in the order given, launched and in-process names checked."""
    targets: list[tuple[str, str | None]] = []
    for i, url in enumerate(args.url):
        targets.append(("url" if len(args.url) == 1 else f"url{i + 1}", url))
    names = [*args.launch, *(n.strip() for n in args.targets.split(",") if n.strip())]
    for name in names:
        if name not in STACKS and name not in IN_PROCESS:
            raise SystemExit(f"unknown target {name!r}; choose from {', '.join([*STACKS, *IN_PROCESS])}")
        if all(name != t for t, _ in targets):
            targets.append((name, None))
    if not targets:
        raise SystemExit("nothing to benchmark: give --url, --launch or --targets")
    return targets


def parse_levels(text: str | None) -> list[int | None]:
    if not text:
        return [None]
    levels: list[int | None] = [int(x) for x in text.split(",") if x.strip()]
    if any(c is None or c < 1 for c in levels):
        raise SystemExit("--concurrency values must be at least 1")
    return levels


def build_workload(args: argparse.Namespace, builder: PromptBuilder) -> Workload:
    ratio = args.random_range_ratio
    if args.workload == "shared-prefix":
        return shared_prefix_workload(
            builder, args.num_prompts, args.prefix_len, args.question_len, args.random_output_len, ratio,
            args.num_prefixes,
        )
    if args.workload == "long-prompt-interference":
        return long_prompt_interference_workload(
            builder, args.num_prompts, args.random_input_len, args.random_output_len, ratio,
            args.long_prompt_len, args.long_output_len, args.num_long_prompts, args.long_prompt_rate,
        )
    return random_workload(builder, args.num_prompts, args.random_input_len, args.random_output_len, ratio)


def mark_urgent(workload: Workload, fraction: float) -> None:
    """Make ``fraction`` of the main requests, evenly spread, of kind ``urgent`` (in place)."""
    if not 0.0 <= fraction <= 1.0:
        raise SystemExit("--urgent-fraction must be in [0, 1]")
    num = round(len(workload.requests) * fraction)
    if num:
        step = len(workload.requests) / num
        for i in (int(k * step) for k in range(num)):
            workload.requests[i] = dataclasses.replace(workload.requests[i], kind="urgent")


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so launched stacks are stopped on the way out
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    targets = parse_targets(args)
    levels = parse_levels(args.concurrency)
    slo = SLO(args.slo_ttft_ms, args.slo_itl_ms)
    from transformers import AutoTokenizer

    from common.model.loader import resolve_model_path

    model = str(resolve_model_path(args.model))
    builder = PromptBuilder(AutoTokenizer.from_pretrained(args.tokenizer or model), args.seed)
    workload = build_workload(args, builder)
    mark_urgent(workload, args.urgent_fraction)
    print(f"pdserve bench: {workload.name}, {len(workload.requests)} requests, targets "
          f"{', '.join(n for n, _ in targets)}", flush=True)
    runs = run_served(args, targets, workload, builder, levels, slo, model)
    baselines = {
        "hf": run_hf(args, workload, levels, model) if any(n == "hf" for n, _ in targets) else [],
        "ceiling": [r["ceiling"] for r in runs if "ceiling" in r],
    }
    lines = report.comparison_lines(runs, baselines)
    print(f"\n== serve benchmark: {workload.name} ==")
    if runs:
        print(report.results_table(runs))
        kinds = sorted({k for r in runs for k in r["by_kind"]})
        for kind in kinds:
            print(f"\n-- requests of kind {kind!r} --")
            print(report.results_table(runs, kind))
        print()
        for line in report.ratio_lines(runs):
            print(line)
    for b in baselines["hf"]:
        print(f"transformers generate (static batch {b['batch_size']}, {b['num_requests']} requests): "
              f"{b['output_throughput']:.1f} output tok/s")
    for line in lines:
        print(line)
    if args.json or args.plots:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        write_outputs(args, argv, workload, runs, baselines, device)
    return 0 if all(r["summary"]["num_failed"] == 0 for r in runs) else 1


def write_outputs(args: argparse.Namespace, argv: list[str] | None, workload: Workload, runs: list[dict[str, Any]],
                  baselines: dict[str, Any], device: str) -> None:
    """PNG plots at the ``--plots`` prefix (default: the ``--json`` path less ``.json``), then the JSON."""
    prefix = args.plots or str(Path(args.json).with_suffix(""))
    plots = {"latency_cdf": f"{prefix}-latency-cdf.png"}
    title = f"{workload.name} ({len(workload.requests)} requests, {device})"
    report.plot_latency_cdfs(plots["latency_cdf"], runs, title)
    if len({r["concurrency"] for r in runs}) > 1:
        plots["throughput"] = f"{prefix}-throughput.png"
        report.plot_throughput(plots["throughput"], runs, baselines, title)
    written = list(plots.values())
    if args.json:
        report.write_json(args.json, {
            "date": datetime.date.today().isoformat(), "device": device,
            "command": "pdserve bench serve " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            "settings": {k: v for k, v in vars(args).items() if k != "api_key"}, "workload": workload.describe(), "runs": runs, "baselines": baselines,
            "plots": {k: Path(v).name for k, v in plots.items()},
        })
        written.insert(0, args.json)
    print(f"wrote {', '.join(written)}")


if __name__ == "__main__":
    sys.exit(main())
