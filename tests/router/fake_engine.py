"""Fake prefill/decode engines for router tests: real ZMQ sockets and a real registry entry, no model.

Every request is answered with the same canned token ids (cut at ``max_tokens``). A prefill engine
sends the first token (``phase="prefill"``) and hands the request to the decode engine named in
``decode_target`` (in process, standing in for the KV transfer); the decode engine sends the rest.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from common.cluster_key import ClusterKey
from common.protocol import (
    AbortRequest,
    GenerateRequest,
    PositionLogprobs,
    ProtocolError,
    RequestOutput,
    RequestsStarted,
    TokenLogprob,
    choice_request_ids,
    decode_input,
    encode,
)
from common.registry import HeartbeatThread, InstanceInfo, Registry

MODEL_ID = "fake-model"


@dataclass
class _Active:
    request: GenerateRequest
    produced: int
    phase: str
    next_time: float = 0.0


class FakeEngine(threading.Thread):
    """``mode``: "ok", "error" (answers with an error output), "silent" (never answers),
    "transfer-fail-once" (the first request fails as a lost KV transfer, later ones are "ok") or
    "lose-midstream-once" (after its third token, the first request this engine streams fails as
    lost, retryable; later ones are "ok"), "lose-choice-1-midstream-once" (the same for the first
    choice 1 of an n > 1 request) or "stall-once" (after its third token, the first request
    it streams gets nothing more, while the engine stays registered, as a step that never ends) or
    "overloaded-once" (refuses its first request as overloaded, as a full waiting queue does) or
    "kv-busy-once" (a prefill: after the first token of its first request, that request fails as
    refused, as when the decode it offers the KV to is draining) or
    "restart-once" (after its third token, the first request it streams is forgotten, as by a
    process restarted under the same id: the registry entry gets a new ``started_at``, and nothing
    else tells the router). A continued request (``output_token_ids``) resumes
    the canned tokens after the ones it already has.

    ``announce``: it tells the router it runs each request as it takes it (``RequestsStarted``), as
    the real engines do before a request's first step. ``restarts_on_arrival``: the first that many
    requests it takes are forgotten at once by a restart under the same id (as "restart-once")."""

    def __init__(
        self,
        role: str,
        instance_id: str,
        redis_url: str,
        namespace: str,
        reply_tokens: list[int],
        peers: dict[str, FakeEngine],
        token_delay_s: float = 0.005,
        block_size: int = 16,
        mode: str = "ok",
        cluster_key: ClusterKey | None = None,
        announce: bool = False,
        restarts_on_arrival: int = 0,
        max_model_len: int = 256,
        model_id: str = MODEL_ID,
        kv_window: int = 0,
    ) -> None:
        super().__init__(name=f"fake-{instance_id}", daemon=True)
        self.kv_window = kv_window  # what it says its model's window is (``InstanceInfo.kv_window``)
        self.model_id = model_id  # what it says it serves: a router process serves its own model's instances only
        self.max_model_len = max_model_len
        # ``drain(lag_s)``: refuses new requests from then on, as a draining engine does, and says
        # so in the registry only ``lag_s`` later (a heartbeat that has not landed yet).
        self.draining_since: float | None = None
        self.registry_lag_s = 0.0
        self.num_draining_refusals = 0
        self.cluster_key = cluster_key
        self.role = role
        self.instance_id = instance_id
        self.reply_tokens = reply_tokens
        self.peers = peers
        self.token_delay_s = token_delay_s
        self.block_size = block_size
        self.kv_layout = ""  # as a real engine publishes it; a test may set it before the engine starts
        self.lora_names: list[str] = []  # the LoRA adapters it says it serves (likewise)
        self.mode = mode
        self.announce = announce
        self.restarts_on_arrival = restarts_on_arrival
        self.requests: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.handoffs: queue.Queue[tuple[GenerateRequest, int]] = queue.Queue()
        self._registry = Registry(redis_url, namespace, ttl_s=1.0, cluster_key=cluster_key)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._active: dict[str, _Active] = {}
        self._aborted: set[str] = set()
        self.address = ""
        self._heartbeat: HeartbeatThread | None = None
        self.started_at = time.time()

    def info(self) -> InstanceInfo:
        return InstanceInfo(
            instance_id=self.instance_id,
            role=self.role,
            model=self.model_id,
            control_address=self.address,
            kv_address=f"inproc://{self.instance_id}",
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            num_requests_running=len(self._active),
            started_at=self.started_at, kv_layout=self.kv_layout, lora_names=self.lora_names, kv_window=self.kv_window,
            draining=self.draining_since is not None and time.monotonic() - self.draining_since >= self.registry_lag_s,
        )

    def drain(self, registry_lag_s: float = 0.0) -> None:
        self.registry_lag_s = registry_lag_s
        self.draining_since = time.monotonic()

    def start(self) -> None:
        super().start()
        assert self._ready.wait(5), "fake engine did not start"
        self._heartbeat = HeartbeatThread(self._registry, self.info, interval_s=0.2)
        self._heartbeat.start()

    def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._stopping.set()
        self.join(5)

    def run(self) -> None:
        ctx = zmq.Context()
        zap = self.cluster_key.authenticate(ctx) if self.cluster_key is not None else None
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        if self.cluster_key is not None:
            self.cluster_key.serve(pull)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        replies: dict[str, zmq.Socket] = {}
        self._ready.set()
        try:
            while not self._stopping.is_set():
                if pull.poll(2):
                    self._handle(pull.recv(), replies, ctx)
                while not self.handoffs.empty():
                    request, produced = self.handoffs.get()
                    if request.request_id not in self._aborted:
                        self._active[request.request_id] = _Active(request, produced, "decode")
                self._step(replies, ctx)
        finally:
            for sock in [pull, *replies.values()]:
                sock.close(linger=0)
            if zap is not None:
                zap.stop()
            ctx.term()

    def _send(self, replies: dict[str, zmq.Socket], ctx: zmq.Context, to: str, out: RequestOutput | RequestsStarted) -> None:
        if to not in replies:
            replies[to] = ctx.socket(zmq.PUSH)
            replies[to].setsockopt(zmq.LINGER, 0)
            if self.cluster_key is not None:
                self.cluster_key.connect_as_client(replies[to])
            replies[to].connect(to)
        replies[to].send(encode(out))

    def _handle(self, raw: bytes, replies: dict[str, zmq.Socket], ctx: zmq.Context) -> None:
        try:
            msg = decode_input(raw)
        except ProtocolError:
            return
        if isinstance(msg, AbortRequest):
            self.aborts.append(msg.request_id)
            self._aborted.add(msg.request_id)
            self._active.pop(msg.request_id, None)
            return
        if not isinstance(msg, GenerateRequest):  # e.g. a router's lease renewal: nothing to answer
            return
        self.requests.append(msg)
        choice_ids = choice_request_ids(msg.request_id, msg.sampling_params.n)
        if self.announce:
            started = RequestsStarted(instance_id=self.instance_id, request_ids=choice_ids)
            self._send(replies, ctx, msg.reply_to, started)
        if self.restarts_on_arrival > 0:
            self.restarts_on_arrival -= 1
            self._restart()
            return
        # n > 1: like the real engines, one request whose choice i answers as ``choice_request_id``.
        for choice_id in choice_ids:
            params = msgspec.structs.replace(msg.sampling_params, n=1)
            self._generate(msgspec.structs.replace(msg, request_id=choice_id, sampling_params=params), replies, ctx)

    def _generate(self, msg: GenerateRequest, replies: dict[str, zmq.Socket], ctx: zmq.Context) -> None:
        if self.mode == "silent":
            return
        if self.draining_since is not None:  # refused as the real engines refuse while draining
            self.num_draining_refusals += 1
            refusal = RequestOutput(request_id=msg.request_id, new_token_ids=[], finish_reason="error",
                                    error=f"instance {self.instance_id} is draining", retryable=True, overloaded=True)
            refusal.instance_id = self.instance_id
            self._send(replies, ctx, msg.reply_to, refusal)
            return
        if self.mode == "overloaded-once":  # refuses its first request as a full waiting queue does
            self.mode = "ok"
            refusal = RequestOutput(request_id=msg.request_id, new_token_ids=[], finish_reason="error",
                                    error="overloaded", retryable=True, overloaded=True)
            refusal.instance_id = self.instance_id
            self._send(replies, ctx, msg.reply_to, refusal)
            return
        if self.mode in ("error", "transfer-fail-once"):
            error = "boom" if self.mode == "error" else "KV transfer failed: peer went away"
            if self.mode == "transfer-fail-once":
                self.mode = "ok"
            out = RequestOutput(
                request_id=msg.request_id, new_token_ids=[], finish_reason="error", error=error,
                retryable=self.mode == "ok",
            )
            out.instance_id = self.instance_id
            self._send(replies, ctx, msg.reply_to, out)
            return
        resumed = len(msg.output_token_ids)
        if msg.decode_target is None:
            self._active[msg.request_id] = _Active(msg, resumed, "full")
            return
        # Prefill: the first token now, then hand over to the decode instance.
        active = _Active(msg, resumed, "prefill")
        self._emit(active, replies, ctx)
        if self.mode == "kv-busy-once":
            self.mode = "ok"
            refused = RequestOutput(request_id=msg.request_id, new_token_ids=[], finish_reason="error",
                                    error="KV transfer failed: refused: instance decode-0 is draining",
                                    phase="prefill", retryable=True, overloaded=True)
            refused.instance_id = self.instance_id
            self._send(replies, ctx, msg.reply_to, refused)
            return
        if active.produced < self._limit(msg):
            self.peers[msg.decode_target.instance_id].handoffs.put((msg, active.produced))

    def _restart(self) -> None:
        """As a process restarted under the same id: it holds nothing, and registers as another."""
        self._active.clear()
        self.started_at += 1.0

    def _limit(self, request: GenerateRequest) -> int:
        return min(request.sampling_params.max_tokens, len(self.reply_tokens))

    def _emit(self, active: _Active, replies: dict[str, zmq.Socket], ctx: zmq.Context) -> None:
        request = active.request
        token_id = self.reply_tokens[active.produced]
        active.produced += 1
        finish = None
        if active.produced >= self._limit(request):
            finish = "length" if active.produced >= request.sampling_params.max_tokens else "stop"
        logprobs = None
        k = request.sampling_params.logprobs
        if k is not None:
            top = [TokenLogprob(token_id, -0.25), *(TokenLogprob(t, -2.0) for t in range(k))][: max(k, 1)]
            logprobs = [PositionLogprobs(token_id, -0.25, top)]
        out = RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            logprobs=logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=self.block_size if len(request.prompt_token_ids) > self.block_size else 0,
            instance_id=self.instance_id,
            phase=active.phase,  # type: ignore[arg-type]
        )
        self._send(replies, ctx, request.reply_to, out)

    def _step(self, replies: dict[str, zmq.Socket], ctx: zmq.Context) -> None:
        now = time.monotonic()
        for request_id, active in list(self._active.items()):
            if active.next_time > now:
                continue
            self._emit(active, replies, ctx)
            active.next_time = now + self.token_delay_s
            if active.produced >= self._limit(active.request):
                del self._active[request_id]
            elif self.mode == "restart-once" and active.produced == 3:
                self.mode = "ok"
                self._restart()
            elif self.mode == "stall-once" and active.produced == 3:
                self.mode = "ok"
                del self._active[request_id]  # silence from here on for this request
            elif (self.mode == "lose-midstream-once" or (self.mode == "lose-choice-1-midstream-once"
                                                         and request_id.endswith("#1"))) and active.produced == 3:
                self.mode = "ok"
                del self._active[request_id]
                lost = RequestOutput(
                    request_id=request_id, new_token_ids=[], finish_reason="error", error="lost on purpose",
                    instance_id=self.instance_id, phase=active.phase, retryable=True,  # type: ignore[arg-type]
                )
                self._send(replies, ctx, active.request.reply_to, lost)


class FakeCluster:
    """``num_prefill`` + ``num_decode`` fake engines registered under one namespace."""

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        reply_tokens: list[int],
        num_prefill: int = 1,
        num_decode: int = 1,
        decode_mode: str | None = None,
        **engine_kw: Any,
    ) -> None:
        """``decode_mode`` overrides ``mode`` for the decode engines."""
        self.peers: dict[str, FakeEngine] = {}
        roles = [("prefill", i) for i in range(num_prefill)] + [("decode", i) for i in range(num_decode)]
        for role, i in roles:
            kw = dict(engine_kw)
            if role == "decode" and decode_mode is not None:
                kw["mode"] = decode_mode
            engine = FakeEngine(
                role, f"{role}-{i}", redis_url, namespace, reply_tokens, self.peers, **kw
            )  # type: ignore[arg-type]
            self.peers[engine.instance_id] = engine

    def __enter__(self) -> FakeCluster:
        for engine in self.peers.values():
            engine.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for engine in self.peers.values():
            engine.stop()

    def engine(self, instance_id: str) -> FakeEngine:
        return self.peers[instance_id]

    def requests(self) -> list[GenerateRequest]:
        return [r for e in self.peers.values() for r in e.requests]

    def aborts(self) -> dict[str, list[str]]:
        return {e.instance_id: list(e.aborts) for e in self.peers.values()}
