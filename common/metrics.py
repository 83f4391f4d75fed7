"""Prometheus metrics of an engine service, named like vLLM's under the ``pdserve:`` prefix."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.engine.engine import LORA_REQUESTS, SPEC_PER_POS, EngineStats
from common.metrics_server import serve_health_and_metrics
from common.nvml_metrics import register_nvml_collector

PREFIX = "pdserve:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class EngineMetrics:
    """Labelled ``model_name`` (as vLLM's, so its dashboards work with a prefix change), ``role``
    and ``instance``."""

    def __init__(self, role: str, instance_id: str, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "role": role, "instance": instance_id}
        self.labels = labels
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(
                **labels
            )

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        # Set only once the engine reports it (``EngineStats.extra``), so no false zero is exported.
        self._num_prompt_tokens_waiting = Gauge(
            PREFIX + "num_prompt_tokens_waiting", "Prompt tokens of waiting requests not yet computed",
            names, registry=self.registry,
        )
        # Speculative decoding, as vLLM names them, exported only by an engine that drafts; the host tier of the
        # prefix cache (``--kv-offloading-size``), only by an engine with one.
        self._extra_counters = {
            name: Counter(PREFIX + name, doc, names, registry=self.registry)
            for name, doc in (
                ("spec_decode_num_drafts", "Decode steps of a request that checked draft tokens"),
                ("spec_decode_num_draft_tokens", "Draft tokens checked"),
                ("spec_decode_num_accepted_tokens", "Draft tokens the model agreed with (kept)"),
                ("kv_offload_saved_blocks", "Cached KV blocks copied to the host tier as the KV cache took them back"),
                ("kv_offload_loaded_blocks", "KV blocks loaded from the host tier for a prefix hit"),
            )
        }
        self._kv_offload_blocks = Gauge(PREFIX + "kv_offload_blocks", "KV blocks the host tier holds",
                                        names, registry=self.registry)
        self._spec_per_pos = Counter(PREFIX + SPEC_PER_POS, "Drafts kept, by their position in the step's drafts",
                                     [*names, "position"], registry=self.registry)
        # Requests with each LoRA adapter, by state; exported only by an engine serving adapters.
        self._lora_requests = Gauge(PREFIX + "lora_requests", "Requests with a LoRA adapter, by adapter and state",
                                   [*names, "lora_name", "state"], registry=self.registry)
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recomputed later)")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "KV bytes moved by transfers")
        self.kv_transfer_failures = counter("kv_transfer_failures", "KV transfers that failed")
        self.kv_integrity_errors = counter(
            "kv_integrity_errors", "Idle-time KV pool checks that found leaked or miscounted blocks"
        )
        self.kv_transfer_seconds = histogram("kv_transfer_seconds", "Duration of KV transfers")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first schedule")
        self.prefill_time = histogram("request_prefill_time_seconds", "First schedule to first token")
        self._last = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)

    def update(self, stats: EngineStats) -> None:
        self.num_requests_running.set(stats.num_requests_running)
        self.num_requests_waiting.set(stats.num_requests_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage_perc)
        if "num_prompt_tokens_waiting" in stats.extra:
            self._num_prompt_tokens_waiting.labels(**self.labels).set(stats.extra["num_prompt_tokens_waiting"])
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - self._last.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - self._last.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions - self._last.num_preemptions)
        for name, extra_counter in self._extra_counters.items():
            if name in stats.extra:
                extra_counter.labels(**self.labels).inc(stats.extra[name] - self._last.extra.get(name, 0.0))
        if "kv_offload_blocks" in stats.extra:
            self._kv_offload_blocks.labels(**self.labels).set(stats.extra["kv_offload_blocks"])
        for name, value in stats.extra.items():
            if name.startswith(SPEC_PER_POS + ":"):
                position = name.rpartition(":")[2]
                self._spec_per_pos.labels(**self.labels, position=position).inc(value - self._last.extra.get(name, 0.0))
            elif name.startswith(LORA_REQUESTS + ":"):
                _, state, lora_name = name.split(":", 2)
                self._lora_requests.labels(**self.labels, lora_name=lora_name, state=state).set(value)
        self._last = stats

    def serve(self, host: str, port: int, ready: Callable[[], bool] = lambda: True) -> None:
        """Expose ``/metrics``, ``/health`` and ``/ready`` (``ready()``) on ``host:port`` from a
        daemon thread (port 0: not served). See ``common.metrics_server``."""
        if port:
            serve_health_and_metrics(host, port, self.registry, ready)

    def watch_gpus(self, uuids: Sequence[str] = ()) -> bool:
        """Add NVML's GPU gauges for these GPUs (all it sees when none are given), read per scrape;
        False (one log line) without NVML."""
        return register_nvml_collector(self.registry, self.labels, uuids) is not None
