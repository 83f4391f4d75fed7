"""``pdserve bench overhead router``: the router's own cost per streamed token, engines taken out.

The router (``pdserve router --workers W``, real processes, one port) serves streaming
``/v1/completions`` in front of fake decode engines (``ops.bench.fake_stream_engine``) that register
in a real ``redis-server`` and answer over real ZMQ as fast as the router takes it: each step they
send one token to every stream they hold, at most ``--window`` steps ahead of what the client has
received (so the figures measure the router, not a queue in front of it). The client reads each SSE
stream over a raw HTTP/1.1 connection, in the event loop's reader callbacks, and counts tokens by
their text (every token is " hello").

For every ``--concurrency`` C and ``--workers`` W it reports:

* tokens/s: tokens that reached the client while all C streams were streaming (from the last
  stream's first token to the first stream's last), per router process (the total over W);
* added latency per token, p50 / p99 (and p999, max in the JSON): when the router's write of a token reached the client's
  socket (the kernel's receive time stamp, ``SO_TIMESTAMPNS``) minus when the engine sent it (the one
  host clock), over every token of the point; "steady p99", over the tokens of the steady window
  only (below), without the steps where all C streams start or end together; and "read p99", to
  when the client's Python read it. The gap between the first and the last is the client's own
  delay: one process reading every stream, beside the router on the same cores, reaches the last
  socket of a 512-token step milliseconds late. Where the kernel stamps nothing (not Linux), both
  are the read time. Reports before this change
  (2026-12-02) have only the read time, as ``added_latency_ms``;
* router CPU per token: CPU time of the router process(es) (their CPU-time clocks on Linux, else
  ``psutil``) over that same window, divided by its tokens;
* the router's garbage collections during the point, from its ``/metrics``: how many, their time in
  all and the bucket bound the longest stayed under, by whether the router chose the moment
  (``paced``: after an engine message's outputs were sent) or an allocation did (``automatic``);
* the router's pass over each engine message, from its ``/metrics``: how many, the mean, and the
  bucket bound the longest stayed under; from reading the message to its last output handed on, so
  the last stream of an engine step waits that long (the p99 of a point where every message carries
  C outputs is about this pass);
* tokens per SSE event: 1 (or the stream interval) unless the router fell behind and sent the
  tokens that queued up for a stream as one event.
* the host's CPU time taken by the hypervisor over the window (``/proc/stat``'s steal), for all
  CPUs and each, overall and the most of any 100 ms: on a shared virtual machine a router that was
  runnable waits that long, so a point's tail can be the host's rather than the router's.

``--rates R1,R2`` adds open-loop points: at every concurrency C and rate R, each engine steps every
C / R seconds (times the stream interval) whatever the client has read, R tokens/s offered in all,
as a real engine's steps come. The router then either keeps up, and the added latency is its own
at that load, or falls behind, and the latency grows with the run. The closed-loop points measure
what a router process can stream at most; these say how much of it can be used within a latency
target.

``--arrivals together,staggered`` also runs each open-loop point with the streams' starts spread:
C slots, the first stream of slot i starting i / C of a stream's lifetime (``max_tokens`` at the
offered rate) after the first slot's, each slot starting a new stream as its last ends and none
after two lifetimes. C streams run at once with arrivals and ends spread over time, as a service at
that concurrency sees them, and the point's figures are those of the second lifetime: every token
received in it, the first tokens of the streams that started in it included. With ``together``
(the default) all C streams start in the same instant, and their first tokens wait behind C
requests being admitted at once: the p99 over all of a point's tokens then measures that herd.

``--pin-router`` gives each router process a core of its own and the client and engines the
others, as a deployment would (the router's neighbours then take no time from it); it needs more
cores than router processes, and the report says where it could not.

``--client-poll-ms MS`` has the client read its streams every MS ms instead of as each has data.
A client waiting on its sockets on the same host is woken by each of the router's writes, and the
wake-up is paid inside the router's write (polling took about a third off the router's CPU per
token in the open-loop points on the 2-core host of the README's figures). A remote client costs
the router no such thing. Polling leaves no wait on the sockets; the added latency still counts from the kernel's
receive stamps, which polling does not move (only "read p99" grows, by up to MS).

``--engine-modes batched,per-request`` also runs the engines the old way, one ZMQ message per
request per step, in the same invocation. ``--stream-interval K`` has the engines send K tokens per
output, as engines run with ``pdserve decode --stream-interval K`` do (the target is not judged
then). ``--router-pythonpath DIR`` runs the router from another source tree (say, an export of
the previous commit) to compare router code; an old router only understands ``per-request``
engines.

    pdserve bench overhead router --concurrency 1,16,64,256,512,1024 --workers 1,2
    pdserve bench overhead router --concurrency 512 --workers 1 --engine-modes batched --rates 5000,10000,20000
    pdserve bench overhead router --concurrency 512 --workers 1 --engine-modes batched --rates 20000 \
        --arrivals together,staggered --pin-router --client-poll-ms 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import selectors
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from ops.bench.environ import LogFolder
from ops.bench.fake_stream_engine import EngineLink, FakeStreamEngine, StreamEngineConfig
from ops.bench.host_speed import CpuTicks, cpu_ticks, describe, describe_steal, host_speed, steal_during
from ops.launcher import die_with_parent, free_port

RESULTS_DIR = Path(__file__).parent / "results"
TOKEN_TEXT = " hello"
MARKER = TOKEN_TEXT.encode()
EVENT = b"data: "  # as long as MARKER: the carry between reads serves both
ENGINE_MODES = ("batched", "per-request")
# The target: tokens/s per router process at 512 streams, with the p99 added per token.
TARGET_TOKENS_PER_S = 20_000
TARGET_P99_MS = 5.0
TARGET_CONCURRENCY = 512
ARRIVALS = ("together", "staggered")
ENGINE_MESSAGE = "engine message"
# Histograms read from the router's /metrics, each under its key (None: the "when" label, paced or
# automatic, for the garbage collections).
_SCRAPED: dict[str, str | None] = {
    "pdserve:router_gc_pause_seconds": None,
    "pdserve:router_engine_message_seconds": ENGINE_MESSAGE,
}
STAGGERED_LIFETIMES = 2  # staggered: streams start until then (the first lifetime ramps up, the second is measured)


# ---------------------------------------------------------------------------------- processes
def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    """A throw-away ``redis-server`` on a free loopback port, no persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install Redis")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=0.5)
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return proc, url
            except redis.ConnectionError:
                time.sleep(0.05)
    finally:
        client.close()
    proc.kill()
    raise RuntimeError("redis-server did not answer PING within 10s")


