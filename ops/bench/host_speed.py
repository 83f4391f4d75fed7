"""How fast this host runs Python and dispatches torch operations right now, for a report to carry.

Host-time figures (an engine step with a null forward, a router's CPU per token) are Python and
dispatch work, and a shared or throttled host runs that work at very different speeds from one
session to the next: the same code has measured 3x apart. Beside its figures, a report keeps these
two, measured in the same invocation, so reports of different days can be put side by side:

* ``python_loop_us``: one iteration of a fixed loop of dict and integer work (median of 5 runs);
* ``torch_op_us``: one ``torch.add`` of two 16-element CPU tensors, dispatch and all (median of 5
  runs of 2,000), where torch is asked for.

The one-minute load average is kept too: other processes' work slows both.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

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
