"""``pdserve up`` with a stand-in service command: starts, serves, stops everything, reports deaths."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port
from tests.router.router_harness import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tokenizer_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Tokenizer files plus a config.json: enough of a checkpoint folder for the router."""
    out = tmp_path_factory.mktemp("model")
    for item in tokenizer_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out / item.name)
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    return out


def _launch(
    model_dir: pathlib.Path, port: int, log_dir: pathlib.Path, env: dict[str, str], num_prefill: int = 1
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "ops.launcher", "up", "--prefill", str(num_prefill), "--decode", "1"]
    argv += ["--model", str(model_dir), "--port", str(port), "--log-dir", str(log_dir), "--grace-period", "5"]
    argv += ["--service-command", f"{sys.executable} -m tests.router.fake_cli", "--ready-timeout", "60"]
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def launched(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    proc = _launch(model_dir, port, tmp_path, {})
    yield proc, port
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_up_serves_then_sigterm_stops_every_child(launched: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = launched
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    assert proc.stdout is not None
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    assert wait_until(lambda: any("ready at" in line for line in lines), 60), lines
    assert _ready(url)
    children = _children_of(proc.pid)
    assert len(children) == 4  # redis, prefill-0, decode-0, router
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=10)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert wait_until(lambda: not any(_alive(pid) for pid in children), 10)


def test_up_without_prefill_instances_serves_from_decode(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    port = free_port()
    proc = _launch(model_dir, port, tmp_path, {}, num_prefill=0)
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
        assert wait_until(lambda: any("ready at" in line for line in lines), 60), lines
        assert len(_children_of(proc.pid)) == 3  # redis, decode-0, router
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                              timeout=10)
        assert response.status_code == 200, response.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_child_that_dies_is_named_and_everything_stops(
    model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    proc = _launch(model_dir, free_port(), tmp_path, {"FAKE_CLI_EXIT": "decode-0"})
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3
    assert "decode-0 exited unexpectedly with code 3" in stderr
    assert _processes_mentioning(str(model_dir)) == []  # the router, prefill-0 and redis were stopped


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and not line.lstrip().startswith("Z")]


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = pathlib.Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def test_engines_share_the_cores_unless_threads_are_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    from ops.launcher import Launcher, build_parser

    def launcher(*argv: str) -> Launcher:
        args, extra = build_parser().parse_known_args(["--log-dir", str(tmp_path), *argv])
        return Launcher(args, extra)

    def threads(*argv: str) -> str | None:
        return launcher(*argv).engine_env().get("OMP_NUM_THREADS")

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    assert threads("--prefill", "1", "--decode", "1") == "4"
    assert threads("--prefill", "2", "--decode", "3") == "1"
    assert threads("--threads-per-engine", "3") == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads() is None  # the user's setting reaches the engines as it is
    child = launcher().spawn("probe", ["sh", "-c", "echo threads=$OMP_NUM_THREADS"], {"OMP_NUM_THREADS": "5"})
    child.popen.wait(timeout=10)
    assert (tmp_path / "probe.log").read_text().strip() == "threads=5"


def test_engines_get_the_c_library_settings_and_keep_the_users(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    from common.glibc_env import TUNABLES
    from ops.launcher import Launcher, build_parser

    args, extra = build_parser().parse_known_args(["--log-dir", str(tmp_path)])
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096:glibc.malloc.arena_max=2")
    tunables = Launcher(args, extra).engine_env()["GLIBC_TUNABLES"].split(":")
    assert tunables[:2] == ["glibc.malloc.mmap_threshold=4096", "glibc.malloc.arena_max=2"]
    assert sorted(tunables[2:]) == sorted(
        f"{name}={value}" for name, value in TUNABLES.items() if name != "glibc.malloc.mmap_threshold"
    )
