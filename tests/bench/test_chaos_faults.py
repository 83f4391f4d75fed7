"""The chaos bench's fault injector against real processes (``sleep``), killed and stopped for real."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.bench.chaos_faults import FaultInjector, pid_alive
from ops.bench.chaos_stack import UpStack

NAMES = (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"),
         ("router", "router"), ("redis", "redis"))


def proc_state(pid: int) -> str:
    """The one-letter state in /proc (``T`` stopped, ``S`` sleeping, ``Z`` zombie); ``-`` when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "-"
    return stat[stat.rindex(")") + 2]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Path, dict[str, subprocess.Popen[bytes]]]]:
    """Six ``sleep 60`` processes named like a stack's children, and a children.json naming them."""
    procs = {name: subprocess.Popen(["sleep", "60"]) for name, _ in NAMES}
    path = tmp_path / "children.json"
    path.write_text(json.dumps({name: {"pid": procs[name].pid, "restarts": 0, "role": role} for name, role in NAMES}))
    yield path, procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def test_injector_kills_stops_and_continues_engines_and_spares_the_last_of_each_role(
    stack: tuple[Path, dict[str, subprocess.Popen[bytes]]],
) -> None:
    path, procs = stack
    pids = {proc.pid: name for name, proc in procs.items()}
    seen_stopped: set[str] = set()
    seen_continued: set[str] = set()  # sleeping again after having been seen stopped
    zero = time.monotonic()
    stop_s = 1.5  # long enough for this loop to see the stop on a loaded host

    def done(injector: FaultInjector) -> bool:
        faults = injector.faults
        return len(faults) == 3 and faults[1].end_s > faults[1].start_s and injector.num_skipped > 0

    with FaultInjector(path, interval_s=0.15, stop_s=stop_s, seed=1, zero=zero) as injector:
        deadline = time.monotonic() + 60
        while not done(injector):
            assert time.monotonic() < deadline, injector.faults
            states = {name: proc_state(pid) for pid, name in pids.items()}
            seen_continued |= {name for name in seen_stopped if states[name] in ("S", "R")}
            seen_stopped |= {name for name, state in states.items() if state == "T"}
            time.sleep(0.01)
        stop = injector.faults[1]
        while stop.target not in seen_continued and proc_state(procs[stop.target].pid) != "-":
            assert time.monotonic() < deadline
            seen_continued |= {stop.target} if proc_state(procs[stop.target].pid) in ("S", "R") else set()
            time.sleep(0.01)
    faults = injector.faults
    assert [f.kind for f in faults] == ["kill", "stop", "kill"]
    kills = [f.target for f in faults if f.kind == "kill"]
    # nothing restarts here, so after one kill per role no role has an instance to spare
    assert sorted(n.split("-")[0] for n in kills) == ["decode", "prefill"]
    for name in kills:
        assert procs[name].wait(timeout=5) == -9
    assert seen_stopped == {stop.target}
    # continued, as seen here, unless the last kill took it before this loop looked again
    assert seen_continued == {stop.target} or faults[2].target == stop.target
    assert stop.end_s - stop.start_s >= stop_s  # stopped for the whole stall, then continued
    assert faults[2].start_s >= stop.end_s  # one fault at a time: nothing killed during the stall
    for name in ("router", "redis"):
        assert procs[name].poll() is None


def test_stopping_the_injector_during_a_stall_continues_the_stopped_engine(
    stack: tuple[Path, dict[str, subprocess.Popen[bytes]]],
) -> None:
    path, procs = stack
    injector = FaultInjector(path, interval_s=0.05, stop_s=60.0, seed=0, zero=time.monotonic(), stop_slot=0)
    with injector:
        deadline = time.monotonic() + 60
        while not injector.faults and time.monotonic() < deadline:
            time.sleep(0.01)
        assert injector.faults and injector.faults[0].kind == "stop"
        target = procs[injector.faults[0].target]
        while proc_state(target.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc_state(target.pid) == "T"
        began = time.monotonic()
    assert time.monotonic() - began < 30  # not the 60 s stall: stopping the injector ends it
    assert proc_state(target.pid) in ("S", "R") and injector.faults[0].end_s < 60
    injector.stop()  # a second stop is harmless


def test_the_injector_uses_the_pids_children_json_holds_now(
    stack: tuple[Path, dict[str, subprocess.Popen[bytes]]],
) -> None:
    """A restarted engine appears under a new pid; the injector targets that one, never the old."""
    path, procs = stack
    replacement = subprocess.Popen(["sleep", "60"])
    try:
        path.write_text(json.dumps({
            "decode-0": {"pid": procs["decode-0"].pid, "restarts": 0, "role": "decode"},
            "decode-1": {"pid": replacement.pid, "restarts": 1, "role": "decode"},
        }))
        with FaultInjector(path, interval_s=0.05, stop_s=0.0, seed=0, zero=time.monotonic()) as injector:
            deadline = time.monotonic() + 60
            while not injector.faults and time.monotonic() < deadline:
                time.sleep(0.01)
        killed = injector.faults[0]
        by_pid = {procs["decode-0"].pid: procs["decode-0"], replacement.pid: replacement}
        assert killed.kind == "kill" and by_pid[killed.pid].wait(timeout=5) == -9
        assert len(injector.faults) == 1  # then decode has no instance to spare
        assert procs["decode-1"].poll() is None  # the old pid of decode-1 is never touched
    finally:
        replacement.kill()
        replacement.wait()


def test_pid_alive_tells_running_from_reaped_and_zombie_processes() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    assert pid_alive(proc.pid)
    proc.kill()
    deadline = time.monotonic() + 5
    while proc_state(proc.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pid_alive(proc.pid)  # a zombie is dead
    proc.wait()
    assert not pid_alive(proc.pid)


def test_up_stack_reports_a_launcher_that_exits_before_ready(tmp_path: Path) -> None:
    up = UpStack(2, 2, "model", tmp_path / "logs", [], ready_timeout_s=30)
    up.argv = [sys.executable, "-c", "print('no redis here'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"exited with code 3:\nno redis here"), up:
        pass


def test_rolling_restart_terms_each_engine_once_and_waits_for_its_return(
    stack: tuple[Path, dict[str, subprocess.Popen[bytes]]],
) -> None:
    """A stand-in launcher restarts each engine that exits; the next SIGTERM waits for that."""
    path, procs = stack
    serving = {"prefill": 2, "decode": 2}
    restarted: list[str] = []

    def supervise() -> None:  # what ``pdserve up`` does: a new pid in children.json
        data = json.loads(path.read_text())
        for name, proc in list(procs.items()):
            if proc.poll() is not None and name not in ("router", "redis"):
                procs[name] = subprocess.Popen(["sleep", "60"])
                data[name]["pid"] = procs[name].pid
                restarted.append(name)
        path.write_text(json.dumps(data))

    from ops.bench.chaos_faults import RollingRestart

    with RollingRestart(path, zero=time.monotonic(), serving=lambda: serving, expected=serving) as rolling:
        deadline = time.monotonic() + 60
        while len(rolling.faults) < 4 or rolling.faults[-1].end_s == rolling.faults[-1].start_s:
            assert time.monotonic() < deadline, rolling.faults
            supervise()
            time.sleep(0.05)
    assert [f.kind for f in rolling.faults] == ["term"] * 4
    assert [f.target for f in rolling.faults] == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert restarted == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    for earlier, later in zip(rolling.faults, rolling.faults[1:], strict=False):
        assert later.start_s >= earlier.end_s  # one at a time
    assert rolling.num_skipped == 0
    assert procs["router"].poll() is None and procs["redis"].poll() is None
