"""The engines' load, as their heartbeats report it, re-exported on the router's ``/metrics``.

One scrape of the router then shows the state the router routes by, for every registered instance.
The families are built at scrape time from the instance pool, so an instance that left the pool
leaves the output with it, and each name is one family: the router's own in-flight count is the
``role="router"`` series of ``pdserve:num_requests_running``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.registry import InstanceInfo

LABELS = ("instance", "role", "model_name")
NUM_REQUESTS_RUNNING = "pdserve:num_requests_running"

_GAUGES: dict[str, tuple[str, Callable[[InstanceInfo], float]]] = {
    NUM_REQUESTS_RUNNING: (
        'Requests in the instance\'s running batch at its last heartbeat (role="router": HTTP requests '
        "the router is serving).",
        lambda info: info.num_requests_running,
    ),
    "pdserve:num_requests_waiting": (
        "Requests waiting to be scheduled at the instance's last heartbeat.",
        lambda info: info.num_requests_waiting,
    ),
    "pdserve:kv_cache_usage_perc": (
        "Fraction of the instance's KV blocks in use (0-1) at its last heartbeat.",
        lambda info: info.kv_cache_usage_perc,
    ),
    "pdserve:num_blocks_in_use": (
        "KV blocks held by requests or transfers at the instance's last heartbeat.",
        lambda info: info.num_blocks_in_use,
    ),
    "pdserve:instance_draining": (
        "1 while the instance drains (finishing what it holds, taking nothing new), else 0.",
        lambda info: float(info.draining),
    ),
}


class FleetCollector(Collector):
    """Gauges per registered instance, labelled ``instance``, ``role`` and ``model_name``.

    ``instances`` and ``num_router_requests_running`` are called on every scrape, from the thread
    that renders ``/metrics``; they must only read.
    """

    def __init__(
        self,
        instances: Callable[[], Iterable[InstanceInfo]],
        num_router_requests_running: Callable[[], float],
    ) -> None:
        self._instances = instances
        self._num_router_requests_running = num_router_requests_running

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The names only, so the registry refuses a second metric under any of them."""
        for name, (doc, _) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, labels=LABELS)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        infos = sorted(self._instances(), key=lambda info: (info.role, info.instance_id))
        for name, (doc, read) in _GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            if name == NUM_REQUESTS_RUNNING:
                family.add_sample(name, {"role": "router"}, float(self._num_router_requests_running()))
            for info in infos:
                family.add_metric([info.instance_id, info.role, info.model], read(info))
            yield family
