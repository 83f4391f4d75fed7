"""What the prefill and decode services share: sockets, request records, leases, drain, the loop.

The loop never blocks while the engine has work: it drains the control socket without waiting,
polls transfers, then runs one engine step. Idle, it waits on the control socket a few ms.

Who notices a failure:
- the router, when this process dies or stalls: ``EngineProgress`` from this loop stops (a stuck
  step stops it too, unlike the registry heartbeat, which runs on its own thread);
- this process, when a router dies: each router renews a lease (``RouterHeartbeat``); when it
  lapses, that router's requests are aborted and their blocks freed;
- on SIGTERM the service drains: it takes no new request (those get a retryable error, so the
  router sends them elsewhere), finishes what it holds within ``--drain-timeout``, hands back
  the rest with a retryable error (the router continues them elsewhere), then exits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from common.cluster_key import add_cluster_key_args, cluster_key_from_args
from common.config import EngineConfig
from common.endpoints import check_endpoint
from common.engine.engine import EngineOutput, LLMEngine
from common.lora_modules import LoRAModule
from common.metrics import EngineMetrics
from common.model.loader import served_model_name
from common.nvml_metrics import torch_device_uuids
from common.protocol import (
    MAX_MESSAGE_BYTES,
    MAX_OUTPUT_MESSAGE_BYTES,
    AbortRequest,
    EngineProgress,
    GenerateRequest,
    LoRAUpdate,
    ProtocolError,
    RequestOutput,
    RequestsStarted,
    RouterHeartbeat,
    choice_request_ids,
    decode_input,
    encode,
    encode_output_batches,
    merge_outputs,
)
from common.registry import BACKOFF_S, HeartbeatThread, InstanceInfo, PrefixIndex, Registry, RuntimeAdapters
from common.sampling_params import MAX_N
from kvtransfer.blocks.layout import KVLayout
from kvtransfer.wire.curve import CurveConfig

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 5
_OUTPUT_HWM = 100_000
PROGRESS_INTERVAL_S = 0.5
# How often an engine that serves LoRA adapters reads the cluster's runtime-loaded ones (``RuntimeAdapters``).
ADAPTER_POLL_S = 2.0

Phase = str  # "prefill" | "decode" | "full", as in ``RequestOutput.phase``


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class StreamHold:
    """``--stream-interval``: a request's token outputs are held back until they hold ``interval``
    tokens, then go as one. Its first output and its last (any output with a finish reason) go at
    once, the last with the held tokens merged in; before anything else sent for the request (an
    error, a hand-back), the held tokens go on their own (``take``), so no token is ever left
    behind. Interval 1 holds nothing."""

    def __init__(self, interval: int = 1) -> None:
        self.interval = interval
        self._held: dict[str, RequestOutput] = {}
        self._started: set[str] = set()  # requests whose first output went

    def add(self, request_id: str, out: RequestOutput) -> RequestOutput | None:
        """A step's output of the request: what to send now (the held tokens merged in), or None."""
        held = self._held.pop(request_id, None)
        if held is not None:
            out = merge_outputs(held, out)
        if self.interval == 1 or out.finish_reason is not None or request_id not in self._started:
            self._started.add(request_id)
            return out
        if len(out.new_token_ids) < self.interval:
            self._held[request_id] = out
            return None
        return out

    def take(self, request_id: str) -> RequestOutput | None:
        """The request's held tokens, as one output, if any (they are no longer held)."""
        return self._held.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        """Forget the request, its held tokens with it (an aborted or finished request)."""
        self._held.pop(request_id, None)
        self._started.discard(request_id)

    def __len__(self) -> int:
        return len(self._held)


def add_service_args(parser: argparse.ArgumentParser, role: str) -> None:
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--host", default="127.0.0.1", help="address the sockets bind and advertise")
    parser.add_argument("--port", type=int, default=0, help="control port (0: any free port)")
    parser.add_argument("--kv-port", type=int, default=0, help="KV transfer port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    parser.add_argument("--instance-id", default=f"{role}-{uuid.uuid4().hex[:8]}")
    parser.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds before a stalled transfer fails")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to finish held requests before handing them back")
    parser.add_argument("--router-lease-timeout", type=float, default=10.0,
                        help="seconds without word from a router before its requests are aborted")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests waiting to be scheduled here; past it new ones are refused with a "
                        "retryable 'overloaded' error, so a router waits or tries another instance (0: unbounded)")
    if role == "decode":
        parser.add_argument(
            "--stream-interval", type=_positive_int, default=1,
            help="send a request's tokens to the router every this many tokens (its first token and "
            "its end at once), as vLLM's and SGLang's --stream-interval: fewer, larger messages and SSE "
            "events per token for the router, burstier streams for the client (default 1: every token)",
        )
    parser.add_argument("--log-level", default="INFO")
    add_cluster_key_args(parser)


