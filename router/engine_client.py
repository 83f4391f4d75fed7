"""ZeroMQ plumbing between the router and the engines.

One PUSH socket per engine control address (LINGER 0, bounded SNDHWM, ZMQ_IMMEDIATE so messages
are only queued on completed connections): a send never blocks, and a dead or swamped engine shows
up as EAGAIN, which callers treat as "instance unavailable". One PULL socket (``reply_address``)
receives every engine's ``RequestOutput``s (one by one, or one ``OutputBatch`` per engine step) and routes them to per-request queues. With a cluster
key both are CURVE sockets (``common.cluster_key``): the reply socket admits only engines that hold
the key, and the PUSH sockets reach only engines that do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from common.cluster_key import ClusterKey
from common.gc_pacer import GcPacer
from common.protocol import (
    MAX_OUTPUT_MESSAGE_BYTES,
    AbortRequest,
    OutputBatch,
    ProtocolError,
    RequestOutput,
    RequestsStarted,
    RouterHeartbeat,
    decode_output,
    encode,
)
from router.output_queue import WAKE_INTERVAL_S, AfterSends, OutputQueue

logger = logging.getLogger(__name__)

SEND_HWM = 1000
RECV_HWM = 100_000
CONNECT_GRACE_S = 0.5
PRUNE_AFTER_S = 60.0
MAX_BEHIND_S = 30.0  # reading outputs this late, engines' silence counts again


class EngineClient:
    """Sends to engines and receives their outputs. Not thread-safe: use from the event loop."""

    def __init__(
        self, reply_host: str = "127.0.0.1", reply_port: int = 0, cluster_key: ClusterKey | None = None
    ) -> None:
        self._reply_host = reply_host
        self._reply_port = reply_port
        self._cluster_key = cluster_key
        self._zap: ThreadAuthenticator | None = None
        self.reply_address = ""
        self._push_ctx = zmq.Context()
        self._pull_ctx = zmq.asyncio.Context()
        self._pull: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._sockets: dict[str, zmq.Socket] = {}
        self._last_used: dict[str, float] = {}
        self._queues: dict[str, OutputQueue] = {}
        self._waker: asyncio.Task[None] | None = None
        # When each instance was last heard from (any output or progress message), monotonic.
        self.last_heard: dict[str, float] = {}
        # When the reply socket was last seen with nothing unread (see ``silent_for``).
        self.caught_up_at = time.monotonic()
        # Set by the router's process: garbage collections when a message's outputs are all sent and
        # no other waits (``common/gc_pacer.py``), not in the middle of a step's fan-out.
        self.gc_pacer: GcPacer | None = None
        self.last_message_at = 0.0  # when the last engine message was read, monotonic
        # Filled by the sinks while a message's outputs are handed on, run once they all are.
        self.after_sends: AfterSends = []
        # Given the seconds each engine message took to hand on (a metric; set by the router's state).
        self.observe_message: Callable[[float], None] | None = None

    async def start(self) -> None:
        """Bind the reply socket: loopback only for a loopback ``reply_host``, else every interface.
        ``reply_host="auto"`` advertises this machine's own address (containers, pods)."""
        if self._reply_host == "auto":
            self._reply_host = socket.gethostbyname(socket.gethostname())
        pull = self._pull_ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, RECV_HWM)
        pull.setsockopt(zmq.MAXMSGSIZE, MAX_OUTPUT_MESSAGE_BYTES)  # a larger frame drops that connection
        if self._cluster_key is not None:
            self._zap = self._cluster_key.authenticate(self._pull_ctx)
            self._cluster_key.serve(pull)
        loopback = self._reply_host in ("127.0.0.1", "localhost")
        bind_host = "127.0.0.1" if loopback else "*"
        if self._reply_port:
            pull.bind(f"tcp://{bind_host}:{self._reply_port}")
            port = self._reply_port
        else:
            port = pull.bind_to_random_port(f"tcp://{bind_host}")
        self.reply_address = f"tcp://{self._reply_host}:{port}"
        self._pull = pull
        self._receiver = asyncio.create_task(self._receive_loop(), name="engine-outputs")
        self._waker = asyncio.create_task(self._wake_loop(), name="output-queue-waker")

    async def close(self) -> None:
        for task in (self._receiver, self._waker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._pull is not None:
            self._pull.close(linger=0)
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        if self._zap is not None:
            self._zap.stop()
        self._pull_ctx.term()
        self._push_ctx.term()

    async def _receive_loop(self) -> None:
        assert self._pull is not None
        pull, queues, last_heard, after_sends = self._pull, self._queues, self.last_heard, self.after_sends
        while True:
            raw = await pull.recv()
            received = time.monotonic()
            try:
                msg = decode_output(raw)
            except ProtocolError as exc:
                logger.warning("dropping malformed engine output: %s", exc)
                continue
            self.last_message_at = now = received
            if msg.instance_id:
                last_heard[msg.instance_id] = now
            if isinstance(msg, OutputBatch):  # one engine step's outputs for this router
                if not msg.instance_id:
                    last_heard.update((o.instance_id, now) for o in msg.outputs if o.instance_id)
                for output in msg.outputs:
                    queue = queues.get(output.request_id)
                    if queue is not None:
                        queue.last_put = now
                        queue.put_nowait(output)
            elif isinstance(msg, RequestOutput):
                queue = queues.get(msg.request_id)
                if queue is not None:  # outputs of finished or aborted requests are dropped
                    queue.last_put = now
                    queue.put_nowait(msg)
            elif isinstance(msg, RequestsStarted):
                for request_id in msg.request_ids:
                    queue = queues.get(request_id)
                    if queue is not None:
                        queue.started_on += (msg.instance_id,)
            if self.observe_message is not None:
                self.observe_message(time.monotonic() - received)
            if after_sends:
                self._run_after_sends()
            pacer = self.gc_pacer
            if pacer is not None and pacer.due() and not int(pull.get(zmq.EVENTS)) & zmq.POLLIN:
                pacer.collect()

    def _run_after_sends(self) -> None:
        """What the sinks left until the message's outputs were all sent (their bookkeeping)."""
        after_sends, now = self.after_sends, time.monotonic()
        try:
            for after_send, output in after_sends:
                after_send(output, now)
        finally:
            after_sends.clear()

    async def _wake_loop(self) -> None:
        """Once per ``WAKE_INTERVAL_S``: every waiting reader that got no output meanwhile checks its
        deadlines and its instances (see ``OutputQueue``). One whose outputs come is left parked:
        waking every reader at once, 512 streams took milliseconds that an engine step's tokens
        arriving then waited for."""
        while True:
            await asyncio.sleep(WAKE_INTERVAL_S)
            stale = time.monotonic() - WAKE_INTERVAL_S
            for queue in list(self._queues.values()):
                if queue.last_put <= stale:
                    queue.wake()
            # Without engine messages to collect after (none for a while), collections come here.
            quiet = time.monotonic() - self.last_message_at > WAKE_INTERVAL_S
            if self.gc_pacer is not None and quiet and self.gc_pacer.due():
                self.gc_pacer.collect()

    # -- per-request queues --------------------------------------------------------------------
    def open(self, request_id: str) -> OutputQueue:
        """Register a request before sending it, so no output can arrive unclaimed."""
        queue = OutputQueue()
        self._queues[request_id] = queue
        return queue

    def discard(self, request_id: str) -> None:
        """Forget a request; may be called twice."""
        self._queues.pop(request_id, None)

    @property
    def num_open(self) -> int:
        return len(self._queues)

    # -- sending -------------------------------------------------------------------------------
    def connect(self, address: str) -> zmq.Socket:
        """The PUSH socket for an engine, created (and connecting in the background) on first use."""
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._push_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_OUTPUT_MESSAGE_BYTES)  # it receives nothing; bounded anyway
            if self._cluster_key is not None:
                self._cluster_key.connect_as_client(sock)
            sock.connect(address)
            self._sockets[address] = sock
        self._last_used[address] = time.monotonic()
        return sock

    def writable(self, address: str) -> bool:
        """True when a send to ``address`` would not hit EAGAIN (its connection is up)."""
        return bool(int(self.connect(address).get(zmq.EVENTS)) & zmq.POLLOUT)

    def send_nowait(self, address: str, msg: msgspec.Struct) -> bool:
        try:
            self.connect(address).send(encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            logger.warning("send to %s failed: %s", address, exc)
            return False

    async def send(self, address: str, msg: msgspec.Struct, grace_s: float = CONNECT_GRACE_S) -> bool:
        """Send without blocking; if the connection is still being set up, wait up to ``grace_s``
        for it. False means the engine is unreachable or full."""
        deadline = time.monotonic() + grace_s
        while not self.send_nowait(address, msg):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def silent_for(self, instance_id: str, since: float) -> float:
        """Seconds the instance has been silent, counting from ``since`` at the earliest.

        Silence counts only up to the last moment this router had read every output that had
        arrived: a router whose event loop was held up (a huge request's parsing, a loaded host)
        has the engines' messages waiting unread in its socket, and must not take that for the
        engines' silence. After ``MAX_BEHIND_S`` behind, silence counts again, late by that much."""
        now = time.monotonic()
        if self._pull is None or not int(self._pull.get(zmq.EVENTS)) & zmq.POLLIN:
            self.caught_up_at = now
        until = max(self.caught_up_at, now - MAX_BEHIND_S)
        return until - max(self.last_heard.get(instance_id, since), since)

    def renew_leases(self, addresses: list[str]) -> None:
        """Tell each engine this router is alive, so it keeps this router's requests."""
        if not self.reply_address:
            return
        beat = RouterHeartbeat(reply_to=self.reply_address)
        for address in addresses:
            self.send_nowait(address, beat)

    def abort(self, request_id: str, addresses: list[str]) -> None:
        """Best-effort AbortRequest to every engine that may hold the request."""
        msg = AbortRequest(request_id=request_id)
        for address in dict.fromkeys(addresses):
            if not self.send_nowait(address, msg):
                logger.info("could not deliver abort of %s to %s", request_id, address)

    def prune(self, live_addresses: set[str]) -> None:
        """Close sockets of engines that left the registry and have not been used for a while."""
        now = time.monotonic()
        for address in list(self._sockets):
            if address not in live_addresses and now - self._last_used.get(address, 0.0) > PRUNE_AFTER_S:
                self._sockets.pop(address).close(linger=0)
                self._last_used.pop(address, None)
