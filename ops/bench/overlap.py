"""``pdserve bench overhead overlap``: what async scheduling hides of the host's work per step, with a
simulated device.

The engine runs with the null forward of ``ops.bench.overhead`` (real scheduling, input preparation,
sampling and outputs; no model) and a stand-in for an asynchronous device: each forward queues
``--device-ms`` of device time behind the work already queued, and a step's sampled ids are ready
only when its device time has passed (the host spins until then, as a CUDA event wait does). This is
what a GPU would show of the engine's own work: synchronous steps cost host + device time, and with
async scheduling (``--async-scheduling``) the next step's host work runs during this step's device
time, so a step costs about the larger of the two.

Each case (greedy or mixed sampling, as in ``pdserve bench overhead``, at ``--batch-sizes``, sampler
over ``--host-vocab`` logits so that its per-entry work is small, as the host's share of it is beside
a GPU) runs synchronously and with async scheduling, in the same invocation. Reported: wall ms per
step (median and p90), the device's busy share (device time / step time) and the host's own ms per
step (the step's wall time less its waits for the device).

    pdserve bench overhead overlap --batch-sizes 64,256 --device-ms 2,5
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from common.engine.engine import LLMEngine
from common.engine.request import Request
from common.model.loader import resolve_model_path
from common.model.weights import load_hf_config
from ops.bench.host_speed import describe, host_speed
from ops.bench.overhead import PhaseClock, add_case_args, case_params, null_engine

RESULTS_DIR = Path(__file__).parent / "results"
CASES = ("greedy", "mixed")


class SimulatedDevice:
    """One stream: work runs in the order queued, each forward for a fixed time."""

    def __init__(self, seconds_per_step: float) -> None:
        self.seconds = seconds_per_step
        self.busy_until = 0.0
        self.waited = 0.0  # seconds the host spent waiting, since the last reset

    def queue(self) -> float:
        """Queue one step's work; when it is done."""
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.seconds
        return self.busy_until

    def wait(self, until: float) -> None:
        start = time.perf_counter()
        while time.perf_counter() < until:
            pass
        self.waited += time.perf_counter() - start


def attach(engine: LLMEngine, device: SimulatedDevice) -> None:
    """Each forward queues device time; each step's sampled ids wait for it."""
    runner = engine.runner
    execute, sample = runner.execute, engine.sampler.sample
    done_at: list[float] = []

    def queued_execute(*args: Any, **kwargs: Any) -> Tensor:
        logits: Tensor = execute(*args, **kwargs)
        done_at.append(device.queue())
        return logits

    def waited_sample(logits: Tensor, requests: list[Request]) -> Any:
        sampled = sample(logits, requests)
        ready, result = done_at.pop(), sampled.result

        def waited_result() -> Any:
            device.wait(ready)
            return result()

        sampled.result = waited_result  # type: ignore[method-assign]
        return sampled

    runner.execute = queued_execute  # type: ignore[method-assign]
    engine.sampler.sample = waited_sample  # type: ignore[method-assign]


def run_case(case: str, batch_size: int, device_ms: float, async_scheduling: bool, args: argparse.Namespace,
             logits: Tensor) -> dict[str, Any]:
    num_steps, warmup = args.num_steps, args.warmup
    vocab = int(logits.shape[1])
    max_tokens = warmup + num_steps + 4
    engine = null_engine(args, batch_size, max_tokens, logits, PhaseClock(), async_scheduling=async_scheduling)
    gen = torch.Generator().manual_seed(args.seed)
    for i, prompt in enumerate(torch.randint(3, vocab, (batch_size, args.prompt_len), generator=gen).tolist()):
        engine.add_request(f"{case}-{i}", prompt, case_params(case, i, max_tokens))
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # every prompt prefilled: only decode steps are measured
    device = SimulatedDevice(device_ms / 1e3)
    attach(engine, device)
    steps: list[float] = []
    host: list[float] = []
    for i in range(warmup + num_steps):
        device.waited = 0.0
        start = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - start
        if len(outputs) != batch_size:
            raise RuntimeError(f"{case}: a step gave {len(outputs)} outputs, not {batch_size}")
        if i >= warmup:
            steps.append(took)
            host.append(took - device.waited)
    step_ms = statistics.median(steps) * 1e3
    return {
        "case": case, "batch_size": batch_size, "device_ms": device_ms, "async_scheduling": async_scheduling,
        "vocab": vocab, "num_steps": num_steps,
        "step_ms": {"median": step_ms, "p90": sorted(steps)[int(0.9 * (len(steps) - 1))] * 1e3},
        "total_ms": sum(steps) * 1e3,  # the measured steps, end to end
        "host_ms": statistics.median(host) * 1e3,
        "device_busy": min(1.0, device_ms / step_ms),
    }


