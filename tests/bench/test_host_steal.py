"""The benchmarks' reading of the hypervisor's steal: ``/proc/stat`` parsed per CPU, and a window's
stolen share, overall and at worst over a short span, from samples taken during a run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ops.bench.host_speed import cpu_ticks, describe_steal, steal_during

# user nice system idle iowait irq softirq steal guest guest_nice
STAT = """cpu  100 0 50 800 10 0 5 35 7 0
cpu0 60 0 30 390 5 0 3 12 7 0
cpu1 40 0 20 410 5 0 2 23 0 0
intr 12345 0 0
ctxt 999
"""


def test_proc_stat_is_read_per_cpu_with_steal_apart_from_the_total(tmp_path: Path) -> None:
    path = tmp_path / "stat"
    path.write_text(STAT)
    # Guest time is already inside user, so it is not added again.
    assert cpu_ticks(path) == {"cpu": (35, 1000), "cpu0": (12, 500), "cpu1": (23, 500)}
    assert cpu_ticks(tmp_path / "missing") == {}


def _ticks(cpu0: tuple[int, int], cpu1: tuple[int, int]) -> dict[str, tuple[int, int]]:
    return {"cpu": (cpu0[0] + cpu1[0], cpu0[1] + cpu1[1]), "cpu0": cpu0, "cpu1": cpu1}


def test_a_window_counts_the_steal_between_its_readings_and_its_worst_burst() -> None:
    # Every 50 ms each CPU runs 5 ticks. cpu1 loses 4 of its 5 in the two samples from 0.20 s on,
    # and 1 in 5 elsewhere; cpu0 loses nothing.
    samples, steal1 = [], 0
    for i in range(11):
        t = i * 0.05
        if i > 0:
            steal1 += 4 if i in (5, 6) else 1
        samples.append((t, _ticks((0, 5 * i), (steal1, 5 * i))))
    # The window 0.12-0.43 s is read from the sample at 0.10 s to the one at 0.45 s.
    steal = steal_during(samples, 0.12, 0.43, span_s=0.1)
    assert steal["cpu0"] == {"share": 0.0, "worst_share": 0.0}
    assert steal["cpu1"]["share"] == pytest.approx((1 + 1 + 4 + 4 + 1 + 1 + 1) / 35, abs=1e-4)
    # The worst 100 ms: the two 50 ms steps that lost 4 ticks each, 8 of 10.
    assert steal["cpu1"]["worst_share"] == pytest.approx(0.8)
    assert steal["cpu"]["worst_share"] == pytest.approx(0.4)
    text = describe_steal(steal)
    assert text.startswith("stolen by the hypervisor (at worst: the most of any 100 ms): all CPUs 19% (at worst 40%)")
    assert text.endswith("cpu0 0% (at worst 0%), cpu1 37% (at worst 80%)")
    # Two readings have no span inside them: the share alone.
    two = steal_during([samples[0], samples[-1]], 0.0, 0.5)
    assert two["cpu1"] == {"share": pytest.approx(16 / 50)} and "at worst" not in describe_steal(two)
    assert steal_during([samples[0]], 0.0, 1.0) == {} and describe_steal({}) == ""


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/stat is Linux's")
def test_this_host_reports_a_share_between_none_and_all() -> None:
    import time

    before = (time.monotonic(), cpu_ticks())
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # some ticks to count
        pass
    steal = steal_during([before, (time.monotonic(), cpu_ticks())], before[0], time.monotonic())
    assert "cpu" in steal and 0.0 <= steal["cpu"]["share"] <= 1.0
