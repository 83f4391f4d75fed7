"""Prometheus metrics of the router, named like vLLM's under the ``pdserve:`` prefix.

Each app gets its own registry, so several routers (e.g. in tests) can live in one process.
Metrics whose names the engines also export carry ``role="router"``, as the engines' carry theirs.
The engines' load the router knows from their heartbeats is re-exported per instance
(``router/fleet_metrics.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from common.registry import InstanceInfo
from router.fleet_metrics import FleetCollector

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_LATENCY_BUCKETS_TAIL = (10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
_E2E_BUCKETS_TAIL = (120.0, 240.0, 480.0)
_TOKEN_BUCKETS = tuple(float(b * 10**e) for e in range(6) for b in (1, 2, 5))


class _CountCollector(Collector):
    """A counter kept elsewhere (a plain int), read at scrape time."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterable[CounterMetricFamily]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


class LoopHistogram(Collector):
    """A histogram observed and scraped on the event loop's thread only: no lock, one ``bisect``
    per observation. ``prometheus_client.Histogram`` takes a lock per bucket and for the sum; for
    a value observed with every streamed token (the inter-token latency) that was a few percent
    of the router's CPU."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = sorted(float(b) for b in buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1  # bucket i counts value <= bound i
        self._sum += value

    def collect(self) -> Iterable[HistogramMetricFamily]:
        cumulative, buckets = 0, []
        for bound, count in zip([*self._bounds, float("inf")], self._counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self._name, self._documentation, buckets=buckets, sum_value=self._sum)


class RouterMetrics:
    """``instances``, ``num_requests_running`` (the router's HTTP requests in flight) and
    ``num_rejected_registry_entries`` are read at scrape time; the defaults show an empty fleet."""

    def __init__(
        self,
        instances: Callable[[], Iterable[InstanceInfo]] = tuple,
        num_requests_running: Callable[[], float] = int,
        num_rejected_registry_entries: Callable[[], float] = int,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = LoopHistogram(
            "pdserve:time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS + _LATENCY_BUCKETS_TAIL,
            registry=r,
        )
        self.inter_token_latency = LoopHistogram(
            "pdserve:inter_token_latency_seconds",
            "Time between tokens.",
            buckets=_LATENCY_BUCKETS + _LATENCY_BUCKETS_TAIL,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "End-to-end request latency.",
            buckets=_E2E_BUCKETS + _E2E_BUCKETS_TAIL,
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Tokens generated.", ["role"], registry=r
        ).labels(role="router")
        self.request_prompt_tokens = Histogram(
            "pdserve:request_prompt_tokens", "Prompt tokens per request.", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "pdserve:request_generation_tokens",
            "Generated tokens per request.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_success = Counter(
            "pdserve:request_success",
            "Finished engine requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "pdserve:prompt_tokens_cached", "Prompt tokens served from a prefix cache.", registry=r
        )
        self.http_errors = Counter(
            "pdserve:router_http_errors", "Error responses by status.", ["status"], registry=r
        )
        self.routed = Counter(
            "pdserve:router_requests_routed", "Engine requests sent, by path.", ["path"], registry=r
        )
        self.migrations = Counter(
            "pdserve:request_migrations",
            "Requests continued on another instance (prompt + tokens streamed so far) after theirs "
            "died, stalled, drained or lost the KV transfer, by whether that instance was running the "
            "request (where=running: it counts against the request's few migrations) or it only waited "
            "there (where=waiting).",
            ["where"],
            registry=r,
        )
        for where in ("running", "waiting"):
            self.migrations.labels(where=where)  # both series from the start, at 0
        self.prefix_hit_blocks = Counter(
            "pdserve:router_prefix_hit_blocks",
            "Prompt blocks cached on the chosen prefill instance.",
            registry=r,
        )
        self.prefix_query_blocks = Counter(
            "pdserve:router_prefix_query_blocks", "Prompt blocks looked up in the prefix index.", registry=r
        )
        self.instances = Gauge("pdserve:router_instances", "Known instances by role.", ["role"], registry=r)
        r.register(FleetCollector(instances, num_requests_running))
        r.register(_CountCollector(
            "pdserve:registry_entries_rejected",
            "Registry entries dropped on read: unsigned or with a MAC that does not verify under the cluster key.",
            num_rejected_registry_entries,
        ))
        # The processed images (``router.images.ProcessedCache``), where the model takes them: ``watch_image_cache``.
        self._image_cache: Any = None
        r.register(_CountCollector(
            "pdserve:router_image_cache_queries",
            "Chat images looked up in the processed-image cache (--mm-processor-cache-gb).",
            lambda: self._image_cache_count("queries"),
        ))
        r.register(_CountCollector(
            "pdserve:router_image_cache_hits",
            "Chat images found in the processed-image cache: not decoded or processed again.",
            lambda: self._image_cache_count("hits"),
        ))
        # Engine outputs a streaming response took in the receive loop (``router/inline_stream.py``),
        # counted there: [count], a plain int, not a locked counter, for a per-token figure.
        self.inline_outputs = [0]
        r.register(_CountCollector(
            "pdserve:router_outputs_inline",
            "Engine outputs sent to their streaming client from the receive loop, without waking the request's task.",
            lambda: self.inline_outputs[0],
        ))

        self.engine_message_seconds = LoopHistogram(
            "pdserve:router_engine_message_seconds",
            "Time the router's receive loop took over one engine message, from reading it to its last "
            "output handed on (for the streams it writes itself, their writes): the last stream of an "
            "engine step waits that long.",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.05, 0.1),
            registry=r,
        )

        self.gc_pause = Histogram(
            "pdserve:router_gc_pause_seconds",
            "Garbage collection pauses of the router process: paced (run at a quiet point: an engine "
            "message's outputs all sent, or a second without engine messages) or automatic (run where an "
            "allocation passed the threshold).",
            ["when"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )

    def watch_image_cache(self, cache: Any) -> None:
        """Report ``cache``'s queries and hits (a ``router.images.ProcessedCache``) at each scrape."""
        self._image_cache = cache

    def _image_cache_count(self, field: str) -> float:
        cache = self._image_cache
        if cache is None:
            return 0
        return float(cache.hits + cache.misses if field == "queries" else cache.hits)

    def observe_gc_pause(self, seconds: float, paced: bool) -> None:
        self.gc_pause.labels(when="paced" if paced else "automatic").observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