class RouterProcess:
    """``pdserve router --workers W`` on a free port; ``pids`` are the processes that serve."""

    def __init__(self, workers: int, redis_url: str, namespace: str, pythonpath: str | None,
                 log_path: Path) -> None:
        self.workers = workers
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        cwd = None
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
            cwd = pythonpath
        argv = [
            sys.executable, "-m", "common.cli", "router", "--port", str(self.port),
            *(["--workers", str(workers)] if workers > 1 else []), "--redis-url", redis_url, "--namespace", namespace, "--served-model-name", "bench",
            # Every stream goes out at once: the fair queue's per-instance window is not measured here.
            "--max-requests-per-instance", "4096", "--max-inflight", "0", "--log-level", "warning",
        ]
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Until /ready answers 200 many times in a row (every worker sees the engines)."""
        deadline = time.monotonic() + timeout_s
        in_a_row = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited with code {self.proc.returncode}")
            try:
                ok = httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                ok = False
            in_a_row = in_a_row + 1 if ok else 0
            if in_a_row >= 10 * self.workers and len(self.pids()) == self.workers:
                return
            time.sleep(0.05)
        raise RuntimeError("the router did not become ready")

    def pids(self) -> list[int]:
        if self.workers == 1:
            return [self.proc.pid]
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children()]
        except psutil.Error:
            return []

    def histograms(self) -> dict[str, dict[str, Any]]:
        """The router's garbage collection pauses so far (one process's, with several), by whether it
        chose the moment (``paced``) or an allocation did, and its passes over engine messages
        (``engine message``): count, seconds in all, and each bucket's count; empty for a router
        that does not export them."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        from prometheus_client.parser import text_string_to_metric_families

        found: dict[str, dict[str, Any]] = {}
        for family in text_string_to_metric_families(text):
            if family.name not in _SCRAPED:
                continue
            for sample in family.samples:
                key = _SCRAPED[family.name] or sample.labels["when"]
                entry = found.setdefault(key, {"count": 0, "seconds": 0.0, "buckets": {}})
                if sample.name.endswith("_count"):
                    entry["count"] = sample.value
                elif sample.name.endswith("_sum"):
                    entry["seconds"] = sample.value
                elif sample.name.endswith("_bucket"):
                    entry["buckets"][float(sample.labels["le"])] = sample.value
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _process_cpu_clock(pid: int) -> int | None:
    """The id of ``pid``'s CPU-time clock (all its threads, to the nanosecond), as glibc's
    ``clock_getcpuclockid`` makes it on Linux; None elsewhere, or where it cannot be read."""
    if sys.platform != "linux":
        return None
    clock = (~pid << 3) | 2  # CPUCLOCK_SCHED of the process
    try:
        time.clock_gettime(clock)
    except OSError:
        return None
    return clock


