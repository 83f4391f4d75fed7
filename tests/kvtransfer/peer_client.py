"""Starts ``tests.kvtransfer.peer`` as a separate process and talks to it in JSON lines."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class PeerProcess:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kvtransfer.peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            text=True,
        )
        self._read(timeout_s=60.0)  # {"ready": true} once torch and zmq are imported

    def _read(self, timeout_s: float) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError("peer process did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process exited with {self.proc.wait()}")
        return json.loads(line)

    def call(self, op: str, timeout_s: float = 30.0, **args: Any) -> Any:
        """Run one command in the peer; raises ``RuntimeError`` with the peer's error."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout_s)
        if not reply["ok"]:
            raise RuntimeError(reply["error"])
        return reply["value"]

    def wait_results(self, name: str, count: int = 1, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Results of ``name`` until ``count`` arrived; ``TimeoutError`` otherwise."""
        results: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while len(results) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: {len(results)} of {count} results after {timeout_s}s")
            results += self.call("results", name=name)
            time.sleep(0.01)
        return results

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
