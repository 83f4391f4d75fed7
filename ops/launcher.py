"""``pdserve up``: the whole stack on one machine (Redis, prefill and decode engines, the router).

Resolves the model once (so a conversion happens once, not in every child), starts a private
``redis-server`` without persistence, then the services as child processes, waits until the
router's /ready answers 200 and prints the URL. It stops everything (SIGTERM, then SIGKILL after a
grace period) on Ctrl-C / SIGTERM, or as soon as any child exits, reporting its exit code.
Arguments it does not know are passed on to the engines.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from common.glibc_env import tuned_env

POLL_S = 0.2
PR_SET_PDEATHSIG = 1

ENGINE_FLAGS = ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description="Run Redis, engines and the router locally.")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill instances")
    p.add_argument("--decode", type=int, default=1, help="number of decode instances")
    p.add_argument("--model", default=None, help="checkpoint folder, .gguf file, or the default model's name")
    p.add_argument("--host", default="127.0.0.1", help="the router's HTTP host")
    p.add_argument("--port", type=int, default=8000, help="the router's HTTP port")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--block-size", type=int)
    p.add_argument("--kv-cache-memory")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--threads-per-engine", type=int, default=0,
                   help="torch CPU threads of each engine (0: the host's cores shared out, or OMP_NUM_THREADS)")
    p.add_argument("--api-key", action="append", default=[], help="router API key (repeatable)")
    p.add_argument("--routing-policy", default=None, help="router policy: prefix, least-loaded, round-robin")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--no-wait", action="store_true", help="do not wait for /ready before printing the URL")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /ready")
    p.add_argument("--grace-period", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--log-dir", default=None, help="write each child's output to DIR/NAME.log")
    p.add_argument(
        "--service-command",
        default=f"{shlex.quote(sys.executable)} -m common.cli",
        help="command that runs one service given its role and flags",
    )
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher itself is killed (Linux), so nothing is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: str | None = None

    def log_tail(self, num_chars: int = 3000) -> str:
        if self.log_path is None:
            return ""
        return Path(self.log_path).read_text(errors="replace")[-num_chars:]


class Launcher:
    def __init__(self, args: argparse.Namespace, engine_extra: list[str]) -> None:
        self.args = args
        self.engine_extra = engine_extra
        self.children: list[Child] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-")
        self.stopping = False

    def request_stop(self, signum: int, _frame: Any) -> None:
        self.stopping = True

    # -- starting ------------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        log: IO[bytes] | None = None
        log_path = None
        if self.args.log_dir:
            os.makedirs(self.args.log_dir, exist_ok=True)
            log_path = os.path.join(self.args.log_dir, f"{name}.log")
            log = open(log_path, "wb")  # noqa: SIM115 - the child keeps writing to it
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops children in order
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
        if log is not None:
            log.close()
        child = Child(name, popen, log_path)
        self.children.append(child)
        return child

    def start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found: install Redis or pass --redis-url")
        port = free_port()
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.spawn("redis", [*argv, "--dir", self._tmp.name, "--loglevel", "warning"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=0.5) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0"
            self.check_children()
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING within 10s")

    def engine_flags(self) -> list[str]:
        flags = []
        for name in ENGINE_FLAGS:
            value = getattr(self.args, name)
            if value is not None:
                flags += [f"--{name.replace('_', '-')}", str(value)]
        return [*flags, *self.engine_extra]

    def router_flags(self) -> list[str]:
        flags = [arg for key in self.args.api_key for arg in ("--api-key", key)]
        if self.args.routing_policy:
            flags += ["--routing-policy", self.args.routing_policy]
        if self.args.served_model_name:
            flags += ["--served-model-name", self.args.served_model_name]
        return flags

    def engine_env(self) -> dict[str, str]:
        """What the engines get beyond this environment: CPU threads and C-library settings.

        Torch CPU threads per engine: the cores shared out, so engines on one host do not
        oversubscribe. An explicit ``--threads-per-engine`` or ``OMP_NUM_THREADS`` wins. (On a
        GPU the engines hardly use CPU threads, and fewer of them only cut contention, as in
        vLLM's workers.) ``GLIBC_TUNABLES``: see ``common.glibc_env``.
        """
        env = tuned_env(os.environ)
        threads = self.args.threads_per_engine
        if threads == 0:
            if "OMP_NUM_THREADS" in os.environ:
                return env
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            threads = max(1, cores // max(1, self.args.prefill + self.args.decode))
        return {**env, "OMP_NUM_THREADS": str(threads)}

    def start_all(self, model: str) -> None:
        redis_url = self.args.redis_url or self.start_redis()
        service = shlex.split(self.args.service_command)
        engine_env = self.engine_env()
        for role, count in (("prefill", self.args.prefill), ("decode", self.args.decode)):
            for i in range(count):
                ports = [str(free_port()) for _ in range(3)]
                argv = [*service, role, "--model", model, "--redis-url", redis_url, "--host", "127.0.0.1"]
                argv += ["--port", ports[0], "--kv-port", ports[1], "--metrics-port", ports[2]]
                self.spawn(f"{role}-{i}", [*argv, "--instance-id", f"{role}-{i}", *self.engine_flags()], engine_env)
        argv = [*service, "router", "--model", model, "--redis-url", redis_url]
        self.spawn(
            "router", [*argv, "--host", self.args.host, "--port", str(self.args.port), *self.router_flags()]
        )

    # -- watching ------------------------------------------------------------------------------
    def check_children(self) -> None:
        """Raise ``ChildExited`` for the first child that is no longer running."""
        for child in self.children:
            code = child.popen.poll()
            if code is not None:
                raise ChildExited(child, code)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "::", "") else self.args.host
        return f"http://{host}:{self.args.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.args.ready_timeout
        while time.monotonic() < deadline and not self.stopping:
            self.check_children()
            with (
                contextlib.suppress(urllib.error.URLError, OSError, ValueError),
                urllib.request.urlopen(f"{self.url}/ready", timeout=2) as response,
            ):
                body = json.loads(response.read())
                # /ready is 200 once one decode instance serves; wait for every instance launched.
                if body.get("prefill", 0) >= self.args.prefill and body.get("decode", 0) >= self.args.decode:
                    return
            time.sleep(POLL_S)
        if not self.stopping:
            raise TimeoutError(
                f"the stack was not ready after {self.args.ready_timeout:.0f}s (GET {self.url}/ready)"
            )

    def supervise(self) -> None:
        while not self.stopping:
            self.check_children()
            time.sleep(POLL_S)

    # -- stopping ------------------------------------------------------------------------------
    def stop_all(self) -> None:
        """Router first, then engines, then Redis: SIGTERM, wait the grace period, SIGKILL."""
        router = [c for c in self.children if c.name == "router"]
        redis = [c for c in self.children if c.name == "redis"]
        engines = [c for c in self.children if c not in router and c not in redis]
        for group in (router, engines, redis):
            self._stop_group(group)
        self._tmp.cleanup()

    def _stop_group(self, group: list[Child]) -> None:
        for child in group:
            if child.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace_period
        for child in group:
            try:
                child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pdserve: {child.name} did not stop in time; killing it", file=sys.stderr)
                child.popen.kill()
                child.popen.wait()


class ChildExited(RuntimeError):
    def __init__(self, child: Child, code: int) -> None:
        super().__init__(f"{child.name} exited unexpectedly with code {code}")
        self.child = child
        self.code = code


def _resolve_model(model: str | None) -> str:
    from common.model.loader import resolve_model_path

    return str(resolve_model_path(model))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["up"]:
        argv = argv[1:]
    args, engine_extra = build_parser().parse_known_args(argv)
    if args.prefill < 0 or args.decode < 1:
        raise SystemExit("need --decode >= 1 and --prefill >= 0")
    if args.threads_per_engine < 0:
        raise SystemExit("need --threads-per-engine >= 0")
    print("pdserve: resolving the model (converted once, then cached)...", flush=True)
    model = _resolve_model(args.model)
    launcher = Launcher(args, engine_extra)
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    exit_code = 0
    try:
        launcher.start_all(model)
        if not args.no_wait:
            launcher.wait_ready()
        if not launcher.stopping:
            print(
                f"pdserve: ready at {launcher.url} (OpenAI base URL {launcher.url}/v1); Ctrl-C stops it",
                flush=True,
            )
        launcher.supervise()
    except ChildExited as exc:
        print(f"pdserve: {exc}; stopping everything", file=sys.stderr)
        tail = exc.child.log_tail()
        if tail:
            print(f"--- last output of {exc.child.name}:\n{tail}", file=sys.stderr)
        exit_code = exc.code if exc.code > 0 else 1
    except (TimeoutError, RuntimeError) as exc:
        print(f"pdserve: {exc}; stopping everything", file=sys.stderr)
        exit_code = 1
    finally:
        launcher.stop_all()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