class CpuSampler(threading.Thread):
    """Samples the summed user + system CPU seconds of ``pids`` every ``interval_s``: from each
    process's CPU-time clock where Linux gives one, else from ``psutil`` (in clock ticks, 10 ms, too
    coarse for a short point). Each sample also reads the host's per-CPU steal counters
    (``host_speed.cpu_ticks``), so a point can say how much of its window the hypervisor took."""

    def __init__(self, pids: list[int], interval_s: float = 0.02) -> None:
        super().__init__(name="cpu-sampler", daemon=True)
        self._procs = [(psutil.Process(pid), _process_cpu_clock(pid)) for pid in pids]
        self._interval_s = interval_s
        self._done = threading.Event()
        self.samples: list[tuple[float, float]] = []
        self.host: list[tuple[float, CpuTicks]] = []

    def _read(self) -> float:
        """The sum now; the last sum again once a process is gone (its time can no longer be read)."""
        total = 0.0
        try:
            for proc, clock in self._procs:
                if clock is not None:
                    total += time.clock_gettime(clock)
                else:
                    times = proc.cpu_times()
                    total += times.user + times.system
        except (OSError, psutil.Error):
            return self.samples[-1][1] if self.samples else 0.0
        return total

    def _sample(self) -> None:
        now = time.monotonic()
        self.samples.append((now, self._read()))
        self.host.append((now, cpu_ticks()))

    def run(self) -> None:
        while not self._done.is_set():
            self._sample()
            self._done.wait(self._interval_s)
        self._sample()

    def stop(self) -> None:
        self._done.set()
        self.join()

    def at(self, t: float) -> float:
        """CPU seconds at time ``t``, linearly between the samples around it."""
        samples = self.samples
        for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False):
            if t0 <= t <= t1:
                return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
        return samples[0][1] if t < samples[0][0] else samples[-1][1]


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (threads it starts later inherit it from theirs); nothing
    for a process that is gone."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task.name), cpus)


def pin_router(router_pids: list[int], other_pids: list[int], cpus: list[int]) -> dict[str, Any]:
    """Router process ``i`` on the ``i``-th of the last of ``cpus``, this harness (the client) and
    ``other_pids`` (the engines) on the rest; what was done, for the report."""
    if not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir():
        return {"pinned": False, "why": "this system sets no thread affinity"}
    if len(cpus) <= len(router_pids):
        return {"pinned": False, "why": f"{len(cpus)} cores for {len(router_pids)} router process(es) and the rest"}
    router_cpus, rest = cpus[-len(router_pids):], set(cpus[: -len(router_pids)])
    for pid, cpu in zip(router_pids, router_cpus, strict=True):
        _set_affinity(pid, {cpu})
    for pid in [os.getpid(), *other_pids]:
        _set_affinity(pid, rest)
    return {"pinned": True, "router_cpus": router_cpus, "other_cpus": sorted(rest)}


# ---------------------------------------------------------------------------------- client
# Linux stamps each received packet with the clock (CLOCK_REALTIME) when the kernel took it in and,
# asked with SO_TIMESTAMPNS, returns the stamp of the last packet a read consumed beside the data. On
# loopback that is the moment the router's write() ran: what the router added, without the client's
# own delay in getting to the socket (one Python process reading every stream, on the same cores).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_ANCILLARY_SIZE = socket.CMSG_SPACE(16)
_KERNEL_STAMPS = sys.platform == "linux"


@dataclass
class StreamResult:
    request_id: str = ""
    arrivals: list[float] = field(default_factory=list)  # one per token, when the client read it
    # One per token, when the kernel received it (monotonic seconds); the read time where the kernel
    # stamps nothing. A read that takes several packets stamps every token in it with the last one's
    # time, so a token is never stamped before it came.
    received: list[float] = field(default_factory=list)
    num_events: int = 0  # SSE events, [DONE] included
    status: int = 0
    done: bool = False
    error: str = ""


def _realtime_minus_monotonic() -> float:
    """``CLOCK_REALTIME - CLOCK_MONOTONIC`` in seconds, from the closest of a few paired reads."""
    best = (float("inf"), 0.0)
    for _ in range(5):
        before = time.monotonic()
        realtime = time.time()
        after = time.monotonic()
        best = min(best, (after - before, realtime - (before + after) / 2))
    return best[1]


