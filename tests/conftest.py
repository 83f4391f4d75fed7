"""Shared fixtures: a real ``redis-server`` (never a mock) on a free local port, without persistence."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

import pytest
import redis

from ops.launcher import die_with_parent

# The suite runs on CPUs: Triton kernels run under Triton's interpreter (tests/kernels/conftest.py).
# Set before any test module is collected, because whichever module first imports triton (say,
# through transformers while a model is converted) fixes how triton's own library functions are
# decorated; tests that compile for a GPU start a process without it.
os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ["TRITON_INTERPRET"] == "1" and not os.environ.get("PDSERVE_TEST_PLAIN_INTERPRETER"):
    from tests.triton_interpreter import install as _install_interpreter_patch

    _install_interpreter_patch()  # the language patched once per launch, not at every helper call


def collect_lines(stream: IO[str] | None) -> list[str]:
    """The lines of ``stream`` as they arrive (a reader thread keeps the pipe from filling up)."""
    assert stream is not None
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(stream), daemon=True).start()
    return lines


_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
# Under pytest-xdist each worker takes ports from its own range below the kernel's ephemeral range
# (from 32768), so a port one worker frees (an engine restarted on its port) is not handed to another
# worker meanwhile, as ``bind(0)`` could; one process alone takes what ``bind(0)`` gives.
_PORT_RANGE = (
    range(10_000 + 2_000 * int(_WORKER[2:]), 12_000 + 2_000 * int(_WORKER[2:]))
    if _WORKER.startswith("gw") and _WORKER[2:].isdigit() and int(_WORKER[2:]) < 10 else None
)
_next_port = [0]


def free_port() -> int:
    if _PORT_RANGE is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    for _ in range(len(_PORT_RANGE)):
        port = _PORT_RANGE[_next_port[0] % len(_PORT_RANGE)]
        _next_port[0] += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


class RedisServer:
    """A throw-away ``redis-server`` process: no RDB snapshots, no AOF, loopback only; with a
    ``password``, it requires it (``--requirepass``) and ``url`` carries it."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.port = port or free_port()
        self.password = password
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="redis-test-")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--requirepass", password] if password else []
        args += ["--dir", self._dir.name, "--loglevel", "warning"]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
            raise RuntimeError("redis-server did not become ready")
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._dir.cleanup()


@pytest.fixture(scope="session", autouse=True)
def _run_shared_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``PDSERVE_TEST_SHARED_DIR``: a folder every test process of this run sees (under pytest-xdist, the
    parent of the workers' base temp folders), for results one process computes for all, such as
    transformers' reference outputs (``tests/engine/conftest.py``); pytest prunes it with its temp folders.
    ``PDSERVE_TEST_TMP``: this process's base temp folder, for what a test keeps past its own ``tmp_path``
    (service logs, read in a failure's message), pruned the same way rather than left in the system's."""
    base = tmp_path_factory.getbasetemp()
    os.environ["PDSERVE_TEST_TMP"] = str(base)
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ["PDSERVE_TEST_SHARED_DIR"] = str(shared / "shared")
    (shared / "shared").mkdir(exist_ok=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real redis-server shared by the whole session; use your own key namespace."""
    server = RedisServer()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def private_redis_url() -> Iterator[str]:
    """URL of a redis-server of the test's own: a router sees every instance registered in its Redis, so a
    stack beside another still up (a module's) needs its own."""
    server = RedisServer()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def make_redis_server() -> Iterator[Callable[..., RedisServer]]:
    """Factory for private redis-servers a test may kill and restart (all stopped afterwards)."""
    servers: list[RedisServer] = []

    def make(port: int | None = None, password: str | None = None) -> RedisServer:
        server = RedisServer(port, password)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


# The slowest test files first, longest first (tens of seconds each on a 2-core host): pytest-xdist hands whole
# files to its processes in collection order, and a long file handed out last (collection is alphabetical:
# tests/security comes last) keeps one process busy after the other has run out of work.
SLOW_FILES_FIRST = (
    "tests/engine/test_cuda_graphs.py", "tests/e2e/test_fault_tolerance.py", "tests/engine/test_sampling.py",
    "tests/engine/test_structured_output.py", "tests/engine/test_async_scheduling.py",
    "tests/engine/test_spec_decode.py", "tests/engine/test_greedy_matches_transformers.py",
    "tests/e2e/test_stack.py", "tests/e2e/test_model_families_cli.py", "tests/e2e/test_structured_output_stack.py",
    "tests/engine/test_prompt_logprobs.py", "tests/security/test_schemathesis.py", "tests/e2e/test_redis_outage.py",
    "tests/kernels/test_gpu_bench_script.py", "tests/engine/test_tensor_parallel.py", "tests/security/test_flood.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the collected tests with ``SLOW_FILES_FIRST`` ahead (a stable sort: each file's tests, and the
    other files, keep their order)."""
    rank = {path: i for i, path in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
