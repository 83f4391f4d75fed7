"""Faults injected into a running stack: kill -9 and SIGSTOP/SIGCONT of engine processes.

The stack's processes come from ``LOG_DIR/children.json``, which ``pdserve up --log-dir LOG_DIR``
keeps up to date (``{"prefill-0": {"pid": 123, "restarts": 0, "role": "prefill"}, ...}``); a killed
engine comes back under a new pid, which the next read picks up.

``FaultInjector`` runs in a thread: about every ``interval_s`` seconds (jittered by a seeded
generator) it kills one engine, except that one fault slot (the second by default) stops an engine
for ``stop_s`` seconds instead and then continues it. Faults are done one at a time, so nothing
is killed while an engine is stopped. It only ever picks an engine whose role keeps at least one
other instance serving, so the router always has somewhere to move a request.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENGINE_ROLES = ("prefill", "decode")
_READ_TRIES = 20


@dataclass(frozen=True)
class ChildInfo:
    name: str
    pid: int
    role: str
    restarts: int = 0


@dataclass
class Fault:
    """One injected fault; ``end_s`` is when a stopped engine was continued (``start_s`` for a kill)."""

    kind: str  # "kill" or "stop"
    target: str
    pid: int
    start_s: float
    end_s: float

    def overlaps(self, start_s: float, end_s: float) -> bool:
        """Whether the fault happened (or lasted into) the interval ``[start_s, end_s]``."""
        return self.start_s <= end_s and self.end_s >= start_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_children(data: Any) -> dict[str, ChildInfo]:
    """``children.json``'s content as ``{name: ChildInfo}``; malformed entries are skipped."""
    children = {}
    for name, entry in (data or {}).items() if isinstance(data, dict) else ():
        if isinstance(entry, dict) and isinstance(entry.get("pid"), int) and entry["pid"] > 0:
            children[name] = ChildInfo(name, entry["pid"], str(entry.get("role", "")), int(entry.get("restarts", 0)))
    return children


