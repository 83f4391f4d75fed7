"""Targets of a serving benchmark: stacks the benchmark launches, and their engines' metrics.

``pd`` is one prefill and one decode instance, ``pd-nocache`` the same with prefix caching off
on every engine, ``pd-cap256`` the same with ``--long-prefill-token-threshold 256`` (no prompt
prefills more than 256 tokens per step), ``single`` one decode instance doing its own prefill (no
prefill instance: the router sends every request straight to decode). Stacks are started with ``ops.launcher.Launcher``
and their engines found through the Redis registry, whose entries carry each ``metrics_url``.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
from dataclasses import dataclass
from types import TracebackType

import httpx

from common.registry import Registry
from ops.bench.environ import child_env
from ops.launcher import ChildExited, Launcher, build_parser, free_port


@dataclass(frozen=True)
class StackSpec:
    num_prefill: int
    num_decode: int
    engine_flags: tuple[str, ...] = ()


STACKS = {
    "pd": StackSpec(1, 1),
    "pd-nocache": StackSpec(1, 1, ("--no-enable-prefix-caching",)),
    "pd-cap256": StackSpec(1, 1, ("--long-prefill-token-threshold", "256")),
    "pd-offload": StackSpec(1, 1, ("--kv-offloading-size", "1")),
    "single": StackSpec(0, 1),
}
IN_PROCESS = ("hf",)


def scrape(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Samples of a Prometheus text page, summed over labels, by sample name."""
    text = httpx.get(metrics_url, timeout=timeout_s).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            values[name] = values.get(name, 0.0) + float(value)
    return values


def add_metrics(pages: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for page in pages:
        for name, value in page.items():
            total[name] = total.get(name, 0.0) + value
    return total


class LaunchedStack:
    """A Redis + engines + router stack for the length of a ``with`` block; logs in a temporary folder."""

    def __init__(
        self, name: str, model: str, engine_args: list[str], num_threads: int | None = None,
        ready_timeout_s: float = 900.0,
    ) -> None:
        self.name = name
        self.num_threads = num_threads
        self.spec = STACKS[name]
        self._logs = tempfile.TemporaryDirectory(prefix=f"pdserve-bench-{name}-")
        argv = [
            "--prefill", str(self.spec.num_prefill), "--decode", str(self.spec.num_decode), "--model", model,
            "--port", str(free_port()), "--log-dir", self._logs.name, "--grace-period", "15",
            "--ready-timeout", str(ready_timeout_s),
            *engine_args, *self.spec.engine_flags,
        ]
        args, engine_extra = build_parser().parse_known_args(argv)
        self.launcher = Launcher(args, engine_extra)
        self.model = model
        self.redis_url = ""

    @property
    def url(self) -> str:
        return self.launcher.url

    def __enter__(self) -> LaunchedStack:
        try:
            self.redis_url = self.launcher.start_redis()
            self.launcher.args.redis_url = self.redis_url
            # Children inherit OMP_NUM_THREADS (torch's intra-op threads).
            threads = {} if self.num_threads is None else {"OMP_NUM_THREADS": str(self.num_threads)}
            with child_env(threads):
                self.launcher.start_all(self.model)
            self._wait_ready()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop()

    def _stop(self) -> None:
        self.launcher.stop_all()
        self._logs.cleanup()

    def _wait_ready(self) -> None:
        """Until the router lists every instance of the stack (``/ready`` is 200 from the first decode one)."""
        try:
            self.launcher.wait_ready()
        except ChildExited as exc:
            raise RuntimeError(f"{exc}\n{exc.child.log_tail()}") from None
        except TimeoutError as exc:
            raise TimeoutError(f"stack {self.name}: {exc}\n{self.log_tails()}") from None

    def log_tails(self) -> str:
        return "\n".join(f"--- {c.name}\n{c.log_tail(1500)}" for c in self.launcher.children)


def engine_metrics_urls(redis_url: str, role: str | None = None) -> dict[str, str]:
    """``{instance_id: metrics_url}`` of the live engines (of ``role``) the registry lists with a metrics port."""
    registry = Registry(redis_url)
    try:
        return {i.instance_id: i.metrics_url for i in registry.instances(role) if i.metrics_url}
    finally:
        registry.close()


def block_size_of(redis_url: str) -> int:
    registry = Registry(redis_url)
    try:
        sizes = [i.block_size for i in registry.instances()]
    finally:
        registry.close()
    return sizes[0] if sizes else 16


class BatchSampler:
    """Samples the decode instances' ``num_requests_running`` in a thread while a run goes on."""

    def __init__(self, metrics_urls: list[str], interval_s: float = 0.25) -> None:
        self.metrics_urls = metrics_urls
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="batch-sampler")

    def __enter__(self) -> BatchSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for url in self.metrics_urls:
                with contextlib.suppress(httpx.HTTPError):
                    self.samples.append(scrape(url, 2.0).get("pdserve:num_requests_running", 0.0))

    @property
    def mean_busy(self) -> float:
        """Mean running batch over the samples where the instance was running something."""
        busy = [s for s in self.samples if s > 0]
        return sum(busy) / len(busy) if busy else 0.0


def metrics_of(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Scrape every engine now: ``{instance_id: samples}`` (an instance that does not answer is skipped)."""
    pages = {}
    for instance_id, url in urls.items():
        with contextlib.suppress(httpx.HTTPError):
            pages[instance_id] = scrape(url)
    return pages
