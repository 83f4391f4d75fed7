"""Starts real service processes (router, prefill, decode) for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from ops.launcher import die_with_parent
from tests.conftest import free_port

ENGINE_FLAGS = ["--num-blocks", "512", "--max-num-batched-tokens", "256", "--max-num-seqs", "32"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: str
    metrics_port: int = 0

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def stop(self, kill: bool = False) -> None:
        if self.popen.poll() is None:
            (self.popen.kill if kill else self.popen.terminate)()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)


@dataclass
class Stack:
    redis_url: str
    model: str
    router_port: int = 0
    procs: dict[str, Proc] = field(default_factory=dict)
    # under the run's pytest temp folder (tests/conftest.py), pruned with it
    logdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pdserve-e2e-",
                                                                 dir=os.environ.get("PDSERVE_TEST_TMP")))
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's, for every service

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def _spawn(self, name: str, args: list[str], metrics_port: int = 0) -> Proc:
        log_path = os.path.join(self.logdir, f"{name}.log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(log_path, "w") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "common.cli", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                preexec_fn=die_with_parent,
            )
        proc = Proc(name, popen, log_path, metrics_port)
        self.procs[name] = proc
        return proc

    def start_engine(self, role: str, name: str, extra: list[str] | None = None) -> Proc:
        metrics_port = free_port()
        args = [role, "--model", self.model, "--redis-url", self.redis_url, "--instance-id", name,
                "--metrics-port", str(metrics_port), "--kv-transfer-timeout", "10", "--log-level", "WARNING",
                *ENGINE_FLAGS, *(extra or [])]
        return self._spawn(name, args, metrics_port)

    def start_router(self, extra: list[str] | None = None) -> Proc:
        self.router_port = free_port()
        args = ["router", "--model", self.model, "--redis-url", self.redis_url, "--port", str(self.router_port),
                "--log-level", "warning", *(extra or [])]
        return self._spawn("router", args)

    def add_router(self, name: str, extra: list[str], timeout_s: float = 120.0) -> str:
        """One more router in front of the same engines (with flags of its own), ready; its URL."""
        port = free_port()
        args = ["router", "--model", self.model, "--redis-url", self.redis_url, "--port", str(port),
                "--log-level", "warning", *extra]
        proc = self._spawn(name, args)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.popen.returncode}:\n{proc.log()}")
            try:
                body = httpx.get(url + "/ready", timeout=2).json()
                if body.get("prefill", 0) >= 1 and body.get("decode", 0) >= 1:
                    return url
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{name} not ready in {timeout_s}s\n{proc.log()}")

    def wait_ready(self, num_prefill: int, num_decode: int, timeout_s: float = 120.0) -> None:
        """Until Redis lists the expected instances and the router serves with all of them (its
        /ready counts them: a router that does not see the prefill yet would send a long prompt
        straight to a decode instance)."""
        from common.registry import Registry

        registry = Registry(self.redis_url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs.values():
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()}")
            live = registry.instances()
            roles = [i.role for i in live]
            if roles.count("prefill") >= num_prefill and roles.count("decode") >= num_decode:
                try:
                    ready = httpx.get(self.url + "/ready", timeout=2)
                    body = ready.json() if ready.status_code == 200 else {}
                    if body.get("prefill", 0) >= num_prefill and body.get("decode", 0) >= num_decode:
                        return
                except (httpx.HTTPError, ValueError):
                    pass
            time.sleep(0.3)
        logs = "\n".join(f"--- {p.name}\n{p.log()}" for p in self.procs.values())
        raise TimeoutError(f"stack not ready in {timeout_s}s\n{logs}")

    def wait_registered(self, count: int, registry: Any = None, timeout_s: float = 300.0) -> dict[str, Any]:
        """Until the registry (by default this stack's, without a key) lists ``count`` instances;
        they are returned by id. A process that exits meanwhile fails at once with its log."""
        from common.registry import Registry

        registry = registry or Registry(self.redis_url)
        deadline = time.monotonic() + timeout_s
        infos: dict[str, Any] = {}
        while len(infos) < count:
            assert time.monotonic() < deadline, "engines did not register"
            for proc in self.procs.values():
                assert proc.popen.poll() is None, proc.log()
            infos = {i.instance_id: i for i in registry.instances()}
            time.sleep(0.3)
        return infos

    def metrics(self, name: str) -> dict[str, float]:
        """The instance's Prometheus samples, summed over labels, by metric name."""
        text = httpx.get(f"http://127.0.0.1:{self.procs[name].metrics_port}/metrics", timeout=5).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, _, value = line.rpartition(" ")
            metric = key.split("{", 1)[0]
            values[metric] = values.get(metric, 0.0) + float(value)
        return values

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()


@contextlib.contextmanager
def prefill_decode_stack(
    redis_url: str, model: str, router_args: list[str] | None = None, decode_args: list[str] | None = None,
    prefill_args: list[str] | None = None, suffix: str = "a",
) -> Iterator[Stack]:
    """One prefill, one decode and a router, ready; stopped on leaving. ``suffix``: the instances' names'
    (``prefill-<suffix>``, ``decode-<suffix>``), other than another stack's in the same Redis."""
    s = Stack(redis_url=redis_url, model=model)
    s.start_engine("prefill", f"prefill-{suffix}", prefill_args)
    s.start_engine("decode", f"decode-{suffix}", decode_args)
    s.start_router(router_args)
    try:
        s.wait_ready(1, 1)
        yield s
    finally:
        s.stop()