def format_report(report: dict[str, Any]) -> str:
    header = (f"{'case':<8}{'batch':>6}{'device ms':>11}{'sync step (p90)':>19}{'async step (p90)':>19}"
              f"{'host ms sync':>14}{'async':>8}{'busy sync':>11}{'async':>8}{'speed-up':>10}")
    lines = [f"ms per decode step, median; null forward + simulated device, sampler over {report['vocab']} logits, "
             f"{report['machine']['torch_threads']} torch thread(s)", header, "-" * len(header)]
    rows = report["results"]
    for sync in (r for r in rows if not r["async_scheduling"]):
        key = (sync["case"], sync["batch_size"], sync["device_ms"])
        asyn = next(r for r in rows if r["async_scheduling"] and (r["case"], r["batch_size"], r["device_ms"]) == key)
        s, a = sync["step_ms"], asyn["step_ms"]
        sync_cell, async_cell = (f"{t['median']:.2f} ({t['p90']:.2f})" for t in (s, a))
        lines.append(
            f"{sync['case']:<8}{sync['batch_size']:>6}{sync['device_ms']:>11g}{sync_cell:>19}{async_cell:>19}"
            f"{sync['host_ms']:>14.2f}{asyn['host_ms']:>8.2f}{sync['device_busy']:>11.0%}{asyn['device_busy']:>8.0%}"
            f"{s['median'] / a['median']:>9.2f}x"
        )
    lines += ["", "busy: device time / step time (what a GPU's utilisation would read); host ms: the step's wall "
              "time less its waits for the device"]
    lines += [describe(speed) for speed in report["host_speed"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench overhead overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(p, "64,256", CASES, 30)
    p.add_argument("--device-ms", default="2,5", help="comma-separated device ms per forward")
    p.add_argument("--host-vocab", type=int, default=1024, help="logits per row the sampler works over")
    p.add_argument("--json", default=None, metavar="PATH", help="default: ops/bench/results/overlap-cpu-<date>.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if not cases or not set(cases) <= set(CASES):
        raise SystemExit(f"--cases takes a comma-separated list of {', '.join(CASES)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    device_ms = [float(d) for d in args.device_ms.split(",") if d]
    if not batch_sizes or min(batch_sizes) < 1 or not device_ms or min(device_ms) < 0 or args.host_vocab < 128:
        raise SystemExit("batch sizes must be positive, --device-ms not negative, --host-vocab at least 128")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        vocab = min(args.host_vocab, int(load_hf_config(resolve_model_path(args.model)).vocab_size))
        gen = torch.Generator().manual_seed(args.seed)
        logits = torch.randn(max(batch_sizes), vocab, generator=gen) * 3.0
        report: dict[str, Any] = {
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["pdserve bench overhead overlap", *(argv if argv is not None else sys.argv[1:])]),
            "config": vars(args), "vocab": vocab,
            "machine": {"device": "cpu", "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                        "torch": torch.__version__},
            "host_speed": [host_speed()],
            "results": [],
        }
        for case in cases:
            for batch_size in batch_sizes:
                for ms in device_ms:
                    for mode in (False, True):  # side by side, in this order each time
                        print(f"{case}, batch {batch_size}, device {ms:g} ms, "
                              f"{'async' if mode else 'sync'} ...", file=sys.stderr, flush=True)
                        report["results"].append(run_case(case, batch_size, ms, mode, args, logits))
        report["host_speed"].append(host_speed())
    finally:
        torch.set_num_threads(threads)
    print(format_report(report))
    path = Path(args.json) if args.json else RESULTS_DIR / f"overlap-cpu-{report['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
