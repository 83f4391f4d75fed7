"""The stack a chaos run works on: ``pdserve up`` in a child process, or one already running.

The stack is started as its own ``pdserve up`` process (not in this process, as the serving
benchmark does) because restarting killed engines is the job of ``pdserve up``'s supervisor loop,
and that loop is part of what a chaos run tests. Its output goes to ``LOG_DIR/up.log``, each
service's to ``LOG_DIR/NAME.log``, and it keeps ``LOG_DIR/children.json`` (see ``chaos_faults``).

The router's ``/metrics`` re-exports each live instance's gauges labelled ``instance``, ``role``
and ``model_name``; ``instance_gauges`` reads them and ``wait_blocks_idle`` polls until every
instance holds no KV blocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ops.launcher import die_with_parent, free_port

INSTANCE_GAUGES = (
    "pdserve:num_blocks_in_use", "pdserve:num_requests_running", "pdserve:num_requests_waiting",
    "pdserve:kv_cache_usage_perc",
)
BLOCKS = "pdserve:num_blocks_in_use"


def instance_gauges(text: str, names: tuple[str, ...] = INSTANCE_GAUGES) -> dict[str, dict[str, Any]]:
    """``{instance: {"role": ..., name: value, ...}}`` from a Prometheus text page.

    Only samples of ``names`` that carry an ``instance`` label count (the router's own
    ``num_requests_running`` has none). Lines that do not parse are skipped.
    """
    instances: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#") or not line.startswith(names):
            continue
        try:
            families = list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            continue
        for family in families:
            for sample in family.samples:
                instance = sample.labels.get("instance")
                if sample.name in names and instance:
                    entry = instances.setdefault(instance, {"role": sample.labels.get("role", "")})
                    entry[sample.name] = sample.value
    return instances


def blocks_idle(instances: dict[str, dict[str, Any]]) -> bool:
    """Every instance reports ``num_blocks_in_use`` and it is 0 (False when none reports it)."""
    values = [entry.get(BLOCKS) for entry in instances.values()]
    return bool(values) and all(v == 0 for v in values)


def wait_blocks_idle(
    fetch: Callable[[], str], timeout_s: float, poll_s: float = 1.0,
) -> dict[str, Any]:
    """Poll ``fetch()`` (a /metrics page) until every instance holds 0 blocks or ``timeout_s`` passes.

    Returns ``{"idle": bool, "waited_s": ..., "exported": bool, "instances": {...}}`` with the last
    page's gauges; ``exported`` says whether any instance reported ``num_blocks_in_use`` at all.
    """
    start = time.monotonic()
    instances: dict[str, dict[str, Any]] = {}
    error = ""
    while True:
        try:
            instances = instance_gauges(fetch())
            error = ""
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        if blocks_idle(instances) or time.monotonic() - start >= timeout_s:
            break
        time.sleep(poll_s)
    return {
        "idle": blocks_idle(instances), "waited_s": time.monotonic() - start,
        "exported": any(BLOCKS in entry for entry in instances.values()),
        "instances": dict(sorted(instances.items())), "error": error,
    }


def get_text(url: str, timeout_s: float = 5.0) -> str:
    response = httpx.get(url, timeout=timeout_s)
    response.raise_for_status()
    return response.text


def ready_counts(base_url: str, timeout_s: float = 2.0) -> dict[str, int] | None:
    """``{"prefill": n, "decode": m}`` instances the router serves with (its /ready), None if it does not answer."""
    with contextlib.suppress(httpx.HTTPError, ValueError, TypeError):
        body = httpx.get(f"{base_url.rstrip('/')}/ready", timeout=timeout_s).json()
        return {role: int(body.get(role, 0)) for role in ("prefill", "decode")}
    return None


def wait_whole(
    fetch_counts: Callable[[], dict[str, int] | None], expected: dict[str, int] | None, timeout_s: float,
    poll_s: float = 1.0,
) -> dict[str, Any]:
    """Poll ``fetch_counts()`` (``ready_counts``) until the router serves with ``expected`` instances
    per role again (restarts take a while) or ``timeout_s`` passes.

    Returns ``{"whole": bool, "waited_s": ..., "counts": the last counts}``.
    """
    start = time.monotonic()
    while True:
        counts = fetch_counts()
        whole = expected is None or (counts is not None and all(counts[r] >= n for r, n in expected.items()))
        if whole or time.monotonic() - start >= timeout_s:
            return {"whole": whole, "waited_s": time.monotonic() - start, "counts": counts}
        time.sleep(poll_s)


class UpStack:
    """``pdserve up --prefill P --decode D --log-dir LOG_DIR ...`` for the length of a ``with`` block."""

    def __init__(
        self, num_prefill: int, num_decode: int, model: str, log_dir: str | Path, up_args: list[str],
        ready_timeout_s: float = 900.0, stop_timeout_s: float = 150.0,
    ) -> None:
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.log_dir = Path(log_dir)
        self.port = free_port()
        self.ready_timeout_s, self.stop_timeout_s = ready_timeout_s, stop_timeout_s
        self.argv = [
            sys.executable, "-m", "common.cli", "up", "--prefill", str(num_prefill), "--decode", str(num_decode),
            "--model", model, "--port", str(self.port), "--log-dir", str(self.log_dir),
            "--ready-timeout", str(ready_timeout_s), *up_args,
        ]
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def up_log(self) -> Path:
        return self.log_dir / "up.log"

    def __enter__(self) -> UpStack:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.up_log, "wb") as log:
            self.popen = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
            )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def wait_ready(self) -> None:
        """Until the router serves with every instance launched; raises if ``pdserve up`` exits first."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(f"pdserve up exited with code {self.popen.returncode}:\n{self.log_tail()}")
            counts = ready_counts(self.url)
            if counts and counts["prefill"] >= self.num_prefill and counts["decode"] >= self.num_decode:
                return
            time.sleep(0.5)
        raise TimeoutError(f"the stack was not ready after {self.ready_timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to ``pdserve up`` (it stops its children in order), SIGKILL to the group if it lingers."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def log_tail(self, num_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.up_log.read_text(errors="replace")[-num_chars:]
        return ""


def children_summary(path: str | Path) -> dict[str, Any]:
    """``children.json`` as written (for the report), ``{}`` when absent or unreadable."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else {}
    return {}