class _SseReader:
    """Reads one SSE response off a non-blocking socket in the event loop's reader callback (no task
    per read): the status, the request id, and per token when it was read and received."""

    def __init__(self, sock: socket.socket, link: EngineLink, clock_offset: float) -> None:
        self.sock = sock
        self.link = link
        self.clock_offset = clock_offset
        self.result = StreamResult()
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._head = b""
        self._carry = b""
        self._tail = b""

    def on_readable(self) -> None:
        while not self.finished.done():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(1 << 16, _ANCILLARY_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._finish(repr(exc))
                return
            if not data:
                self._finish("" if self.result.done else "the router closed the connection")
                return
            now = time.monotonic()
            received = now
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= 16:
                    seconds, nanoseconds = struct.unpack("qq", payload[:16])
                    received = min(now, seconds + nanoseconds * 1e-9 - self.clock_offset)
            try:
                self._take(data, now, received)
            except (ValueError, IndexError) as exc:  # a malformed response ends this stream, not the run
                self._finish(repr(exc))

    def _take(self, data: bytes, now: float, received: float) -> None:
        result = self.result
        if not result.status:
            self._head += data
            if b"\r\n\r\n" not in self._head:
                return
            head, _, data = self._head.partition(b"\r\n\r\n")
            result.status = int(head.split(b" ", 2)[1])
            if result.status != 200:
                self._finish(data.decode(errors="replace")[:2000] or f"status {result.status}")
                return
        buffer = self._carry + data
        count = buffer.count(MARKER)
        result.num_events += buffer.count(EVENT)
        if count:
            result.arrivals.extend([now] * count)
            result.received.extend([received] * count)
            self.link.add_received(count)
        self._carry = buffer[-(len(MARKER) - 1):]
        if not result.request_id and b'"id":"' in buffer:
            start = buffer.index(b'"id":"') + 6
            result.request_id = buffer[start:buffer.index(b'"', start)].decode()
        self._tail = (self._tail + data)[-64:]
        if b"data: [DONE]" in self._tail:
            result.done = True
            self._finish("")

    def _finish(self, error: str) -> None:
        if not self.finished.done():
            self.result.error = error
            self.finished.set_result(None)


class _Poller:
    """Reads the streams every ``interval_s`` instead of as each has data (``--client-poll-ms``): no
    wait is parked on their sockets, so the router's writes wake no sleeping client (on a shared
    host, a cross-core wake-up per token that a remote client would not cost the router)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.selector = selectors.DefaultSelector()
        self.task: asyncio.Task[None] | None = None

    def add(self, fd: int, reader: _SseReader) -> None:
        self.selector.register(fd, selectors.EVENT_READ, reader)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    def remove(self, fd: int) -> None:
        self.selector.unregister(fd)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for key, _ in self.selector.select(timeout=0):
                key.data.on_readable()

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.selector.close()


async def _stream(port: int, body: bytes, link: EngineLink, clock_offset: float,
                  poller: _Poller | None = None) -> StreamResult:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    reader = _SseReader(sock, link, clock_offset)
    try:
        if _KERNEL_STAMPS:
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(
            sock,
            b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body,
        )
        if poller is not None:
            poller.add(sock.fileno(), reader)
        else:
            loop.add_reader(sock.fileno(), reader.on_readable)
        try:
            await reader.finished
        finally:
            if poller is not None:
                poller.remove(sock.fileno())
            else:
                loop.remove_reader(sock.fileno())
    except OSError as exc:
        reader.result.error = repr(exc)
    finally:
        sock.close()
    return reader.result


async def _run_streams(
    port: int, concurrency: int, max_tokens: int, link: EngineLink, poll_s: float = 0.0, lifetime_s: float = 0.0
) -> list[StreamResult]:
    """``concurrency`` streams started at once; with ``lifetime_s`` (staggered arrivals), slot i's first
    stream starts i / C of a stream's lifetime after the first's, and each slot starts its next stream
    as its last ends, none after two lifetimes: C streams at once with arrivals spread, as a service at
    that concurrency sees them."""
    body = json.dumps({"model": "bench", "prompt": "Hi there", "max_tokens": max_tokens, "stream": True}).encode()
    offset = _realtime_minus_monotonic()
    poller = _Poller(poll_s) if poll_s else None
    last_start = time.monotonic() + STAGGERED_LIFETIMES * lifetime_s

    async def slot(index: int) -> list[StreamResult]:
        if lifetime_s:
            await asyncio.sleep(index * lifetime_s / concurrency)
        results = [await _stream(port, body, link, offset, poller)]
        while lifetime_s and time.monotonic() < last_start and results[-1].done:
            results.append(await _stream(port, body, link, offset, poller))
        return results

    try:
        return [r for results in await asyncio.gather(*(slot(i) for i in range(concurrency))) for r in results]
    finally:
        if poller is not None:
            poller.close()


# ---------------------------------------------------------------------------------- write floor
# One SSE event as the router writes it for a token (HTTP/1.1 chunk framing included).
_EVENT_BYTES = (
    b'a0\r\ndata: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
    b'"created":1764669600,"model":"bench","choices":[{"index":0,"text":" hello","logprobs":null,'
    b'"finish_reason":null}]}\n\n\r\n'
)


def _drain(port: int, count: int) -> None:
    """A write floor's client: ``count`` connections to ``port``, read until each is closed."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, sock)
    while socks:
        for key, _ in selector.select(timeout=30):
            conn: socket.socket = key.data
            try:
                data = conn.recv(1 << 16)
            except BlockingIOError:
                continue
            if not data:
                selector.unregister(conn)
                conn.close()
                socks.remove(conn)


def write_floor_ms(ctx: SpawnContext, concurrency: int, num_steps: int = 50) -> float:
    """Median ms for one process to write one token's SSE event to each of ``concurrency`` loopback
    connections (read by another process), with the socket calls alone: what one engine step's
    tokens cost a router at the least, however little Python it runs per token. The last stream of a
    step waits for all of them, so a router whose p99 is under this for one step is not possible."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(concurrency)
    reader = ctx.Process(target=_drain, args=(server.getsockname()[1], concurrency), daemon=True)
    reader.start()
    conns = [server.accept()[0] for _ in range(concurrency)]
    server.close()
    times = []
    try:
        for _ in range(num_steps):
            start = time.perf_counter()
            for conn in conns:
                conn.sendall(_EVENT_BYTES)
            times.append(time.perf_counter() - start)
            time.sleep(0.01)  # the reader drains between steps, as the client does between engine steps
    finally:
        for conn in conns:
            conn.close()
        reader.join(30)
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------------------------- one point
def _histograms_during(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Observations between two ``RouterProcess.histograms``: count, ms in all, the mean, and the bucket
    bound (ms) under which the longest fell."""
    during = {}
    for key, now in after.items():
        then = before.get(key, {"count": 0, "seconds": 0.0, "buckets": {}})
        count = now["count"] - then["count"]
        if count <= 0:
            continue
        added = {le: n - then["buckets"].get(le, 0) for le, n in now["buckets"].items()}
        longest = min((le for le, n in added.items() if n >= count), default=float("inf"))
        total_ms = (now["seconds"] - then["seconds"]) * 1e3
        during[key] = {"count": count, "total_ms": round(total_ms, 2), "mean_ms": round(total_ms / count, 3),
                       "longest_under_ms": longest * 1e3}
    return during


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _latency(ms: list[float]) -> dict[str, float]:
    return {
        "p50": round(_percentile(ms, 0.50), 3), "p99": round(_percentile(ms, 0.99), 3),
        "p999": round(_percentile(ms, 0.999), 3), "max": round(max(ms), 3) if ms else float("nan"),
        "mean": round(statistics.fmean(ms), 3) if ms else float("nan"), "num_tokens": len(ms),
    }


def run_point(
    router: RouterProcess, link: EngineLink, concurrency: int, max_tokens: int, rate: float | None = None,
    stream_interval: int = 1, client_poll_ms: float = 0.0, arrivals: str = "together",
) -> dict[str, Any]:
    """C streams of ``max_tokens`` each, all started at once; the point's figures. With ``rate``, the
    engines step on a clock that offers ``rate`` tokens/s over the C streams (open loop), each step
    ``stream_interval`` tokens per stream. With ``client_poll_ms``, the client reads every that many ms.
    With ``arrivals="staggered"`` (open loop only), C streams at once with their starts spread
    (``_run_streams``); the figures are those of the second lifetime, once all C run."""
    link.set_step_interval(concurrency * stream_interval / rate if rate else 0.0)
    histograms_before = router.histograms()
    sampler = CpuSampler(router.pids())
    sampler.start()
    link.reset()
    started = time.monotonic()
    staggered = arrivals == "staggered" and bool(rate)
    lifetime_s = max_tokens * concurrency / rate if rate else 0.0  # one stream's, at the offered rate
    try:
        streams = asyncio.run(_run_streams(router.port, concurrency, max_tokens, link, client_poll_ms / 1e3,
                                           lifetime_s if staggered else 0.0))
    finally:
        sampler.stop()
    wall_s = time.monotonic() - started
    during = _histograms_during(histograms_before, router.histograms())
    engine_messages = during.pop(ENGINE_MESSAGE, None)
    sent = link.collect()  # engine request id -> send time of each token
    failed = [s for s in streams if not s.done or len(s.arrivals) != max_tokens]
    good = [s for s in streams if s not in failed]
    result: dict[str, Any] = {
        "concurrency": concurrency, "offered_tokens_per_s": rate, "max_tokens": max_tokens,
        "num_router_processes": router.workers, "client_poll_ms": client_poll_ms,
        "arrivals": "staggered" if staggered else "together", "num_streams": len(streams),
        "num_streams_failed": len(failed), "wall_s": round(wall_s, 3),
        # The router's garbage collections during the point (all of it, not only the window).
        **({"gc_pauses": during} if during else {}),
        # Its passes over the engines' messages, each from reading it to its last output handed on.
        **({"engine_messages": engine_messages} if engine_messages else {}),
    }
    if failed:
        first = failed[0]
        result["first_failure"] = f"status {first.status}, {len(first.arrivals)} tokens, {first.error[:300]}"
    if not good:
        return result
    # The steady window: every stream has started and none has ended; staggered, the second lifetime
    # (every slot streaming, streams ending and starting as they come).
    window_start = max(s.arrivals[0] for s in good)
    window_end = min(s.arrivals[-1] for s in good)
    if staggered:
        window_start, window_end = started + lifetime_s, started + STAGGERED_LIFETIMES * lifetime_s
    elif window_end <= window_start:  # one stream, or streams that did not overlap: the whole run
        window_start = min(s.arrivals[0] for s in good)
        window_end = max(s.arrivals[-1] for s in good)
    num_tokens = sum(1 for s in good for t in s.arrivals if window_start <= t <= window_end)
    window_s = max(window_end - window_start, 1e-9)
    cpu_s = sampler.at(window_end) - sampler.at(window_start)
    added_ms: list[float] = []
    steady_ms: list[float] = []
    read_ms: list[float] = []
    for s in good:
        send_times = sent.get(f"{s.request_id}-0", [])
        added_ms += [(r - t) * 1e3 for r, a, t in zip(s.received, s.arrivals, send_times, strict=False)
                     if not staggered or window_start <= a <= window_end]
        steady_ms += [(r - t) * 1e3 for r, a, t in zip(s.received, s.arrivals, send_times, strict=False)
                      if window_start <= a <= window_end]
        read_ms += [(a - t) * 1e3 for a, t in zip(s.arrivals, send_times, strict=False)]
    tokens_per_s = num_tokens / window_s
    total_tokens = sum(len(s.arrivals) for s in good)
    result.update({
        "window_s": round(window_s, 4),
        "num_tokens_in_window": num_tokens,
        "tokens_per_s": round(tokens_per_s, 1),
        "tokens_per_s_per_process": round(tokens_per_s / router.workers, 1),
        "router_cpu_s": round(cpu_s, 4),
        "router_cpu_us_per_token": round(cpu_s / max(num_tokens, 1) * 1e6, 2),
        "router_cpu_cores": round(cpu_s / window_s, 3),
        # The host's CPUs taken by the hypervisor over the window: a tail the router did not make.
        "host_steal": steal_during(sampler.host, window_start, window_end),
        # Engine send to the kernel's receipt of the router's write: what the router added (staggered:
        # over the window's tokens, first tokens of the streams that started in it included).
        "added_latency_ms": _latency(added_ms),
        # The same over the steady window's tokens only: without the steps that start and end
        # every stream at once (all C streams begin together here, unlike a service's arrivals).
        "added_latency_steady_ms": _latency(steady_ms),
        "latency_clock": "kernel receive" if _KERNEL_STAMPS else "client read",
        # Engine send to the client's read: the above plus the client's own delay.
        "read_latency_ms": _latency(read_ms),
        "total_tokens": total_tokens,
        # Above 1 when the router fell behind and sent the tokens that queued up as one event.
        "tokens_per_event": round(total_tokens / max(1, sum(s.num_events - 1 for s in good)), 3),
    })
    return result


# ---------------------------------------------------------------------------------- report
def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"router overhead ({report['date']}): streamed tokens/s per router process, added latency per token, "
        "router CPU per token",
        f"{'engines':<12}{'procs':>6}{'streams':>9}{'offered':>9}{'arrivals':>10}{'tok/s/proc':>12}{'tok/s':>10}"
        f"{'p50 ms':>9}"
        f"{'p99 ms':>9}{'steady p99':>11}{'p999 ms':>9}{'read p99':>10}{'cpu us/tok':>12}{'tok/event':>11}{'failed':>8}{'pinned':>8}",
    ]
    for r in report["results"]:
        lat = r.get("added_latency_ms", {})
        offered = r.get("offered_tokens_per_s")
        lines.append(
            f"{r['engine_mode']:<12}{r['num_router_processes']:>6}{r['concurrency']:>9}"
            f"{'max' if not offered else f'{offered:,.0f}':>9}{r.get('arrivals', 'together'):>10}"
            f"{r.get('tokens_per_s_per_process', float('nan')):>12,.0f}{r.get('tokens_per_s', float('nan')):>10,.0f}"
            f"{lat.get('p50', float('nan')):>9.2f}{lat.get('p99', float('nan')):>9.2f}"
            f"{r.get('added_latency_steady_ms', {}).get('p99', float('nan')):>11.2f}"
            f"{lat.get('p999', float('nan')):>9.2f}"
            f"{r.get('read_latency_ms', {}).get('p99', float('nan')):>10.2f}"
            f"{r.get('router_cpu_us_per_token', float('nan')):>12.1f}{r.get('tokens_per_event', float('nan')):>11.2f}"
            f"{r['num_streams_failed']:>8}{'yes' if r.get('pinning', {}).get('pinned') else 'no':>8}"
        )
    for r in report["results"]:
        if r.get("gc_pauses"):
            offered = r.get("offered_tokens_per_s")
            lines.append(
                f"router garbage collections, {r['concurrency']} streams, {f'{offered:,.0f}' if offered else 'max'}"
                f" tokens/s, {r.get('arrivals', 'together')}: " + "; ".join(
                    f"{when} {g['count']:.0f} ({g['total_ms']:.1f} ms in all, each under {g['longest_under_ms']:g} ms)"
                    for when, g in sorted(r["gc_pauses"].items())))
    for r in report["results"]:
        if r.get("engine_messages"):
            m, offered = r["engine_messages"], r.get("offered_tokens_per_s")
            lines.append(
                f"router pass over an engine message, {r['concurrency']} streams, "
                f"{f'{offered:,.0f}' if offered else 'max'} tokens/s, {r.get('arrivals', 'together')}: "
                f"{m['count']:.0f} messages, mean {m['mean_ms']:.2f} ms, each under {m['longest_under_ms']:g} ms")
    for r in report["results"]:
        if r.get("host_steal"):
            offered = r.get("offered_tokens_per_s")
            pinned = r.get("pinning", {}).get("router_cpus") or []
            lines.append(
                f"host, {r['concurrency']} streams, {f'{offered:,.0f}' if offered else 'max'} tokens/s, "
                f"{r.get('arrivals', 'together')}: {describe_steal(r['host_steal'])}"
                + (f" (the router on cpu{', cpu'.join(map(str, pinned))})" if pinned else ""))
    if any(r.get("pinning", {}).get("pinned") for r in report["results"]):
        lines.append("pinned: each router process on a core of its own, the client and engines on the others")
    polls = sorted({r["client_poll_ms"] for r in report["results"] if r.get("client_poll_ms")})
    if polls:
        lines.append(f"the client read its streams every {', '.join(f'{ms:g}' for ms in polls)} ms (--client-poll-ms), "
                     "not as each had data")
    floors = report.get("write_floor_ms", {})
    if floors:
        lines.append("write floor, one process writing one token's event to each stream's socket (socket calls "
                     "only; the least one engine step costs a router): "
                     + ", ".join(f"{c} streams {ms:.2f} ms" for c, ms in floors.items()))
    lines += [describe(speed) for speed in report.get("host_speed", [])]
    interval = report["config"].get("stream_interval", 1)
    if interval != 1:
        lines.append(f"engines sent {interval} tokens per output (--stream-interval {interval}); the target is "
                     "for one token per output, so it is not judged here")
        return "\n".join(lines)
    target = [r for r in report["results"] if r["concurrency"] == TARGET_CONCURRENCY
              and r["engine_mode"] == "batched" and "tokens_per_s" in r]
    for r in target:
        met = (r["tokens_per_s_per_process"] >= TARGET_TOKENS_PER_S
               and r["added_latency_ms"]["p99"] <= TARGET_P99_MS)
        offered = r.get("offered_tokens_per_s")
        lines.append(
            f"target at {TARGET_CONCURRENCY} streams, {r['num_router_processes']} process(es)"
            f"{f', {offered:,.0f} tokens/s offered' if offered else ''}"
            f"{', arrivals staggered' if r.get('arrivals') == 'staggered' else ''}: >= "
            f"{TARGET_TOKENS_PER_S:,} tokens/s per process with p99 <= {TARGET_P99_MS} ms: "
            f"{'met' if met else 'not met'} ({r['tokens_per_s_per_process']:,.0f} tokens/s, "
            f"p99 {r['added_latency_ms']['p99']:.2f} ms"
            f"{f'; write floor {floors[str(TARGET_CONCURRENCY)]:.2f} ms' if str(TARGET_CONCURRENCY) in floors else ''}"
            f"{_steal_note(r.get('host_steal'))})"
        )
    return "\n".join(lines)


