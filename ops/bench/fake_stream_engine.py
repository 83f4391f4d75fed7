"""A fake decode engine for router benchmarks: real ZMQ and a real registry entry, no model.

It takes ``GenerateRequest``s on its control socket and, each step, sends one token (always
``token_id``; ``stream_interval`` tokens at once, as an engine run with ``--stream-interval`` sends
them) to every stream it holds until the stream's ``max_tokens``: in one ``OutputBatch`` per
router (``batched``, as the engine services send) or one ``RequestOutput`` per request (the old
way). It steps as fast as it can, but at most ``window`` steps ahead of what the client has read
(``EngineLink``), and records when it sent each token so the harness can tell what the router added.
Or, once told a step interval (``EngineLink.set_step_interval``), it steps on that clock whatever the
client has read (an open loop, as a real engine's steps come), so the router's latency is measured at
an offered load instead of at saturation.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from typing import Any

import zmq

from common.protocol import (
    AbortRequest,
    EngineProgress,
    GenerateRequest,
    ProtocolError,
    RequestOutput,
    decode_input,
    encode,
    encode_output_batches,
)
from common.registry import HeartbeatThread, InstanceInfo, Registry

PROGRESS_INTERVAL_S = 0.5
STUCK_S = 5.0  # tokens the client never reads (a failed stream) do not hold the engine back longer
SEND_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class StreamEngineConfig:
    redis_url: str
    namespace: str
    token_id: int
    batched: bool = True
    window: int = 2
    stream_interval: int = 1
    # The model identity it registers: the router's (``common.model.loader.model_identity``), or it is left out.
    model: str = "bench"


class EngineLink:
    """What the harness and its fake engines share: token counters (flow control) and a command
    queue per engine with one reply queue. Made in the harness, handed to each engine process."""

    def __init__(self, ctx: SpawnContext, num_engines: int) -> None:
        self.num_engines = num_engines
        self.sent = ctx.RawArray("q", num_engines)  # tokens each engine sent (its own slot only)
        self.received = ctx.RawValue("q", 0)  # tokens the client read, over all engines
        self.commands = [ctx.Queue() for _ in range(num_engines)]
        self.replies: Any = ctx.Queue()

    def add_received(self, count: int) -> None:
        self.received.value += count

    def in_flight(self) -> int:
        return sum(self.sent) - int(self.received.value)

    def set_step_interval(self, seconds: float, timeout_s: float = 30.0) -> None:
        """Every engine steps every ``seconds`` from now on (0: as fast as the window lets it); returns
        once each has taken it (engines read commands every 20 ms, a short stream ends sooner)."""
        for commands in self.commands:
            commands.put(("step_interval", seconds))
        for _ in range(self.num_engines):
            _, reply = self.replies.get(timeout=timeout_s)
            if reply != "step_interval":
                raise RuntimeError(f"a fake engine answered {reply!r} to a step interval")

    def reset(self) -> None:
        """Zero the counters; only while no stream is running."""
        self.received.value = 0
        for i in range(self.num_engines):
            self.sent[i] = 0

    def collect(self, timeout_s: float = 30.0) -> dict[str, list[float]]:
        """Every engine's send times per request since the last collect (and forgets them there)."""
        for commands in self.commands:
            commands.put("collect")
        merged: dict[str, list[float]] = {}
        for _ in range(self.num_engines):
            _, times = self.replies.get(timeout=timeout_s)
            merged.update(times)
        return merged


@dataclass
class _Stream:
    reply_to: str
    remaining: int
    num_prompt_tokens: int
    times: list[float] = field(default_factory=list)


class FakeStreamEngine:
    """One engine process; ``start`` returns once it is registered, ``stop`` ends it."""

    def __init__(self, ctx: SpawnContext, config: StreamEngineConfig, instance_id: str, index: int,
                 link: EngineLink) -> None:
        self.link = link
        self.index = index
        self.process = ctx.Process(target=_engine_main, args=(config, instance_id, index, link),
                                   name=f"fake-{instance_id}", daemon=True)

    def start(self, timeout_s: float = 30.0) -> None:
        self.process.start()
        index, message = self.link.replies.get(timeout=timeout_s)
        if (index, message) != (self.index, "ready"):
            raise RuntimeError(f"fake engine {self.index} did not start: {message!r}")

    def stop(self) -> None:
        self.link.commands[self.index].put("stop")
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _engine_main(config: StreamEngineConfig, instance_id: str, index: int, link: EngineLink) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness stops it
    _EngineLoop(config, instance_id, index, link).run()