@dataclass
class RequestRecord:
    """What the service keeps per request beside the engine: where outputs go, in which phase."""

    request: GenerateRequest
    phase: Phase

    @property
    def reply_to(self) -> str:
        return self.request.reply_to


class EngineService:
    """The loop around one ``LLMEngine``. Subclasses implement ``admit`` and the transfer hooks."""

    role = "engine"
    # Whether this service runs decode steps, which replay CUDA graphs on a GPU (captured at start).
    runs_decode_steps = True

    @classmethod
    def engine_config(cls, args: argparse.Namespace) -> EngineConfig:
        """The engine's configuration from the command line; eager for a service without decode steps."""
        config = EngineConfig.from_cli_args(args)
        if not cls.runs_decode_steps:
            config = dataclasses.replace(config, enforce_eager=True)  # no decode step to capture a graph for
        return config

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.instance_id: str = args.instance_id
        # Before the model loads: a missing key on a public address fails start-up at once.
        self.cluster_key = cluster_key_from_args(args, args.host, self.role)
        self.engine = LLMEngine(self.engine_config(args))
        self.ctx: zmq.Context = zmq.Context()  # its own: a context has one ZAP handler
        self._zap = self.cluster_key.authenticate(self.ctx) if self.cluster_key is not None else None
        self.control = self.ctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.control.setsockopt(zmq.RCVHWM, 10_000)
        if self.cluster_key is not None:
            self.cluster_key.serve(self.control)
        if args.port:
            self.control.bind(f"tcp://{args.host}:{args.port}")
        else:
            self.control.bind(f"tcp://{args.host}:*")
        self.control_address = self.control.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outputs: dict[str, zmq.Socket] = {}
        self._pending_outputs: dict[str, list[RequestOutput]] | None = None  # see ``_collect_outputs``
        self.stream_hold = StreamHold(getattr(args, "stream_interval", 1))
        self.records: dict[str, RequestRecord] = {}
        self.routers: dict[str, float] = {}  # reply address -> when it was last heard from
        self.metrics = EngineMetrics(self.role, self.instance_id, served_model_name(self.engine.runner.model_path))
        self.registry = Registry(args.redis_url, cluster_key=self.cluster_key)
        self.prefix_index = PrefixIndex(args.redis_url)
        # The adapters loaded at run time across the cluster, read by a thread of their own (a hung Redis must
        # not hold the loop up) and loaded between steps (``_sync_adapters``); each adapter's path by name, of
        # those this engine serves, and of those it loaded from there (which it unloads once they leave it).
        self.runtime_adapters = (RuntimeAdapters(args.redis_url, cluster_key=self.cluster_key)
                                 if self.engine.runner.lora is not None else None)
        self._wanted_adapters: dict[str, str] | None = None
        self._adapter_paths = {m.name: m.path for m in self.engine.config.lora_modules}
        self._from_cluster: set[str] = set()
        self._failed_adapters: dict[str, str] = {}  # each adapter whose loading failed, with its path then
        self.kv_address = ""
        self.kv_layout = ""  # the KV cache's layout fingerprint, set by the roles that move KV
        self._stop = threading.Event()
        self._drain_requested = threading.Event()
        self.drain_deadline: float | None = None
        self.num_steps = 0
        self._started_at = time.time()
        self.heartbeat: HeartbeatThread | None = None
        self._registered = False
        if self.engine.runner.device.type == "cuda":
            self.metrics.watch_gpus(torch_device_uuids(self.engine.runner.device))
        self.metrics.serve(args.host, args.metrics_port, ready=self.ready)
        self.engine.on_started = self.announce_started

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def transfer_cache(self) -> tuple[Any, KVLayout] | None:
        """The cache a KV transfer moves blocks of, and its layout; None where none can (a tensor-parallel
        engine on GPUs: each rank's KV heads live on its own device)."""
        runner = self.engine.runner
        if runner.transfer_cache is None:
            return None
        return runner.transfer_cache, KVLayout.from_kv_cache(runner.transfer_cache, self.engine.model_id, runner.tp.size)

    def no_transfer_reason(self) -> str:
        runner = self.engine.runner
        return (f"KV transfer from a tensor-parallel engine on {runner.device.type} (--tensor-parallel-size "
                f"{runner.tp.size}) is not implemented: each rank's KV heads live on its own device")

    @property
    def kv_curve(self) -> CurveConfig | None:
        """CURVE keys of the KV plane: explicit ``PDSERVE_KV_CURVE_*`` settings, else the cluster key."""
        explicit = CurveConfig.from_env()
        if explicit is not None or self.cluster_key is None:
            return explicit
        return self.cluster_key.curve

    def ready(self) -> bool:
        """Loaded, seen in the registry at least once, and not draining: the ``/ready`` probe.

        Called from the metrics server's threads. Until the first registration is seen it reads
        Redis; after that a Redis outage does not make the engine unready (Redis is a hint).
        """
        if self.draining or self._stop.is_set():
            return False
        if not self._registered:
            entries = self.registry.try_instances(self.role) or []
            self._registered = any(entry.instance_id == self.instance_id for entry in entries)
        return self._registered

    # ------------------------------------------------------------ identity
    def info(self) -> InstanceInfo:
        stats = self.engine.stats()
        metrics_url = f"http://{self.args.host}:{self.args.metrics_port}/metrics" if self.args.metrics_port else ""
        return InstanceInfo(
            instance_id=self.instance_id, role=self.role, model=self.engine.model_id,
            control_address=self.control_address, kv_address=self.kv_address, metrics_url=metrics_url,
            block_size=self.engine.block_size, max_model_len=self.engine.max_model_len,
            num_requests_running=stats.num_requests_running, num_requests_waiting=stats.num_requests_waiting,
            kv_cache_usage_perc=stats.kv_cache_usage_perc, num_blocks=stats.num_blocks,
            num_blocks_in_use=stats.num_blocks - stats.num_free_blocks, draining=self.draining,
            started_at=self._started_at, kv_layout=self.kv_layout,
            lora_names=[] if self.engine.runner.lora is None else list(self.engine.runner.lora.slots),
            kv_window=self.engine.kv.sliding_window or 0,
        )

    # ------------------------------------------------------------ outputs
    def _send(self, address: str, msg: Any) -> None:
        """Send to a router without blocking; drops (and logs) if it cannot take it now. While a
        step's outputs are collected (``_collect_outputs``), a ``RequestOutput`` waits for the
        step's one batch to its router; anything else first flushes what waits for that router."""
        if self._pending_outputs is not None:
            if isinstance(msg, RequestOutput):
                self._pending_outputs.setdefault(address, []).append(msg)
                return
            self._flush_outputs(address)
        self._send_raw(address, encode(msg))

    def _send_raw(self, address: str, raw: bytes) -> None:
        sock = self._outputs.get(address)
        if sock is None:
            try:
                check_endpoint(address, "reply_to")
            except ValueError as exc:
                logger.warning("dropped a message: %s", exc)
                return
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _OUTPUT_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_OUTPUT_MESSAGE_BYTES)  # it receives nothing; bounded anyway
            if self.cluster_key is not None:
                self.cluster_key.connect_as_client(sock)
            sock.connect(address)
            self._outputs[address] = sock
        try:
            sock.send(raw, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("router %s is not taking outputs; dropped a message", address)

    @contextlib.contextmanager
    def _collect_outputs(self) -> Iterator[None]:
        """Outputs sent inside go out at the end as one ``OutputBatch`` per router (split only past
        ``MAX_OUTPUT_MESSAGE_BYTES``), each request's in the order they were sent: the router's
        receive cost is per message, and one step may hold hundreds of its requests."""
        if self._pending_outputs is not None:  # nested: the outer one flushes
            yield
            return
        self._pending_outputs = {}
        try:
            yield
        finally:
            for address in list(self._pending_outputs):
                self._flush_outputs(address)
            self._pending_outputs = None

    def _flush_outputs(self, address: str) -> None:
        assert self._pending_outputs is not None
        outputs = self._pending_outputs.pop(address, None)
        if not outputs:
            return
        if len(outputs) == 1:  # as before batching: nothing to gain from the envelope
            self._send_raw(address, encode(outputs[0]))
            return
        for raw in encode_output_batches(outputs, self.instance_id):
            self._send_raw(address, raw)

    def announce_started(self, request_ids: list[str]) -> None:
        """Tell each request's router, before the step that first computes them, that this instance
        runs them now (``RequestsStarted``): should it die in that step, the router knows they may
        have caused it, and that the requests still waiting here cannot have."""
        by_router: dict[str, list[str]] = {}
        for request_id in request_ids:
            record = self.records.get(request_id)
            if record is not None:
                by_router.setdefault(record.reply_to, []).extend(self.choice_group(request_id))
        for address, ids in by_router.items():
            self._send(address, RequestsStarted(instance_id=self.instance_id, request_ids=ids))

    def send_output(self, request_id: str, out: RequestOutput) -> None:
        """Send to the router that owns the request (after whatever tokens of it were held back);
        a finished request's record is forgotten."""
        record = self.records.get(request_id)
        if record is None:
            return
        held = self.stream_hold.take(request_id)
        if held is not None:
            self._send(record.reply_to, held)
        self._send(record.reply_to, out)
        if out.finish_reason is not None:
            self.forget(request_id)

    def send_token_output(self, request_id: str, out: RequestOutput) -> None:
        """``send_output`` of a step's tokens, unless ``--stream-interval`` holds them back."""
        if request_id not in self.records:
            return
        due = self.stream_hold.add(request_id, out)
        if due is not None:
            self.send_output(request_id, due)

    def forget(self, request_id: str) -> None:
        """Drop the service's record of a request (its outputs go nowhere now); may be called twice."""
        self.records.pop(request_id, None)
        self.stream_hold.drop(request_id)

    def to_wire(self, out: EngineOutput, phase: Phase) -> RequestOutput:
        return RequestOutput(
            request_id=out.request_id, new_token_ids=out.new_token_ids, logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs, finish_reason=out.finish_reason, num_prompt_tokens=out.num_prompt_tokens,  # type: ignore[arg-type]
            num_cached_tokens=out.num_cached_tokens, error=out.error, instance_id=self.instance_id,
            phase=phase,  # type: ignore[arg-type]
            embedding=out.embedding,
        )

    def error_output(self, request_id: str, error: str, phase: Phase, *, retryable: bool = False) -> RequestOutput:
        return RequestOutput(
            request_id=request_id, new_token_ids=[], finish_reason="error", error=error,
            instance_id=self.instance_id, phase=phase, retryable=retryable,  # type: ignore[arg-type]
        )

    def reject(
        self, msg: GenerateRequest, error: str, *, retryable: bool = False, overloaded: bool = False
    ) -> None:
        """Answer a request this service did not take, under each of its choice ids; the records
        (another request's, for a duplicate id) are left alone."""
        n = msg.sampling_params.n if 1 <= msg.sampling_params.n <= MAX_N else 1  # an invalid n: once
        for choice_id in choice_request_ids(msg.request_id, n):
            refusal = self.error_output(choice_id, error, self.phase_of(msg), retryable=retryable)
            refusal.overloaded = overloaded
            self._send(msg.reply_to, refusal)

    def fail(self, request_id: str, error: str, *, retryable: bool = False) -> None:
        """End a held request with an error: abort it here (blocks freed) and tell its router (after
        the tokens ``--stream-interval`` held back)."""
        record = self.records.get(request_id)
        held = self.stream_hold.take(request_id)
        self.on_abort(request_id)
        if record is not None:
            if held is not None:
                self._send(record.reply_to, held)
            self._send(record.reply_to, self.error_output(request_id, error, record.phase, retryable=retryable))

    # ------------------------------------------------------------ requests in
    def phase_of(self, msg: GenerateRequest) -> Phase:
        return "full"

    def admit(self, msg: GenerateRequest) -> None:
        """Hand a new request to the engine; raises ``ValueError`` (nothing held) when it is bad."""
        raise NotImplementedError

    def on_generate(self, msg: GenerateRequest) -> None:
        try:
            check_endpoint(msg.reply_to, "reply_to")
        except ValueError as exc:  # there is nowhere to send the error
            logger.warning("dropped request %r: %s", msg.request_id, exc)
            return
        self.heard_from(msg.reply_to)
        if self.draining:  # a refusal, as of a full queue: nothing started, the router sends it elsewhere
            self.reject(msg, f"instance {self.instance_id} is draining", retryable=True, overloaded=True)
            return
        if msg.request_id in self.records or self.engine.knows(msg.request_id):
            self.reject(msg, f"duplicate request_id {msg.request_id!r}")
            return
        bound = self.args.max_waiting_requests
        if bound and self.engine.stats().num_requests_waiting >= bound:
            self.reject(msg, f"instance {self.instance_id} is overloaded ({bound} requests waiting)",
                        retryable=True, overloaded=True)
            return
        try:
            self.admit(msg)
        except ValueError as exc:
            self.reject(msg, str(exc))
            return
        record = RequestRecord(msg, self.phase_of(msg))
        for choice_id in choice_request_ids(msg.request_id, msg.sampling_params.n):
            self.records[choice_id] = record

    def choice_group(self, request_id: str) -> list[str]:
        """Every choice id of the request that ``request_id`` is a choice of (itself for n = 1)."""
        record = self.records.get(request_id)
        if record is None:
            return [request_id]
        return choice_request_ids(record.request.request_id, record.request.sampling_params.n)

    def on_lora_update(self, msg: LoRAUpdate) -> None:
        """Load or unload a LoRA adapter between steps, and answer the router: the registry entry lists the
        adapters from the next heartbeat on. Loading one already here from the same path, or unloading one not
        here, is done already (this engine may have read the cluster's adapters first: ``_sync_adapters``)."""
        error = None
        try:
            if msg.lora_path is None:
                self._unload_adapter(msg.lora_name)
            elif self._adapter_paths.get(msg.lora_name) != msg.lora_path:
                self._load_adapter(msg.lora_name, msg.lora_path)
        except (ValueError, OSError) as exc:
            error = str(exc)
        logger.info("LoRA adapter %r %s%s", msg.lora_name, "unloaded" if msg.lora_path is None else "loaded",
                    "" if error is None else f" failed: {error}")
        self._send(msg.reply_to, RequestOutput(
            request_id=msg.request_id, new_token_ids=[], finish_reason="stop" if error is None else "error",
            error=error, instance_id=self.instance_id))

    def _load_adapter(self, name: str, path: str) -> None:
        self.engine.load_lora(LoRAModule(name, path))
        self._adapter_paths[name] = path

    def _unload_adapter(self, name: str) -> None:
        if name in self._adapter_paths:
            self.engine.unload_lora(name)
            del self._adapter_paths[name]
            # A slot is free: the cluster's adapters that found none (or failed otherwise) are tried again.
            self._failed_adapters.clear()
        self._from_cluster.discard(name)

    def _watch_adapters(self) -> None:
        """Thread: the cluster's runtime adapters, now and every ``ADAPTER_POLL_S`` (kept while Redis is down)."""
        assert self.runtime_adapters is not None
        while not self._stop.is_set():
            found = self.runtime_adapters.all()
            if found is not None:
                self._wanted_adapters = found
            self._stop.wait(ADAPTER_POLL_S)

    def _sync_adapters(self) -> None:
        """Between steps: load each runtime adapter of the cluster this engine lacks (one started after it was
        loaded: restarted, or added), and unload those it loaded so that the cluster no longer holds, once no
        request here has them. One that fails (no free slot, a path this host lacks) is logged and left; it is
        tried again when its entry changes, or once an adapter here is unloaded (a slot freed)."""
        wanted = self._wanted_adapters
        if wanted is None:
            return
        for name in [n for n in self._failed_adapters if n not in wanted]:  # removed: tried afresh if added again
            del self._failed_adapters[name]
        for name, path in wanted.items():
            if name in self._adapter_paths or self._failed_adapters.get(name) == path:
                continue
            try:
                self._load_adapter(name, path)
            except (ValueError, OSError) as exc:
                self._failed_adapters[name] = path
                logger.warning("runtime LoRA adapter %r (%s) not loaded: %s", name, path, exc)
                continue
            self._from_cluster.add(name)
            logger.info("runtime LoRA adapter %r loaded from the cluster's (%s)", name, path)
            self._beat_now()
        for name in sorted(self._from_cluster - wanted.keys()):
            try:
                self._unload_adapter(name)
            except ValueError:  # a request here still has it: next time
                continue
            logger.info("runtime LoRA adapter %r unloaded: the cluster no longer holds it", name)
            self._beat_now()

    def _beat_now(self) -> None:
        """The registry entry published now (its adapters changed), not at the next beat."""
        if self.heartbeat is not None:
            self.heartbeat.beat_now()

    def on_abort(self, request_id: str) -> None:
        """Drop the request wherever it is here and free its blocks; unknown ids are ignored."""
        self.engine.abort_request(request_id)
        self.forget(request_id)

    def heard_from(self, reply_to: str) -> None:
        """A router's lease is renewed by anything it sends; an address no connect may use is ignored."""
        try:
            check_endpoint(reply_to, "reply_to")
        except ValueError as exc:
            logger.warning("ignored a router heartbeat: %s", exc)
            return
        self.routers[reply_to] = time.monotonic()

    # ------------------------------------------------------------ hooks
    def on_outputs(self, outputs: list[EngineOutput]) -> None:
        raise NotImplementedError

    def poll_transfers(self) -> bool:
        """Advance transfers without blocking; True if anything happened."""
        return False

    def busy(self) -> bool:
        """Holds anything: requests, or transfers in either direction."""
        return self.engine.has_unfinished_requests() or bool(self.records)

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
            try:
                if isinstance(msg, AbortRequest):
                    self.on_abort(msg.request_id)
                elif isinstance(msg, RouterHeartbeat):
                    self.heard_from(msg.reply_to)
                elif isinstance(msg, LoRAUpdate):
                    self.on_lora_update(msg)
                else:
                    self.on_generate(msg)
            except Exception:  # one message's failure fails that message, never the engine
                logger.exception("handling a %s failed", type(msg).__name__)
                if isinstance(msg, GenerateRequest) and msg.request_id not in self.records:
                    self.reject(msg, "internal error while admitting the request")

    def _step(self) -> None:
        """One engine step; an exception fails the requests in the engine, not the process. What
        the step sends leaves as one message per router."""
        with self._collect_outputs():
            try:
                outputs = self.engine.step()
            except Exception:
                logger.exception("engine step failed; failing the requests it held")
                for request_id in self.engine.unfinished_request_ids():
                    self.fail(request_id, "internal engine error")
                return
            self.num_steps += 1
            self._observe(outputs)
            try:
                self.on_outputs(outputs)
            except Exception:
                logger.exception("handling step outputs failed; failing those requests")
                for out in outputs:
                    self.fail(out.request_id, "internal engine error")

    def _tick(self) -> None:
        """About twice a second: progress to every leased router, expired leases, drain deadline."""
        now = time.monotonic()
        progress = EngineProgress(instance_id=self.instance_id, num_steps=self.num_steps, draining=self.draining)
        for address, last in list(self.routers.items()):
            if now - last > self.args.router_lease_timeout:
                self._expire_router(address)
            else:
                self._send(address, progress)
        if self.runtime_adapters is not None:
            self._sync_adapters()
        if self.drain_deadline is not None and now > self.drain_deadline:
            held = list(self.records)
            logger.warning("drain timeout: handing %d requests back to their routers", len(held))
            for request_id in held:
                self.fail(request_id, f"instance {self.instance_id} drained", retryable=True)
            self.drain_deadline = now  # nothing may be left: stop now
            self._stop.set()

    def _expire_router(self, address: str) -> None:
        orphans = [rid for rid, record in self.records.items() if record.reply_to == address]
        if orphans:
            logger.warning("router %s went silent; aborting its %d requests", address, len(orphans))
        for request_id in orphans:
            # A router that was only slow (not dead) learns its request was dropped, and continues
            # it elsewhere; a dead one never reads this.
            self.fail(request_id, f"instance {self.instance_id} lost this router's lease", retryable=True)
        del self.routers[address]
        sock = self._outputs.pop(address, None)
        if sock is not None:
            sock.close(linger=200)  # long enough for those errors to leave, bounded if nobody reads

    def _check_idle_pool(self) -> None:
        """With nothing held, every block must be back in the pool: check it once per idle period."""
        try:
            self.engine.check_integrity()
            in_use = self.engine.num_blocks_in_use
            if in_use:
                raise AssertionError(f"{in_use} blocks in use with no request held")
        except AssertionError as exc:
            self.metrics.kv_integrity_errors.inc()
            logger.error("KV pool integrity check failed while idle: %s", exc)

    def _publish_prefix_events(self) -> None:
        if self._republish.is_set():
            # Redis came back (perhaps empty): publish everything this instance caches again.
            self._republish.clear()
            self.engine.drain_prefix_events()
            self._prefix_queue.append(([bytes(h) for h in self.engine.cached_block_hashes()], [], True))
            self._prefix_wakeup.set()
            return
        stored, removed = self.engine.drain_prefix_events()
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
        num_tokens = 0
        for out in outputs:
            num_tokens += len(out.new_token_ids)
            if out.queue_time is not None and out.prefill_time is not None:
                self.metrics.queue_time.observe(out.queue_time)
                self.metrics.prefill_time.observe(out.prefill_time)
        if num_tokens:  # one increment a step (a counter's takes a lock)
            self.metrics.generation_tokens.inc(num_tokens)

    def stop(self, *_: Any) -> None:
        """First call (SIGTERM, Ctrl-C): drain. A second one: stop now."""
        if self._drain_requested.is_set():
            self._stop.set()
        self._drain_requested.set()

    def _start_drain(self) -> None:
        self.drain_deadline = time.monotonic() + self.args.drain_timeout
        logger.info(
            "%s draining: %d requests held, up to %.0fs", self.instance_id, len(self.records), self.args.drain_timeout
        )
        if self.heartbeat is not None:
            self.heartbeat.beat_now()  # routers see ``draining`` and stop routing here

    def run(self) -> None:
        self._prefix_queue: list[tuple[list[bytes], list[bytes], bool]] = []
        self._prefix_wakeup = threading.Event()
        self._republish = threading.Event()
        self.prefix_index.clear_instance(self.instance_id)
        threading.Thread(target=self._prefix_publisher, daemon=True, name="prefix-publisher").start()
        self.heartbeat = HeartbeatThread(self.registry, self.info, 1.0, on_reconnect=self._republish.set)
        self.heartbeat.start()
        if self.runtime_adapters is not None:
            threading.Thread(target=self._watch_adapters, daemon=True, name="lora-adapters").start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        logger.info("%s %s ready: control %s kv %s", self.role, self.instance_id, self.control_address, self.kv_address)
        last_metrics = last_tick = 0.0
        was_busy = True
        try:
            while not self._stop.is_set():
                busy = self.busy()
                if was_busy and not busy:
                    # Here, before this iteration admits anything, nothing may hold a block.
                    self._check_idle_pool()
                was_busy = busy
                self._drain_control(0 if busy else _IDLE_POLL_MS)
                with self._collect_outputs():  # transfer failures of one poll: one message per router
                    self.poll_transfers()
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_prefix_events()
                now = time.monotonic()
                if now - last_tick >= PROGRESS_INTERVAL_S:
                    self._tick()
                    last_tick = now
                if now - last_metrics > 0.5:
                    self.metrics.update(self.engine.stats())
                    last_metrics = now
                if self._drain_requested.is_set() and not self.draining:
                    self._start_drain()
                if self.draining and not self.busy():
                    logger.info("%s drained", self.instance_id)
                    break
        finally:
            self.heartbeat.stop(deregister=True)
            self.prefix_index.clear_instance(self.instance_id)
            self.close()
            self.engine.close()
            for sock in self._outputs.values():
                sock.close(0)
            self.control.close(0)
            if self._zap is not None:
                self._zap.stop()
            self.ctx.destroy(linger=0)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def service_main(role: str, factory: Callable[[argparse.Namespace], EngineService], argv: list[str] | None) -> int:
    """Parse the service flags, build the service and run its loop until it drained (SIGTERM)."""
    parser = argparse.ArgumentParser(prog=f"pdserve {role}", description=f"run one {role} instance")
    add_service_args(parser, role)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    service = factory(args)
    # What start-up built (torch, the model, the tokenizer: about 300,000 tracked objects with the
    # default model) lives as long as the process: a full collection over it took 100 ms, a stall of
    # every stream here. Frozen, collections skip it.
    gc.collect()
    gc.freeze()
    service.run()
    return 0