def read_children(path: str | Path) -> dict[str, ChildInfo]:
    """Read ``children.json``, retrying a moment if it is caught half-written; ``{}`` if absent."""
    for _ in range(_READ_TRIES):
        try:
            return parse_children(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            return {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            time.sleep(0.05)
    return {}


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    return True


def pick_target(
    children: Mapping[str, ChildInfo], rng: random.Random, is_alive: Callable[[int], bool],
    serving: Mapping[str, int] | None = None,
) -> ChildInfo | None:
    """A random live engine whose role has another instance to take over, or None.

    ``serving``: how many instances of each role the router currently serves with (its /ready); when
    unknown, the live engine processes of the role are counted instead.
    """
    live = [c for c in children.values() if c.role in ENGINE_ROLES and is_alive(c.pid)]
    counts = {role: sum(1 for c in live if c.role == role) for role in ENGINE_ROLES}
    if serving is not None:
        counts = {role: min(counts[role], serving.get(role, 0)) for role in ENGINE_ROLES}
    candidates = sorted((c for c in live if counts[c.role] >= 2), key=lambda c: c.name)
    return rng.choice(candidates) if candidates else None


def send_signal(pid: int, signum: int) -> bool:
    """Signal ``pid``; False when it is already gone."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


class FaultInjector:
    """Kills (and once stops) engines from a thread until ``stop()``; see the module docstring.

    Times in ``faults`` are seconds since ``zero`` (a ``time.monotonic()`` reading). ``stop()``
    may be called twice; it always continues an engine it left stopped.
    """

    def __init__(
        self, children_path: str | Path, interval_s: float, stop_s: float, seed: int, zero: float,
        serving: Callable[[], Mapping[str, int] | None] = lambda: None, stop_slot: int = 1,
        jitter: float = 0.25,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("the fault interval must be positive")
        self.children_path = Path(children_path)
        self.interval_s, self.stop_s, self.zero = interval_s, stop_s, zero
        self.serving = serving
        self.stop_slot = stop_slot if stop_s > 0 else -1
        self.jitter = jitter
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []
        self.num_skipped = 0  # slots where no engine could be spared
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-injector")

    def __enter__(self) -> FaultInjector:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join()

    def now(self) -> float:
        return time.monotonic() - self.zero

    def _run(self) -> None:
        slot = 0
        while not self._halt.wait(self.interval_s * self.rng.uniform(1 - self.jitter, 1 + self.jitter)):
            target = pick_target(read_children(self.children_path), self.rng, pid_alive, self.serving())
            if target is None:
                self.num_skipped += 1
            elif slot == self.stop_slot:
                self._stop_and_continue(target)
            else:
                self._kill(target)
            slot += 1 if target is not None else 0

    def _kill(self, target: ChildInfo) -> None:
        if send_signal(target.pid, signal.SIGKILL):
            t = self.now()
            self.faults.append(Fault("kill", target.name, target.pid, t, t))
            print(f"  fault t={t:.1f}s: kill -9 {target.name} (pid {target.pid})", flush=True)

    def _stop_and_continue(self, target: ChildInfo) -> None:
        if not send_signal(target.pid, signal.SIGSTOP):
            return
        fault = Fault("stop", target.name, target.pid, self.now(), self.now())
        self.faults.append(fault)
        print(f"  fault t={fault.start_s:.1f}s: SIGSTOP {target.name} (pid {target.pid}) for {self.stop_s:g}s",
              flush=True)
        try:
            self._halt.wait(self.stop_s)
        finally:
            send_signal(target.pid, signal.SIGCONT)
            fault.end_s = self.now()
            print(f"  fault t={fault.end_s:.1f}s: SIGCONT {target.name}", flush=True)


class RollingRestart:
    """A rolling update under load: SIGTERM every engine once, one at a time, from a thread.

    Each engine drains (finishes or hands back what it holds) and exits; ``pdserve up`` starts it
    again; the next one gets its SIGTERM only when the restarted one has a new pid and the router
    serves with as many instances as ``expected`` again. Same interface as ``FaultInjector``; a
    ``Fault`` of kind "term" spans each engine's SIGTERM to its return.
    """

    def __init__(
        self, children_path: str | Path, zero: float, serving: Callable[[], Mapping[str, int] | None],
        expected: Mapping[str, int], timeout_s: float = 300.0,
    ) -> None:
        self.children_path = Path(children_path)
        self.zero, self.serving, self.expected, self.timeout_s = zero, serving, dict(expected), timeout_s
        self.faults: list[Fault] = []
        self.num_skipped = 0  # engines that did not come back within the timeout
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rolling-restart")

    def __enter__(self) -> RollingRestart:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join()

    def now(self) -> float:
        return time.monotonic() - self.zero

    def _back(self, name: str, old_pid: int) -> bool:
        child = read_children(self.children_path).get(name)
        if child is None or child.pid == old_pid or not pid_alive(child.pid):
            return False
        serving = self.serving() or {}
        return all(serving.get(role, 0) >= n for role, n in self.expected.items() if role in ENGINE_ROLES)

    def _run(self) -> None:
        children = read_children(self.children_path)
        for name in sorted(n for n, c in children.items() if c.role in ENGINE_ROLES):
            child = read_children(self.children_path).get(name)
            if self._halt.is_set() or child is None or not send_signal(child.pid, signal.SIGTERM):
                continue
            t = self.now()
            fault = Fault("term", name, child.pid, t, t)
            self.faults.append(fault)
            print(f"  fault t={t:.1f}s: SIGTERM {name} (pid {child.pid}), rolling restart", flush=True)
            deadline = time.monotonic() + self.timeout_s
            while not self._back(name, child.pid):
                if self._halt.wait(0.2) or time.monotonic() > deadline:
                    self.num_skipped += 1
                    break
            fault.end_s = self.now()
            print(f"  fault t={fault.end_s:.1f}s: {name} is back", flush=True)