class _EngineLoop:
    def __init__(self, config: StreamEngineConfig, instance_id: str, index: int, link: EngineLink) -> None:
        self.config = config
        self.instance_id = instance_id
        self.index = index
        self.link = link
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        port = self.control.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.replies: dict[str, zmq.Socket] = {}
        self.active: dict[str, _Stream] = {}
        self.finished: dict[str, list[float]] = {}
        self.step_interval_s = 0.0  # 0: closed loop (the window); else a step every so often
        self.next_step = 0.0

    def info(self) -> InstanceInfo:
        return InstanceInfo(
            instance_id=self.instance_id, role="decode", model=self.config.model, control_address=self.address,
            block_size=16, max_model_len=1 << 16, num_requests_running=len(self.active),
        )

    def run(self) -> None:
        registry = Registry(self.config.redis_url, self.config.namespace, ttl_s=2.0)
        heartbeat = HeartbeatThread(registry, self.info, 0.5)
        heartbeat.start()
        self.link.replies.put((self.index, "ready"))
        last_step = last_progress = last_command = 0.0
        try:
            while True:
                now = time.monotonic()
                if now - last_command > 0.02:
                    last_command = now
                    if not self._commands():
                        return
                if self.control.poll(self._poll_ms(now)):
                    self._drain_control()
                if self.active and self._due(now, last_step):
                    self._step()
                    last_step = now
                if now - last_progress > PROGRESS_INTERVAL_S:
                    last_progress = now
                    progress = encode(EngineProgress(instance_id=self.instance_id))
                    for address in list(self.replies):
                        self._send(address, progress)
        finally:
            heartbeat.stop(deregister=True)
            for sock in [self.control, *self.replies.values()]:
                sock.close(linger=0)
            self.ctx.term()

    def _commands(self) -> bool:
        """False on "stop"."""
        while True:
            try:
                command = self.link.commands[self.index].get_nowait()
            except queue.Empty:
                return True
            if command == "stop":
                return False
            if isinstance(command, tuple) and command[0] == "step_interval":
                self.step_interval_s, self.next_step = float(command[1]), 0.0
                self.link.replies.put((self.index, "step_interval"))
            if command == "collect":
                self.link.replies.put((self.index, self.finished))
                self.finished = {}

    def _drain_control(self) -> None:
        while True:
            try:
                raw = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_input(raw)
            except ProtocolError:
                continue
            if isinstance(msg, GenerateRequest):
                max_tokens = max(1, msg.sampling_params.max_tokens - len(msg.output_token_ids))
                self.active[msg.request_id] = _Stream(msg.reply_to, max_tokens, len(msg.prompt_token_ids))
            elif isinstance(msg, AbortRequest):
                stream = self.active.pop(msg.request_id, None)
                if stream is not None:
                    self.finished[msg.request_id] = stream.times

    def _poll_ms(self, now: float) -> int:
        """How long to wait for a control message: not at all while the window decides, until the
        next step on a clock (an idle engine waits 2 ms, so commands and progress still come)."""
        if not self.active:
            return 2
        if not self.step_interval_s:
            return 0
        return max(0, min(2, int((self.next_step - now) * 1e3)))

    def _due(self, now: float, last_step: float) -> bool:
        if not self.step_interval_s:
            return self._may_step() or now - last_step > STUCK_S
        if self.next_step == 0.0:  # the first step since the interval was set
            self.next_step = now
        if now < self.next_step:
            return False
        # The next step on the same clock; after a stall longer than a step, a step from now (no burst).
        self.next_step += self.step_interval_s
        if self.next_step <= now:
            self.next_step = now + self.step_interval_s
        return True

    def _may_step(self) -> bool:
        """At most ``window`` steps of tokens not yet read by the client (after this step)."""
        per_step = len(self.active) * self.link.num_engines * self.config.stream_interval
        return self.link.in_flight() + per_step <= self.config.window * per_step

    def _socket(self, address: str) -> zmq.Socket:
        sock = self.replies.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            sock.connect(address)
            self.replies[address] = sock
        return sock

    def _send(self, address: str, raw: bytes) -> None:
        with contextlib.suppress(zmq.Again):  # a router that takes nothing: the stream fails, not the bench
            self._socket(address).send(raw)

    def _step(self) -> None:
        by_router: dict[str, list[tuple[RequestOutput, _Stream]]] = {}
        num_sent = 0
        for request_id, stream in self.active.items():
            num = min(self.config.stream_interval, stream.remaining)
            stream.remaining -= num
            num_sent += num
            out = RequestOutput(
                request_id=request_id, new_token_ids=[self.config.token_id] * num,
                finish_reason=None if stream.remaining > 0 else "length",
                num_prompt_tokens=stream.num_prompt_tokens, instance_id=self.instance_id, phase="full",
            )
            by_router.setdefault(stream.reply_to, []).append((out, stream))
        for address, items in by_router.items():
            if self.config.batched:
                sent_at = time.monotonic()
                for raw in encode_output_batches([out for out, _ in items], self.instance_id):
                    self._send(address, raw)
                for out, stream in items:
                    stream.times += [sent_at] * len(out.new_token_ids)
            else:
                for out, stream in items:
                    stream.times += [time.monotonic()] * len(out.new_token_ids)
                    self._send(address, encode(out))
        self.link.sent[self.index] += num_sent
        for request_id in [r for r, s in self.active.items() if s.remaining <= 0]:
            self.finished[request_id] = self.active.pop(request_id).times
