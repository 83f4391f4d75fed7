"""``pdserve bench chaos``: kills and stalls engines under load and checks that no request is lost.

It starts ``pdserve up --prefill 2 --decode 2 --log-dir LOG_DIR`` (or attaches to a running stack
with ``--url`` and that stack's ``--log-dir``), then sends the same greedy requests twice at a
fixed concurrency:

1. the reference pass, with no faults, records every answer's text;
2. the chaos pass, while a thread kill -9s a random engine about every ``--kill-interval`` seconds
   (pids from ``LOG_DIR/children.json``; ``pdserve up`` restarts what died) and once SIGSTOPs one
   for ``--stop-seconds`` before continuing it.

It reports how many chaos requests completed, how many answers equal their reference (and, for
those that do not, tokens repeated or lost: see ``chaos_compare``), every request's latency, the
extra latency of the requests a fault fell into against their reference latency, and the KV
blocks each instance still holds once the stack is idle (the router's /metrics). JSON and a
timeline plot go to ``ops/bench/results/chaos-<device>-<date>.json/.png`` (``--out``). The exit
code is 1 when a request failed, an answer differed or blocks stayed in use, so it can gate.

Defaults (200 requests, prompts 8..256 tokens, 24..48 output tokens, concurrency 16, a fault
every ~20 s, one 30 s stall) are sized for a 2-core CPU host running the default model: about
7,200 output tokens per pass, a few minutes each, one run under about 10 minutes.

    pdserve bench chaos
    pdserve bench chaos --num-requests 6 --kill-interval 5 --stop-seconds 0 --out /tmp/chaos.json
    pdserve bench chaos --url http://127.0.0.1:8000 --log-dir /tmp/stack-logs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.bench import chaos_report
from ops.bench.chaos_client import ChaosResult, ClientSettings, Progress, run_pass
from ops.bench.chaos_compare import request_rows, summarize_rows
from ops.bench.chaos_faults import Fault, FaultInjector, RollingRestart
from ops.bench.chaos_stack import (
    UpStack,
    children_summary,
    get_text,
    ready_counts,
    wait_blocks_idle,
    wait_whole,
)
from ops.bench.chaos_workload import ChaosRequest, chaos_workload, describe
from ops.bench.serve_client import first_model
from ops.bench.serve_report import write_json
from ops.bench.serve_workloads import PromptBuilder

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench chaos", description="Fault injection under load: no request lost.")
    s = p.add_argument_group("stack")
    s.add_argument("--url", default=None, help="attach to this running stack instead of starting one (needs --log-dir)")
    s.add_argument("--log-dir", default=None,
                   help="the stack's log folder, holding children.json (default: a new temporary folder, kept)")
    s.add_argument("--prefill", type=int, default=2, help="prefill instances of the launched stack")
    s.add_argument("--decode", type=int, default=2, help="decode instances of the launched stack")
    s.add_argument("--model", default=None, help="model of the launched stack and the tokenizer")
    s.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    s.add_argument("--served-model-name", default=None, help="'model' field sent (default: the first of /v1/models)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--engine-args", default="--kv-cache-memory 1G",
                   help="more flags for pdserve up: engine flags, or its own such as --threads-per-engine")
    s.add_argument("--ready-timeout", type=float, default=900.0, help="seconds for the launched stack to be ready")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=200)
    w.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the fault choices")
    w.add_argument("--min-prompt-len", type=int, default=8, help="prompt tokens, drawn log-uniformly")
    w.add_argument("--max-prompt-len", type=int, default=256)
    w.add_argument("--min-output-len", type=int, default=24, help="max_tokens, drawn uniformly")
    w.add_argument("--max-output-len", type=int, default=48)
    w.add_argument("--concurrency", type=int, default=16, help="requests in flight in both passes")
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let answers stop at end-of-sequence (default: always max_tokens tokens)")
    w.add_argument("--request-timeout", type=float, default=600.0)
    w.add_argument("--warmup", type=int, default=8,
                   help="short requests sent (not measured) before the passes, 4 at a time")
    f = p.add_argument_group("faults and report")
    f.add_argument("--kill-interval", type=float, default=20.0,
                   help="seconds between faults, jittered +-25%% (0: no faults, the two passes only)")
    f.add_argument("--stop-seconds", type=float, default=30.0,
                   help="how long the second fault keeps an engine SIGSTOPped (0: kills only)")
    f.add_argument("--rolling-restart", action="store_true",
                   help="instead of kills and stops: SIGTERM every engine once, one at a time, each "
                        "restarted by pdserve up before the next (a rolling update under load)")
    f.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds to wait after the chaos pass for every instance to be back and hold 0 KV blocks")
    f.add_argument("--out", default=None,
                   help="JSON path, the PNG beside it (default: ops/bench/results/chaos-<device>-<date>.json)")
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.url and not args.log_dir and args.kill_interval > 0:
        raise SystemExit("--url needs the stack's --log-dir (its children.json names the pids to kill)")
    if args.num_requests < 1 or args.concurrency < 1:
        raise SystemExit("need --num-requests >= 1 and --concurrency >= 1")
    if args.prefill < 0 or args.decode < 1:
        raise SystemExit("need --decode >= 1 and --prefill >= 0")
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        raise SystemExit("need 1 <= --min-prompt-len <= --max-prompt-len")
    if not 1 <= args.min_output_len <= args.max_output_len:
        raise SystemExit("need 1 <= --min-output-len <= --max-output-len")


def default_out(device_tag: str, date: str) -> Path:
    return RESULTS_DIR / f"chaos-{device_tag}-{date}.json"


def gate(summary: dict[str, Any], blocks: dict[str, Any], whole: dict[str, Any] | None = None) -> list[str]:
    """Why the run fails (empty when it passes): failed or different answers, instances that did
    not come back, blocks left in use."""
    failures = []
    n = summary["num_requests"]
    if summary["num_reference_ok"] < n:
        failures.append(f"{n - summary['num_reference_ok']} reference requests failed")
    if summary["num_completed"] < n:
        failures.append(f"{n - summary['num_completed']} chaos requests failed")
    num_differ = summary["num_completed"] - summary["num_identical"]
    if num_differ > 0:
        failures.append(f"{num_differ} completed answers differ from the reference")
    if whole is not None and not whole["whole"]:
        failures.append(f"the stack did not get every instance back (router serves with {whole['counts']})")
    if blocks.get("exported") and not blocks.get("idle"):
        busy = [name for name, e in blocks["instances"].items() if e.get("pdserve:num_blocks_in_use") != 0]
        failures.append(f"KV blocks still in use once idle on {', '.join(busy)}")
    return failures


def _warm_up(settings: ClientSettings, builder: PromptBuilder, num: int) -> None:
    """Prompts of a few blocks, so that both roles see traffic before anything is timed."""
    requests = []
    for i in range(num):
        text, ids = builder.build(40)
        requests.append(ChaosRequest(-1 - i, text, len(ids), 4, "completions", True))
    results = asyncio.run(run_pass(settings, requests, 4, time.monotonic()))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")


def run_one_pass(
    name: str, settings: ClientSettings, requests: list[ChaosRequest], concurrency: int,
    injector_args: dict[str, Any] | None,
) -> tuple[list[ChaosResult], list[Fault], int, float]:
    """One pass (faults injected when ``injector_args`` is given): results, faults, slots skipped, duration."""
    print(f"pdserve bench chaos: {name} pass, {len(requests)} requests at concurrency {concurrency}...", flush=True)
    zero = time.monotonic()
    progress = Progress(name, len(requests))
    with contextlib.ExitStack() as stack:
        injector: FaultInjector | RollingRestart | None = None
        if injector_args is not None:
            args = dict(injector_args)
            if args.pop("rolling", None) is None:
                injector = stack.enter_context(FaultInjector(zero=zero, **args))
            else:
                injector = stack.enter_context(RollingRestart(zero=zero, **args))
        results = asyncio.run(run_pass(settings, requests, concurrency, zero, progress))
    duration = time.monotonic() - zero
    if injector is None:
        return results, [], 0, duration
    return results, injector.faults, injector.num_skipped, duration


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def measure(args: argparse.Namespace, url: str, log_dir: Path | None, builder: PromptBuilder,
            requests: list[ChaosRequest]) -> dict[str, Any]:
    """Warm-up, the reference pass, the chaos pass, then the stack's state once idle (raw results)."""
    served = args.served_model_name or asyncio.run(first_model(url, args.api_key))
    settings = ClientSettings(url, served, args.api_key, args.ignore_eos, args.request_timeout)
    _warm_up(settings, builder, args.warmup)
    expected = ready_counts(url)  # what the router serves with before any fault
    reference, _, _, ref_duration = run_one_pass("reference", settings, requests, args.concurrency, None)
    injector_args = None
    if args.rolling_restart and log_dir is not None:
        injector_args = {
            "rolling": True, "children_path": log_dir / "children.json", "expected": expected,
            "serving": lambda: ready_counts(url),
        }
    elif args.kill_interval > 0 and log_dir is not None:
        injector_args = {
            "children_path": log_dir / "children.json", "interval_s": args.kill_interval,
            "stop_s": args.stop_seconds, "seed": args.seed, "serving": lambda: ready_counts(url),
        }
    chaos, faults, num_skipped, chaos_duration = run_one_pass(
        "chaos", settings, requests, args.concurrency, injector_args)
    print(f"pdserve bench chaos: waiting up to {args.idle_timeout:g}s for every instance to be back "
          "and to hold 0 blocks...", flush=True)
    whole = wait_whole(lambda: ready_counts(url), expected, args.idle_timeout)
    blocks = wait_blocks_idle(lambda: get_text(f"{url}/metrics"), max(5.0, args.idle_timeout - whole["waited_s"]))
    return {
        "reference": reference, "chaos": chaos, "faults": faults, "num_faults_skipped": num_skipped,
        "passes": {"reference": {"duration_s": ref_duration}, "chaos": {"duration_s": chaos_duration}},
        "instances_before": expected, "instances_after": whole, "blocks_after": blocks,
        "children_after": children_summary(log_dir / "children.json") if log_dir else {},
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the launched stack is stopped on the way out
    from transformers import AutoTokenizer

    from common.model.loader import resolve_model_path

    model = str(resolve_model_path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model)
    builder = PromptBuilder(tokenizer, args.seed)
    requests = chaos_workload(builder, args.num_requests, args.min_prompt_len, args.max_prompt_len,
                              args.min_output_len, args.max_output_len)
    started = time.monotonic()
    if args.url:
        log_dir = Path(args.log_dir) if args.log_dir else None
        raw = measure(args, args.url.rstrip("/").removesuffix("/v1"), log_dir, builder, requests)
    else:
        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
        print(f"pdserve bench chaos: starting pdserve up --prefill {args.prefill} --decode {args.decode} "
              f"(logs in {log_dir})...", flush=True)
        with UpStack(args.prefill, args.decode, model, log_dir, shlex.split(args.engine_args),
                     args.ready_timeout) as up:
            stack_start_s = time.monotonic() - started
            raw = measure(args, up.url, log_dir, builder, requests)
        raw["stack_start_s"] = stack_start_s
    raw["total_s"] = time.monotonic() - started
    reference, chaos, faults = raw.pop("reference"), raw.pop("chaos"), raw.pop("faults")
    rows = request_rows(requests, reference, chaos, faults,
                        lambda text: tokenizer.encode(text, add_special_tokens=False))
    summary = summarize_rows(rows)
    failures = gate(summary, raw["blocks_after"], raw["instances_after"])
    result: dict[str, Any] = {
        "summary": summary, "faults": [f.to_json() for f in faults], **raw,
        "passed": not failures, "failures": failures, "requests": rows,
    }
    print(f"\n== chaos benchmark: {len(requests)} requests, concurrency {args.concurrency} ==")
    for line in chaos_report.report_lines(result):
        print(line)
    if args.kill_interval > 0 and log_dir is not None and not faults:
        print("warning: no fault fell inside the chaos pass (it was shorter than --kill-interval)")
    write_outputs(args, argv, requests, result, str(log_dir) if log_dir else None)
    return 0 if result["passed"] else 1


def write_outputs(args: argparse.Namespace, argv: list[str] | None, requests: list[ChaosRequest],
                  result: dict[str, Any], log_dir: str | None) -> None:
    """The timeline PNG beside the JSON; the JSON holds the command, the settings and every request."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    date = datetime.date.today().isoformat()
    json_path = Path(args.out) if args.out else default_out("gpu" if device != "cpu" else "cpu", date)
    png_path = json_path.with_suffix(".png")
    title = (f"chaos pass: {len(requests)} requests, {len(result['faults'])} faults, "
             f"{result['summary']['num_identical']} identical ({device})")
    chaos_report.plot_timeline(png_path, result["requests"], result["faults"], title)
    write_json(json_path, {
        "date": date, "device": device, "log_dir": log_dir,
        "command": "pdserve bench chaos " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "settings": {k: v for k, v in vars(args).items() if k != "api_key"},
        "workload": describe(requests), **result, "plot": png_path.name,
    })
    print(f"wrote {json_path}, {png_path}")


if __name__ == "__main__":
    sys.exit(main())
