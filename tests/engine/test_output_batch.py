"""One engine step's outputs leave as one ``OutputBatch`` per router: the message, and the service.

The message round-trips, is size- and version-checked like every other, and splits under
``MAX_OUTPUT_MESSAGE_BYTES`` in order. A service step with many requests for two routers sends each
router exactly one message over real ZMQ, with each request's outputs in the order they were sent
(an error sent while the step's outputs are collected comes after the tokens before it).
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import msgspec
import pytest
import zmq

from common.engine.engine import EngineOutput
from common.protocol import (
    MAX_OUTPUT_MESSAGE_BYTES,
    EngineProgress,
    GenerateRequest,
    OutputBatch,
    PositionLogprobs,
    ProtocolError,
    RequestOutput,
    TokenLogprob,
    decode_output,
    encode,
    encode_output_batches,
    merge_outputs,
    request_outputs,
)
from common.sampling_params import SamplingParams
from common.service import EngineService, RequestRecord, StreamHold


def _output(i: int, **kw: Any) -> RequestOutput:
    return RequestOutput(request_id=f"req-{i}", new_token_ids=[i, i + 1], instance_id="decode-0", **kw)


def test_an_output_batch_round_trips_with_every_output_in_order() -> None:
    outs = [_output(i, logprobs=[PositionLogprobs(i, -0.5, [TokenLogprob(i, -0.5)])]) for i in range(5)]
    outs[-1].finish_reason = "length"
    msg = decode_output(encode(OutputBatch(instance_id="decode-0", outputs=outs)))
    assert isinstance(msg, OutputBatch) and msg.instance_id == "decode-0"
    assert request_outputs(msg) == outs
    single = decode_output(encode(outs[0]))
    assert request_outputs(single) == [outs[0]]
    assert request_outputs(decode_output(encode(EngineProgress(instance_id="d")))) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "output_batch", "version": 1, "outputs": [{"type": "output", "request_id": "", "new_token_ids": []}]},
        {"type": "output_batch", "version": 1, "outputs": [{"type": "progress", "instance_id": "x"}]},
        {"type": "output_batch", "version": 1, "outputs": "nope"},
        {"type": "output_batch", "version": 2, "outputs": []},
        {"type": "output_batch", "version": 1,
         "outputs": [{"type": "output", "version": 2, "request_id": "a", "new_token_ids": [1]}]},
        {"type": "output_batch", "version": 1,
         "outputs": [{"type": "output", "request_id": "a", "new_token_ids": ["x"]}]},
    ],
    ids=["empty-request-id", "not-an-output", "not-a-list", "batch-version", "inner-version", "bad-token"],
)
def test_a_malformed_output_batch_is_refused_as_a_protocol_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        decode_output(msgspec.msgpack.encode(bad))


def test_an_oversized_output_batch_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_output(b"\x00" * (MAX_OUTPUT_MESSAGE_BYTES + 1))


def test_batches_split_under_the_byte_bound_and_keep_the_order() -> None:
    outs = [_output(i) for i in range(300)]
    one = encode_output_batches(outs, "decode-0")
    assert len(one) == 1
    bound = len(one[0]) // 5
    parts = encode_output_batches(outs, "decode-0", max_bytes=bound)
    assert len(parts) >= 5 and all(len(raw) <= bound for raw in parts)
    assert [o for raw in parts for o in request_outputs(decode_output(raw))] == outs
    assert encode_output_batches([], "decode-0") == []


class _StubEngine:
    def __init__(self, outputs: list[EngineOutput]) -> None:
        self.outputs = outputs

    def step(self) -> list[EngineOutput]:
        return self.outputs

    def abort_request(self, request_id: str) -> None:
        pass


class _OutputPathService(EngineService):
    """The service's output path (records, sockets, the step) without a model: ``__init__`` skipped."""

    def __init__(
        self, ctx: zmq.Context, outputs: list[EngineOutput], fail_ids: set[str], stream_interval: int = 1
    ) -> None:
        self.instance_id = "decode-t"
        self.cluster_key = None
        self.ctx = ctx
        self._outputs = {}
        self._pending_outputs = None
        self.records = {}
        self.engine = _StubEngine(outputs)  # type: ignore[assignment]
        self.metrics = mock.Mock()
        self.num_steps = 0
        self.fail_ids = fail_ids
        self.stream_hold = StreamHold(stream_interval)

    def on_outputs(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            record = self.records.get(out.request_id)
            if record is not None:
                self.send_token_output(out.request_id, self.to_wire(out, record.phase))
            if out.request_id in self.fail_ids:  # e.g. a transfer that could not start
                self.fail(out.request_id, "failed after its token")


def _pull(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def _receive_all(sock: zmq.Socket, timeout_s: float = 5.0, settle_s: float = 0.3) -> list[bytes]:
    messages: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(int(settle_s * 1000)):
            messages.append(sock.recv())
        elif messages:
            break
    return messages


def test_a_step_sends_one_message_per_router_with_every_request_in_order() -> None:
    ctx = zmq.Context()
    (pull_a, addr_a), (pull_b, addr_b) = _pull(ctx), _pull(ctx)
    num = 300
    outputs = [
        EngineOutput(request_id=f"r{i}", new_token_ids=[i], finish_reason="length" if i % 7 == 0 else None,
                     num_prompt_tokens=3)
        for i in range(num)
    ]
    service = _OutputPathService(ctx, outputs, fail_ids={"r1"})
    for i in range(num):
        request = GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(),
                                  reply_to=addr_a if i % 3 else addr_b)
        service.records[request.request_id] = RequestRecord(request, "decode")
    try:
        service._step()
        got_a, got_b = _receive_all(pull_a), _receive_all(pull_b)
        assert len(got_a) == 1 and len(got_b) == 1  # one message each for ~100 and ~200 requests
        batch_a, batch_b = decode_output(got_a[0]), decode_output(got_b[0])
        assert isinstance(batch_a, OutputBatch) and batch_a.instance_id == "decode-t"
        ids_a = [o.request_id for o in batch_a.outputs]
        assert ids_a == ["r1", "r1", *(f"r{i}" for i in range(2, num) if i % 3)]
        # r1's token, then its error: the order it was sent in within the step.
        assert [o.finish_reason for o in batch_a.outputs[:2]] == [None, "error"]
        assert [o.request_id for o in request_outputs(batch_b)] == [f"r{i}" for i in range(num) if i % 3 == 0]
        assert all(o.phase == "decode" and o.instance_id == "decode-t" for o in batch_a.outputs)
        # Finished (and failed) requests are forgotten, the others still held.
        assert "r7" not in service.records and "r1" not in service.records and "r2" in service.records
        # A step with one output for a router sends it as a plain RequestOutput, as before batching.
        service.engine = _StubEngine([EngineOutput(request_id="r2", new_token_ids=[9])])  # type: ignore[assignment]
        service._step()
        [raw] = _receive_all(pull_a)
        assert isinstance(decode_output(raw), RequestOutput)
        assert _receive_all(pull_b, timeout_s=0.5) == []
    finally:
        for sock in [pull_a, pull_b, *service._outputs.values()]:
            sock.close(0)
        ctx.term()


def test_progress_sent_while_outputs_are_collected_follows_them() -> None:
    ctx = zmq.Context()
    pull, addr = _pull(ctx)
    service = _OutputPathService(ctx, [], set())
    try:
        with service._collect_outputs():
            service._send(addr, RequestOutput(request_id="a", new_token_ids=[1]))
            service._send(addr, RequestOutput(request_id="a", new_token_ids=[2]))
            service._send(addr, EngineProgress(instance_id="decode-t"))
            service._send(addr, RequestOutput(request_id="a", new_token_ids=[3]))
        kinds = [type(decode_output(raw)).__name__ for raw in _receive_all(pull)]
        assert kinds == ["OutputBatch", "EngineProgress", "RequestOutput"]
    finally:
        for sock in [pull, *service._outputs.values()]:
            sock.close(0)
        ctx.term()


# --------------------------------------------------------------------------- --stream-interval
def _token(request_id: str, token: int, finish: str | None = None, logprob: float | None = None) -> RequestOutput:
    logprobs = None if logprob is None else [PositionLogprobs(token, logprob, [TokenLogprob(token, logprob)])]
    return RequestOutput(request_id=request_id, new_token_ids=[token], logprobs=logprobs,
                         finish_reason=finish, phase="decode")  # type: ignore[arg-type]


def test_a_stream_hold_sends_the_first_token_at_once_then_every_interval_and_the_end_with_the_rest() -> None:
    hold = StreamHold(3)
    sent = [hold.add("a", _token("a", t, logprob=-t / 10)) for t in range(1, 8)]
    assert [None if s is None else s.new_token_ids for s in sent] == [
        [1], None, None, [2, 3, 4], None, None, [5, 6, 7],
    ]
    assert [lp.logprob for lp in sent[3].logprobs] == [-0.2, -0.3, -0.4]  # type: ignore[union-attr]
    assert hold.add("a", _token("a", 8)) is None and len(hold) == 1
    last = hold.add("a", _token("a", 9, finish="length"))
    assert last is not None and last.new_token_ids == [8, 9] and last.finish_reason == "length"
    assert len(hold) == 0


def test_held_tokens_can_be_taken_out_and_a_drop_forgets_them() -> None:
    hold = StreamHold(4)
    hold.add("a", _token("a", 1))
    assert hold.add("a", _token("a", 2)) is None
    assert hold.add("a", _token("a", 3)) is None
    held = hold.take("a")
    assert held is not None and held.new_token_ids == [2, 3] and held.finish_reason is None
    assert hold.take("a") is None
    hold.add("b", _token("b", 1))
    hold.add("b", _token("b", 2))
    hold.drop("b")
    assert len(hold) == 0
    assert hold.add("b", _token("b", 3)).new_token_ids == [3]  # type: ignore[union-attr]  # a new start: at once


def test_merged_outputs_keep_the_first_prompt_logprobs_and_the_last_state() -> None:
    first = RequestOutput(request_id="a", new_token_ids=[1], prompt_logprobs=[None], num_cached_tokens=16, phase="full")
    then = RequestOutput(request_id="a", new_token_ids=[2, 3], finish_reason="stop", phase="full")
    merged = merge_outputs(first, then)
    assert merged.new_token_ids == [1, 2, 3] and merged.prompt_logprobs == [None]
    assert merged.finish_reason == "stop" and merged.num_cached_tokens == 16 and merged.logprobs is None


def test_with_a_stream_interval_the_service_sends_each_request_every_interval_tokens_and_its_end() -> None:
    ctx = zmq.Context()
    pull, addr = _pull(ctx)
    service = _OutputPathService(ctx, [], set(), stream_interval=4)
    for rid in ("a", "b"):
        request = GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(),
                                  reply_to=addr)
        service.records[rid] = RequestRecord(request, "decode")
    received: list[RequestOutput] = []
    try:
        for step in range(10):
            service.engine = _StubEngine([  # type: ignore[assignment]
                EngineOutput(request_id="a", new_token_ids=[step], finish_reason="length" if step == 9 else None,
                             num_prompt_tokens=3),
                *([EngineOutput(request_id="b", new_token_ids=[100 + step], num_prompt_tokens=3)] if step < 6 else []),
            ])
            service._step()
            received += [o for raw in _receive_all(pull, timeout_s=0.5, settle_s=0.05) for o in request_outputs(decode_output(raw))]
        a = [o.new_token_ids for o in received if o.request_id == "a"]
        b = [o.new_token_ids for o in received if o.request_id == "b"]
        assert a == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
        assert b == [[100], [101, 102, 103, 104]]  # 105 waits for more (or for the request's end)
        assert "a" not in service.records and len(service.stream_hold) == 1
        service.fail("b", "draining", retryable=True)  # the held token first, then the error
        tail = [o for raw in _receive_all(pull, timeout_s=0.5, settle_s=0.05) for o in request_outputs(decode_output(raw))]
        assert [(o.new_token_ids, o.finish_reason) for o in tail] == [([105], None), ([], "error")]
        assert len(service.stream_hold) == 0 and "b" not in service.records
    finally:
        for sock in [pull, *service._outputs.values()]:
            sock.close(0)
        ctx.term()


def test_a_draining_service_refuses_a_new_request_as_a_refusal_not_a_loss() -> None:
    """Nothing started, so the router sends it elsewhere without counting a migration (a rolling
    restart would otherwise run requests out of them while routers still route here)."""
    ctx = zmq.Context()
    pull, addr = _pull(ctx)
    service = _OutputPathService(ctx, [], set())
    service.drain_deadline = time.monotonic() + 30
    service.routers = {}
    try:
        request = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(n=2),
                                  reply_to=addr)
        service.on_generate(request)
        refusals = [o for raw in _receive_all(pull, timeout_s=2, settle_s=0.1) for o in request_outputs(decode_output(raw))]
        assert len(refusals) == 2  # each choice
        assert all(o.finish_reason == "error" and o.retryable and o.overloaded and "draining" in (o.error or "")
                   for o in refusals)
        assert "r" not in service.records
    finally:
        for sock in [pull, *service._outputs.values()]:
            sock.close(0)
        ctx.term()
