"""The router's lock-free histogram exposes what prometheus_client's Histogram exposes."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router.metrics import LoopHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)


@pytest.mark.parametrize("values", [[], [0.0005, 0.001, 0.002, 0.1, 0.5, 3.0, 0.01], [0.1] * 5 + [2.0, 1e-9]])
def test_loop_histogram_exposition_equals_prometheus_clients(values: list[float]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("pdserve:x_seconds", "Doc.", buckets=BUCKETS, registry=theirs)
    histogram = LoopHistogram("pdserve:x_seconds", "Doc.", BUCKETS, registry=ours)
    for value in values:
        reference.observe(value)
        histogram.observe(value)
    expected = [line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == expected
