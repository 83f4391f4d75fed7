"""What the prefill and decode services share: sockets, registry heartbeat, metrics, the loop.

The loop never blocks while the engine has work: it drains the control socket without waiting,
polls transfers, then runs one engine step. Idle, it waits on the control socket a few ms.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from common.config import EngineConfig
from common.engine.engine import EngineOutput, LLMEngine
from common.metrics import EngineMetrics
from common.protocol import (
    MAX_MESSAGE_BYTES,
    AbortRequest,
    GenerateRequest,
    ProtocolError,
    RequestOutput,
    decode_input,
    encode,
)
from common.registry import BACKOFF_S, HeartbeatThread, InstanceInfo, PrefixIndex, Registry

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 5
_OUTPUT_HWM = 100_000


def add_service_args(parser: argparse.ArgumentParser, role: str) -> None:
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--host", default="127.0.0.1", help="address the sockets bind and advertise")
    parser.add_argument("--port", type=int, default=0, help="control port (0: any free port)")
    parser.add_argument("--kv-port", type=int, default=0, help="KV transfer port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    parser.add_argument("--instance-id", default=f"{role}-{uuid.uuid4().hex[:8]}")
    parser.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds before a stalled transfer fails")
    parser.add_argument("--log-level", default="INFO")


class EngineService:
    role = "engine"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.instance_id: str = args.instance_id
        self.engine = LLMEngine(EngineConfig.from_cli_args(args))
        self.ctx: zmq.Context = zmq.Context.instance()
        self.control = self.ctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.control.setsockopt(zmq.RCVHWM, 10_000)
        if args.port:
            self.control.bind(f"tcp://{args.host}:{args.port}")
        else:
            self.control.bind(f"tcp://{args.host}:*")
        self.control_address = self.control.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outputs: dict[str, zmq.Socket] = {}
        self.reply_to: dict[str, str] = {}
        self.phase: dict[str, str] = {}
        self.metrics = EngineMetrics(self.role, self.instance_id)
        self.metrics.serve(args.host, args.metrics_port)
        self.registry = Registry(args.redis_url)
        self.prefix_index = PrefixIndex(args.redis_url)
        self.kv_address = ""
        self._stop = threading.Event()
        self._started_at = time.time()
        self.heartbeat: HeartbeatThread | None = None

    # ------------------------------------------------------------ identity
    def info(self) -> InstanceInfo:
        stats = self.engine.stats()
        metrics_url = f"http://{self.args.host}:{self.args.metrics_port}/metrics" if self.args.metrics_port else ""
        return InstanceInfo(
            instance_id=self.instance_id, role=self.role, model=self.engine.model_id,
            control_address=self.control_address, kv_address=self.kv_address, metrics_url=metrics_url,
            block_size=self.engine.block_size, max_model_len=self.engine.max_model_len,
            num_requests_running=stats.num_requests_running, num_requests_waiting=stats.num_requests_waiting,
            kv_cache_usage_perc=stats.kv_cache_usage_perc, started_at=self._started_at,
        )

    # ------------------------------------------------------------ outputs
    def send_output(self, request_id: str, out: RequestOutput) -> None:
        """Send to the router that owns the request; drops (and logs) if it cannot take it now."""
        address = self.reply_to.get(request_id)
        if address is None:
            return
        sock = self._outputs.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _OUTPUT_HWM)
            sock.connect(address)
            self._outputs[address] = sock
        try:
            sock.send(encode(out), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("router %s is not taking outputs; dropped one for %s", address, request_id)
        if out.finish_reason is not None:
            self.reply_to.pop(request_id, None)
            self.phase.pop(request_id, None)

    def to_wire(self, out: EngineOutput, phase: str) -> RequestOutput:
        return RequestOutput(
            request_id=out.request_id, new_token_ids=out.new_token_ids, logprobs=out.logprobs,
            finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,  # type: ignore[arg-type]
            num_cached_tokens=out.num_cached_tokens, error=out.error, instance_id=self.instance_id,
            phase=phase,  # type: ignore[arg-type]
        )

    def fail(self, request_id: str, reply_to: str, error: str, phase: str = "full") -> None:
        self.reply_to.setdefault(request_id, reply_to)
        self.send_output(request_id, RequestOutput(
            request_id=request_id, new_token_ids=[], finish_reason="error", error=error,
            instance_id=self.instance_id, phase=phase,  # type: ignore[arg-type]
        ))

    # ------------------------------------------------------------ hooks
    def on_generate(self, msg: GenerateRequest) -> None:
        raise NotImplementedError

    def on_abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def on_outputs(self, outputs: list[EngineOutput]) -> None:
        raise NotImplementedError

    def poll_transfers(self) -> bool:
        """Advance transfers without blocking; True if anything happened."""
        return False

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def close(self) -> None:
        pass

    # ------------------------------------------------------------ loop
    def _drain_control(self, timeout_ms: int) -> None:
        if not self.control.poll(timeout_ms):
            return
        while True:
            try:
                raw = self.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_input(raw)
            except ProtocolError as exc:
                logger.warning("dropped a bad control message: %s", exc)
                continue
            if isinstance(msg, AbortRequest):
                self.on_abort(msg.request_id)
            else:
                self.on_generate(msg)

    def _publish_prefix_events(self) -> None:
        if self._republish.is_set():
            # Redis came back (perhaps empty): publish everything this instance caches again.
            self._republish.clear()
            self.engine.kv.pool.drain_events()
            self._prefix_queue.append((list(self.engine.kv.pool.cached), [], True))
            self._prefix_wakeup.set()
            return
        stored, removed = self.engine.kv.pool.drain_events()
        if stored or removed:
            self._prefix_queue.append((list(stored), list(removed), False))
            self._prefix_wakeup.set()

    def _prefix_publisher(self) -> None:
        """Redis writes happen here, off the step loop."""
        while not self._stop.is_set():
            self._prefix_wakeup.wait(0.5)
            self._prefix_wakeup.clear()
            while self._prefix_queue:
                stored, removed, reset = self._prefix_queue.pop(0)
                ok = self.prefix_index.clear_instance(self.instance_id) if reset else True
                ok = ok and self.prefix_index.remove(self.instance_id, list(removed))
                ok = ok and self.prefix_index.add(self.instance_id, list(stored))
                if not ok:
                    # A lost update would leave the index wrong until the next restart: drop the
                    # queue and ask the step loop for a full resync, tried again after the back-off.
                    self._prefix_queue.clear()
                    self._stop.wait(BACKOFF_S)
                    self._republish.set()
                    break

    def _observe(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            if out.queue_time is not None and out.prefill_time is not None:
                self.metrics.queue_time.observe(out.queue_time)
                self.metrics.prefill_time.observe(out.prefill_time)

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> None:
        self._prefix_queue: list[tuple[list[bytes], list[bytes], bool]] = []
        self._prefix_wakeup = threading.Event()
        self._republish = threading.Event()
        self.prefix_index.clear_instance(self.instance_id)
        threading.Thread(target=self._prefix_publisher, daemon=True, name="prefix-publisher").start()
        self.heartbeat = HeartbeatThread(self.registry, self.info, 1.0, on_reconnect=self._republish.set)
        self.heartbeat.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        logger.info("%s %s ready: control %s kv %s", self.role, self.instance_id, self.control_address, self.kv_address)
        last_metrics = 0.0
        try:
            while not self._stop.is_set():
                busy = self.busy()
                self._drain_control(0 if busy else _IDLE_POLL_MS)
                self.poll_transfers()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._observe(outputs)
                    self.on_outputs(outputs)
                self._publish_prefix_events()
                now = time.monotonic()
                if now - last_metrics > 0.5:
                    self.metrics.update(self.engine.stats())
                    last_metrics = now
        finally:
            self.heartbeat.stop(deregister=True)
            self.prefix_index.clear_instance(self.instance_id)
            self.close()
            for sock in self._outputs.values():
                sock.close(0)
            self.control.close(0)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def service_main(role: str, factory: Callable[[argparse.Namespace], EngineService], argv: list[str] | None) -> int:
    """Parse the service flags, build the service and run its loop until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog=f"pdserve {role}", description=f"run one {role} instance")
    add_service_args(parser, role)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    factory(args).run()
    return 0