def _steal_note(steal: dict[str, dict[str, float]] | None) -> str:
    return f"; host steal {steal['cpu']['share']:.0%}" if steal and "cpu" in steal else ""


def write_plot(report: dict[str, Any], path: Path) -> bool:
    """Tokens/s per process, CPU per token and p99 added latency against streams; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    series: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in report["results"]:
        if "tokens_per_s" in r and not r.get("offered_tokens_per_s"):  # the closed-loop points
            series.setdefault((r["engine_mode"], r["num_router_processes"]), []).append(r)
    for (mode, procs), rows in sorted(series.items()):
        x = [r["concurrency"] for r in rows]
        style = "-o" if mode == "batched" else "--s"
        label = f"{mode} engines, {procs} router process{'es' if procs > 1 else ''}"
        axes[0].plot(x, [r["tokens_per_s_per_process"] for r in rows], style, label=label)
        axes[1].plot(x, [r["router_cpu_us_per_token"] for r in rows], style, label=label)
        axes[2].plot(x, [r["added_latency_ms"]["p99"] for r in rows], style, label=f"p99, {label}")
    axes[0].axhline(TARGET_TOKENS_PER_S, color="r", linestyle=":", label="target")
    axes[2].axhline(TARGET_P99_MS, color="r", linestyle=":", label="target p99")
    titles = ("streamed tokens/s per router process", "router CPU us per token", "added latency per token, ms")
    for ax, title in zip(axes, titles, strict=True):
        ax.set(xscale="log", xlabel="concurrent streams", title=title)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench overhead router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,16,64,256,512,1024", help="concurrent streams, comma-separated")
    p.add_argument("--workers", default="1,2", help="router processes (--workers), comma-separated")
    p.add_argument("--engine-modes", default="batched,per-request",
                   help=f"comma-separated, of {','.join(ENGINE_MODES)} (per-request: the old one message "
                   "per request per step)")
    p.add_argument("--engines", type=int, default=1, help="fake decode engine processes")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--window", type=int, default=2, help="steps an engine may run ahead of the client")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per engine output, as engines run with --stream-interval send them "
                   "(default 1: the issue's figures are per token, one output each)")
    p.add_argument("--rates", default="", metavar="R1,R2",
                   help="also run open-loop points offering these tokens/s (all streams together), "
                   "comma-separated")
    p.add_argument("--arrivals", default="together",
                   help="comma-separated, of together (every stream of a point starts at once) and staggered "
                   "(open-loop points only: the streams' starts spread over a stream's lifetime, each "
                   "ended stream followed by a new one, measured over the second lifetime)")
    p.add_argument("--pin-router", action="store_true",
                   help="give the router process(es) cores of their own (one each, the last ones) and the "
                   "client and engines the rest, as a deployment would; needs more cores than --workers")
    p.add_argument("--client-poll-ms", type=float, default=0.0, metavar="MS",
                   help="the client reads its streams every MS ms instead of as each has data (0, the "
                   "default): a same-host client then costs the router no wake-up per token")
    p.add_argument("--router-pythonpath", default=None, metavar="DIR",
                   help="run the router from this source tree (e.g. an export of the previous commit)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="default: ops/bench/results/overhead-router-cpu-<date>.json")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG next to the JSON")
    return p


def _token_id(text: str) -> int:
    """The one token of the default model's tokenizer (the router's) that ``text`` encodes to."""
    import tokenizers

    from common.model.loader import resolve_model_path

    tokenizer = tokenizers.Tokenizer.from_file(str(resolve_model_path(None) / "tokenizer.json"))
    [token_id] = tokenizer.encode(text, add_special_tokens=False).ids
    return int(token_id)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers; got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} takes positive integers; got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    concurrency = _ints(args.concurrency, "--concurrency")
    workers = _ints(args.workers, "--workers")
    rates = _ints(args.rates, "--rates") if args.rates else []
    modes = [m for m in args.engine_modes.split(",") if m]
    if not modes or not set(modes) <= set(ENGINE_MODES):
        raise SystemExit(f"--engine-modes takes a comma-separated list of {', '.join(ENGINE_MODES)}")
    arrivals = [a for a in args.arrivals.split(",") if a]
    if not arrivals or not set(arrivals) <= set(ARRIVALS):
        raise SystemExit(f"--arrivals takes a comma-separated list of {', '.join(ARRIVALS)}")
    if "staggered" in arrivals and not rates:
        raise SystemExit("--arrivals staggered needs --rates: streams are spread over a lifetime at an offered rate")
    if args.client_poll_ms < 0:
        raise SystemExit("--client-poll-ms must not be negative")
    if args.max_tokens < 2 or args.engines < 1 or args.window < 1 or args.stream_interval < 1:
        raise SystemExit("--max-tokens must be at least 2, --engines, --window and --stream-interval at least 1")
    token_id = _token_id(TOKEN_TEXT)
    from common.model.loader import model_identity, resolve_model_path

    served_identity = model_identity(resolve_model_path(None))  # the router's model: the default one
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["pdserve bench overhead router", *(argv if argv is not None else sys.argv[1:])]),
        "config": vars(args),
        "machine": {"device": "cpu", "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "target": {"concurrency": TARGET_CONCURRENCY, "tokens_per_s_per_process": TARGET_TOKENS_PER_S,
                   "p99_added_ms": TARGET_P99_MS},
        "host_speed": [host_speed(torch_ops=False)],  # before the points, and after them
        "results": [],
    }
    all_cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    redis_proc, redis_url = start_redis()
    logs, ok = LogFolder("pdserve-router-bench-"), False
    ctx = mp.get_context("spawn")
    try:
        for mode in modes:
            namespace = f"bench-{uuid.uuid4().hex[:8]}"
            config = StreamEngineConfig(redis_url=redis_url, namespace=namespace, token_id=token_id,
                                        batched=mode == "batched", window=args.window,
                                        stream_interval=args.stream_interval, model=served_identity)
            link = EngineLink(ctx, args.engines)
            engines = [FakeStreamEngine(ctx, config, f"decode-{i}", i, link) for i in range(args.engines)]
            for engine in engines:
                engine.start()
            engine_pids = [e.process.pid for e in engines if e.process.pid is not None]
            try:
                for num_workers in workers:
                    router = RouterProcess(num_workers, redis_url, namespace, args.router_pythonpath,
                                           logs.path / f"router-{mode}-{num_workers}.log")
                    pinning: dict[str, Any] = {"pinned": False}
                    try:
                        router.wait_ready()
                        pinning = (pin_router(router.pids(), engine_pids, all_cpus) if args.pin_router
                                   else {"pinned": False})
                        run_point(router, link, min(4, max(concurrency)), 20)  # warm-up, not reported
                        points: list[tuple[int | None, str]] = [(None, "together")] if "together" in arrivals else []
                        points += [(rate, how) for rate in rates for how in arrivals]
                        for c in concurrency:
                            for rate, how in points:
                                print(f"{mode} engines, {num_workers} router process(es), {c} streams"
                                      f"{f', {rate} tokens/s offered' if rate else ''}"
                                      f"{', arrivals staggered' if how == 'staggered' else ''} ...",
                                      file=sys.stderr, flush=True)
                                report["results"].append(
                                    {"engine_mode": mode, **run_point(router, link, c, args.max_tokens, rate,
                                                                      args.stream_interval, args.client_poll_ms,
                                                                      how),
                                     "pinning": pinning}
                                )
                    finally:
                        router.stop()
                        if pinning["pinned"]:  # unpinned again, for the next router
                            for pid in [os.getpid(), *engine_pids]:
                                _set_affinity(pid, set(all_cpus))
            finally:
                for engine in engines:
                    engine.stop()
        # Last, with the router and engines gone: the socket calls alone for one step of C tokens.
        report["write_floor_ms"] = {str(c): round(write_floor_ms(ctx, c), 3) for c in concurrency}
        report["host_speed"].append(host_speed(torch_ops=False))
        ok = all(r["num_streams_failed"] == 0 for r in report["results"])
    finally:
        redis_proc.kill()
        redis_proc.wait()
        logs.close(ok)
    print(format_report(report))
    path = Path(args.json) if args.json else RESULTS_DIR / f"overhead-router-cpu-{report['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plot and write_plot(report, path.with_suffix(".png")):
        report["plot"] = str(path.with_suffix(".png").name)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
