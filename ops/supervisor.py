"""Keeping child processes running: restart what dies, with back-off, and know when to stop trying.

``RestartPolicy`` and ``RestartTracker`` are pure (the caller passes the clock) so the rules can be
tested without processes. A child that dies is started again with the same argv and environment
after a delay that doubles from ``initial_delay_s`` up to ``max_delay_s``; a run that lasted
``window_s`` resets the delay. More than ``max_restarts`` deaths in a row, each within ``window_s``
of its start, is a crash loop: ``Supervisor.poll`` then raises ``ChildExited`` for a child the
caller says cannot go on (the launcher: the router always, any child before the stack was ready).

The window is measured on each run's uptime rather than on the wall clock, because the back-off
itself spreads deaths out: with delays of 1, 2, 4, 8 and 16 s, six deaths never fit in a 60 s
wall-clock window once a start takes a few seconds, and a crash loop would go on for ever.

With a state file, ``Supervisor`` rewrites it atomically after every (re)start:
``{name: {"pid": int, "restarts": int, "role": str}}``; tools (a chaos benchmark) read it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from common.files import write_atomically

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay_s: float = 1.0
    max_delay_s: float = 30.0
    window_s: float = 60.0
    max_restarts: int = 5

    def __post_init__(self) -> None:
        if self.initial_delay_s <= 0 or self.window_s <= 0 or self.max_restarts < 0:
            raise ValueError("need initial_delay_s > 0, window_s > 0 and max_restarts >= 0")

    def delay_s(self, num_deaths_in_a_row: int) -> float:
        """Back-off before the next start after the ``num_deaths_in_a_row``-th death (1-based)."""
        cap = max(self.max_delay_s, self.initial_delay_s)
        return min(cap, self.initial_delay_s * 2.0 ** min(num_deaths_in_a_row - 1, 62))


class RestartTracker:
    """One child's run history under a policy. Pure: every method takes the time instead of reading it."""

    def __init__(self, policy: RestartPolicy, now: float) -> None:
        self.policy = policy
        self.started_at = now
        self.num_restarts = 0
        self.num_deaths_in_a_row = 0  # deaths since the child last stayed up for window_s

    def died(self, now: float) -> float:
        """Record the end of the current run; returns the delay before the next start. Once per run."""
        if now - self.started_at >= self.policy.window_s:
            self.num_deaths_in_a_row = 0
        self.num_deaths_in_a_row += 1
        return self.policy.delay_s(self.num_deaths_in_a_row)

    @property
    def crash_looping(self) -> bool:
        return self.num_deaths_in_a_row > self.policy.max_restarts

    def restarted(self, now: float) -> None:
        self.num_restarts += 1
        self.started_at = now


def describe_exit(returncode: int) -> str:
    """``code 3`` or ``signal SIGKILL`` (Popen reports a signal as a negative return code)."""
    if returncode >= 0:
        return f"code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher itself is killed (Linux), so nothing is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """One supervised process: what it takes to start it again, its current run and its history.

    ``env`` is the whole environment, captured at the first start, so a restart gets the same one
    even if the parent's environment changed since.
    """

    name: str
    role: str
    argv: list[str]
    env: dict[str, str]
    log_path: str | None
    tracker: RestartTracker
    popen: subprocess.Popen[bytes] = field(init=False)
    restart_at: float | None = None  # set while dead and waiting out the back-off

    def start(self, append_log: bool) -> None:
        """Start a run. Output goes to ``log_path`` (truncated on the first run, appended to after)."""
        log: IO[bytes] | None = None
        if self.log_path is not None:
            log = open(self.log_path, "ab" if append_log else "wb")  # noqa: SIM115 - the child keeps it
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                env=self.env,
                start_new_session=True,  # Ctrl-C reaches the launcher only; it stops children in order
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
            )
        finally:
            if log is not None:
                log.close()

    def log_tail(self, num_chars: int = 3000) -> str:
        if self.log_path is None or not os.path.exists(self.log_path):
            return ""
        return Path(self.log_path).read_text(errors="replace")[-num_chars:]


class ChildExited(RuntimeError):
    """A child died and will not be restarted; ``code`` is its last return code."""

    def __init__(self, child: Child, code: int, reason: str) -> None:
        super().__init__(reason)
        self.child = child
        self.code = code


class Supervisor:
    """Starts children and keeps them running. ``poll`` never blocks; call it from a loop."""

    def __init__(
        self, policy: RestartPolicy, log_dir: str | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policy = policy
        self.log_dir = log_dir
        self.state_path = os.path.join(log_dir, "children.json") if log_dir else None
        self.clock = clock
        self.children: list[Child] = []

    def start(self, name: str, role: str, argv: list[str], env: dict[str, str]) -> Child:
        """Start a new child with ``env`` on top of this process's environment."""
        log_path = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            log_path = os.path.join(self.log_dir, f"{name}.log")
        tracker = RestartTracker(self.policy, self.clock())
        child = Child(name, role, list(argv), {**os.environ, **env}, log_path, tracker)
        child.start(append_log=False)
        self.children.append(child)
        self.write_state()
        return child

    def poll(self, cannot_go_on: Callable[[Child], bool]) -> None:
        """Note deaths and restart children whose back-off has passed.

        Raises ``ChildExited`` for a crash-looping child for which ``cannot_go_on`` is true; the
        caller stops the rest. Every other death and restart is reported on stderr.
        """
        now = self.clock()
        for child in self.children:
            if child.restart_at is None:
                code = child.popen.poll()
                if code is not None:
                    self._note_death(child, code, now, cannot_go_on)
            elif now >= child.restart_at:
                child.start(append_log=True)
                child.restart_at = None
                child.tracker.restarted(now)
                _log(f"{child.name} restarted (restart {child.tracker.num_restarts}, pid {child.popen.pid})")
                self.write_state()

    def _note_death(self, child: Child, code: int, now: float, cannot_go_on: Callable[[Child], bool]) -> None:
        delay_s = child.tracker.died(now)
        if child.tracker.crash_looping and cannot_go_on(child):
            raise ChildExited(
                child,
                code,
                f"{child.name} died {child.tracker.num_deaths_in_a_row} times in a row, each within "
                f"{self.policy.window_s:g}s of starting (last: {describe_exit(code)}); not restarting it",
            )
        child.restart_at = now + delay_s
        _log(
            f"{child.name} (pid {child.popen.pid}) died with {describe_exit(code)}; "
            f"restart {child.tracker.num_restarts + 1} in {delay_s:g}s"
        )
        tail = child.log_tail(2000)
        if tail:
            print(f"--- last output of {child.name}:\n{tail}", file=sys.stderr, flush=True)

    def write_state(self) -> None:
        """Atomically replace the state file (if any) with every child's pid, restart count and role."""
        if self.state_path is None:
            return
        state = {
            c.name: {"pid": c.popen.pid, "restarts": c.tracker.num_restarts, "role": c.role} for c in self.children
        }
        write_atomically(self.state_path, json.dumps(state, indent=1))


def _log(message: str) -> None:
    print(f"pdserve: {message}", file=sys.stderr, flush=True)
