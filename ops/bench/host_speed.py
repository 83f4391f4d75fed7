"""How fast this host runs Python and dispatches torch operations right now, for a report to carry.

Host-time figures (an engine step with a null forward, a router's CPU per token) are Python and
dispatch work, and a shared or throttled host runs that work at very different speeds from one
session to the next: the same code has measured 3x apart. Beside its figures, a report keeps these
two, measured in the same invocation, so reports of different days can be put side by side:

* ``python_loop_us``: one iteration of a fixed loop of dict and integer work (median of 5 runs);
* ``torch_op_us``: one ``torch.add`` of two 16-element CPU tensors, dispatch and all (median of 5
  runs of 2,000), where torch is asked for.

The one-minute load average is kept too: other processes' work slows both.

A virtual machine's CPUs can also be taken away by the hypervisor for its other guests: time the
guest wanted to run and did not, which Linux counts per CPU as *steal* in ``/proc/stat``. A
process that was runnable waits as long, however little it had left to do, so a latency tail can be
the host's and not the code's. ``cpu_ticks`` reads those counters and ``steal_during`` says, for a
window of a run, what share of each CPU's time was stolen, overall and at worst over any short span.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

PROC_STAT = Path("/proc/stat")
_LOOP_ITERATIONS = 200_000
_TORCH_OPS = 2_000


def _python_loop(n: int) -> int:
    counts: dict[int, int] = {}
    for i in range(n):
        key = i & 1023
        counts[key] = counts.get(key, 0) + i
    return len(counts)


def _median_us(run: Any, per: int, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / per * 1e6


def host_speed(torch_ops: bool = True) -> dict[str, float]:
    """The figures above (microseconds), plus ``load_avg_1m``."""
    speed = {
        "python_loop_us": round(_median_us(lambda: _python_loop(_LOOP_ITERATIONS), _LOOP_ITERATIONS), 4),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    if torch_ops:
        import torch

        a, b = torch.ones(16), torch.ones(16)

        def dispatch() -> None:
            for _ in range(_TORCH_OPS):
                torch.add(a, b)

        speed["torch_op_us"] = round(_median_us(dispatch, _TORCH_OPS), 3)
    return speed


def describe(speed: dict[str, float] | None) -> str:
    """One line for a report; empty for a report made before the figures were kept."""
    if not speed:
        return ""
    parts = [f"python loop {speed['python_loop_us'] * 1e3:.0f} ns/iteration"]
    if "torch_op_us" in speed:
        parts.append(f"torch op {speed['torch_op_us']:.1f} us")
    parts.append(f"load average {speed['load_avg_1m']:.2f}")
    return "host speed now: " + ", ".join(parts) + " (compare reports by these)"


# ---------------------------------------------------------------------------------- steal
# One reading of /proc/stat: per CPU ("cpu" for all of them), (steal, total) clock ticks since boot.
CpuTicks = dict[str, tuple[int, int]]


def cpu_ticks(path: Path = PROC_STAT) -> CpuTicks:
    """Each CPU's (steal, total) ticks from ``path``; {} where there is no such file (not Linux). Total
    is user + nice + system + idle + iowait + irq + softirq + steal (guest time is inside user)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    ticks: CpuTicks = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        name, *fields = line.split()
        values = [int(v) for v in fields[:8]]
        ticks[name] = (values[7] if len(values) > 7 else 0, sum(values))
    return ticks


def _share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    steal, total = after[0] - before[0], after[1] - before[1]
    return steal / total if total > 0 else None


def steal_during(samples: list[tuple[float, CpuTicks]], start: float, end: float,
                 span_s: float = 0.1) -> dict[str, dict[str, float]]:
    """Per CPU, from ``samples`` (time, ``cpu_ticks()``) in time order: ``share``, the stolen share of
    its time from the last sample at or before ``start`` to the first at or after ``end``; and
    ``worst_share``, the most stolen over any two samples at least ``span_s`` apart in between (ticks
    are 10 ms, so a span of a few ticks says whether the CPU was taken away in a burst). {} without
    two readings around the window."""
    inside = [(t, ticks) for t, ticks in samples if ticks]
    first = max((i for i, (t, _) in enumerate(inside) if t <= start), default=0)
    last = min((i for i, (t, _) in enumerate(inside) if t >= end), default=len(inside) - 1)
    inside = inside[first:last + 1]
    if len(inside) < 2:
        return {}
    out: dict[str, dict[str, float]] = {}
    for cpu in inside[0][1]:
        share = _share(inside[0][1][cpu], inside[-1][1][cpu]) if cpu in inside[-1][1] else None
        if share is None:
            continue
        worst, j = share, 0
        for i, (t, ticks) in enumerate(inside):
            j = max(j, i + 1)
            while j < len(inside) and inside[j][0] - t < span_s:
                j += 1
            if j == len(inside):
                break
            span = _share(ticks[cpu], inside[j][1][cpu]) if cpu in ticks and cpu in inside[j][1] else None
            if span is not None:
                worst = max(worst, span)
        out[cpu] = {"share": round(share, 4)}
        if len(inside) > 2:  # two readings have no span inside them
            out[cpu]["worst_share"] = round(worst, 4)
    return out


def describe_steal(steal: dict[str, dict[str, float]] | None, span_s: float = 0.1) -> str:
    """``steal_during``'s figures in words: all CPUs', then each one's; empty without any."""
    if not steal or "cpu" not in steal:
        return ""

    def one(s: dict[str, float]) -> str:
        return f"{s['share']:.0%}" + (f" (at worst {s['worst_share']:.0%})" if "worst_share" in s else "")

    each = ", ".join(f"{cpu} {one(s)}" for cpu, s in sorted(steal.items()) if cpu != "cpu")
    span = f" (at worst: the most of any {span_s * 1e3:.0f} ms)" if "worst_share" in steal["cpu"] else ""
    return f"stolen by the hypervisor{span}: all CPUs {one(steal['cpu'])}{f', {each}' if each else ''}"
