"""An engine's control socket, spoken to directly as a router would: bad messages fail alone.

Real prefill and decode processes and a raw ZMQ client in place of the router. A duplicate id
fails the duplicate, not the original; a decode target the sender cannot use fails that request
and the prefill keeps serving; an engine sends progress to the routers it serves; a draining decode
refuses a prefill's KV as a refusal, not a loss.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from common.protocol import (
    AbortRequest,
    DecodeTarget,
    EngineProgress,
    GenerateRequest,
    RequestOutput,
    RequestsStarted,
    RouterHeartbeat,
    decode_output,
    encode,
    request_outputs,
)
from common.registry import Registry
from common.sampling_params import SamplingParams
from tests.conftest import RedisServer
from tests.e2e.stack import Stack
from tests.engine.conftest import model_path, prompt_ids

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class FakeRouter:
    """A PULL socket for outputs and a PUSH socket per engine, as the router has."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.ctx = ctx
        self.pushes: dict[str, zmq.Socket] = {}

    def send(self, address: str, msg: Any) -> None:
        if address not in self.pushes:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.pushes[address] = sock
        self.pushes[address].send(encode(msg))

    def until_finished(self, request_id: str, timeout_s: float = 120.0) -> list[RequestOutput]:
        """Every output of ``request_id`` until it finishes; progress messages are skipped."""
        outs: list[RequestOutput] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.pull.poll(200):
                continue
            for msg in request_outputs(decode_output(self.pull.recv())):
                if msg.request_id == request_id:
                    outs.append(msg)
                    if msg.finish_reason is not None:
                        return outs
        raise AssertionError(f"{request_id} did not finish in {timeout_s}s: {outs}")

    def close(self) -> None:
        for sock in [self.pull, *self.pushes.values()]:
            sock.close(0)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Stack, dict[str, Any]]]:
    redis = RedisServer()
    s = Stack(redis_url=redis.url, model=model_path())
    s.start_engine("prefill", "prefill-c")
    # Time enough to drain that the last test sees it draining on a loaded host (it ends the drain).
    s.start_engine("decode", "decode-c", ["--drain-timeout", "300"])
    try:
        yield s, s.wait_registered(2)
    finally:
        s.stop()
        redis.stop()


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    ctx = zmq.Context()
    r = FakeRouter(ctx)
    yield r
    r.close()
    ctx.term()


def _request(request_id: str, reply_to: str, **kw: Any) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt_ids()[0]),
                           sampling_params=GREEDY, reply_to=reply_to, **kw)


def test_a_duplicate_id_fails_the_duplicate_and_the_original_finishes(engines, router):  # type: ignore[no-untyped-def]
    s, infos = engines
    decode = infos["decode-c"].control_address
    other = FakeRouter(router.ctx)
    try:
        router.send(decode, _request("dup", router.address))
        router.send(decode, _request("dup", other.address))
        [refused] = other.until_finished("dup")
        assert refused.finish_reason == "error" and "duplicate" in (refused.error or "")
        assert not refused.retryable
        outs = router.until_finished("dup")
        assert outs[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs) == GREEDY.max_tokens
    finally:
        other.close()


def test_an_unusable_decode_target_fails_that_request_and_the_prefill_keeps_serving(engines, router):  # type: ignore[no-untyped-def]
    s, infos = engines
    prefill, decode = infos["prefill-c"], infos["decode-c"]
    bad = _request("bad-target", router.address, decode_target=DecodeTarget(instance_id="x", kv_address="x"))
    router.send(prefill.control_address, bad)
    outs = router.until_finished("bad-target")
    assert outs[-1].finish_reason == "error", outs
    assert s.procs["prefill-c"].popen.poll() is None, "one message killed the prefill"
    good = _request("good-target", router.address,
                    decode_target=DecodeTarget(instance_id=decode.instance_id, kv_address=decode.kv_address))
    router.send(prefill.control_address, good)
    outs = router.until_finished("good-target")
    assert outs[-1].finish_reason == "length"
    assert [o.phase for o in outs][0] == "prefill" and {o.phase for o in outs[1:]} == {"decode"}


def test_engines_send_progress_to_a_leased_router_and_abort_its_requests_when_it_goes_silent(engines, router):  # type: ignore[no-untyped-def]
    s, infos = engines
    decode = infos["decode-c"].control_address
    router.send(decode, RouterHeartbeat(reply_to=router.address))
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "no progress message from the engine"
        if router.pull.poll(200):
            msg = decode_output(router.pull.recv())
            if isinstance(msg, EngineProgress):
                assert msg.instance_id == "decode-c" and not msg.draining
                break
    # A long request, then silence: the engine's lease on this router (10 s by default) lapses
    # and the request is aborted, its blocks freed, long before its 2,000 tokens.
    long = GenerateRequest(request_id="orphan", prompt_token_ids=list(prompt_ids()[0]), reply_to=router.address,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True))
    router.send(decode, long)
    registry = Registry(s.redis_url)

    def blocks_in_use() -> int:
        info = next(i for i in registry.instances() if i.instance_id == "decode-c")
        return info.num_blocks_in_use

    deadline = time.monotonic() + 30
    while blocks_in_use() == 0:
        assert time.monotonic() < deadline, "the request never held blocks"
        time.sleep(0.2)
    started = time.monotonic()
    while blocks_in_use() > 0:
        assert time.monotonic() - started < 60, "the silent router's request was not aborted"
        time.sleep(0.2)
    # A router that was only slow, not dead, learns that its request was dropped (retryable).
    errors = []
    while router.pull.poll(1000):
        for msg in request_outputs(decode_output(router.pull.recv())):
            if msg.finish_reason == "error":
                errors.append((msg.request_id, msg.retryable))
    assert errors == [("orphan", True)]
    router.send(decode, AbortRequest(request_id="orphan"))  # harmless now: unknown ids are ignored


def test_engines_say_they_run_a_request_before_its_first_output(engines, router):  # type: ignore[no-untyped-def]
    """Disaggregated: the prefill process, then the decode process, each send ``RequestsStarted``
    for the request before the first output it sends of it, and once."""
    s, infos = engines
    prefill, decode = infos["prefill-c"], infos["decode-c"]
    request = _request("announced", router.address,
                       decode_target=DecodeTarget(instance_id=decode.instance_id, kv_address=decode.kv_address))
    router.send(prefill.control_address, request)
    seen: list[tuple[str, str]] = []  # (what, from which instance)
    deadline = time.monotonic() + 120
    while not seen or seen[-1][0] != "finished":
        assert time.monotonic() < deadline, f"the request did not finish: {seen}"
        if not router.pull.poll(200):
            continue
        msg = decode_output(router.pull.recv())
        if isinstance(msg, RequestsStarted) and "announced" in msg.request_ids:
            seen.append(("started", msg.instance_id))
        for out in request_outputs(msg):
            if out.request_id == "announced":
                seen.append(("finished" if out.finish_reason else "output", out.instance_id))
    assert seen[-1] == ("finished", "decode-c"), seen
    for instance in ("prefill-c", "decode-c"):  # each over its own socket: in order per instance
        from_it = [what for what, source in seen if source == instance]
        assert from_it[0] == "started" and from_it.count("started") == 1 and len(from_it) > 1, seen


def test_a_draining_decode_refuses_the_prefill_s_kv_as_a_refusal_not_a_loss(engines, router):  # type: ignore[no-untyped-def]
    """The router's view lags a drain: the KV a prefill offers a draining decode is refused as busy,
    and the prefill reports it as a refusal (``overloaded``), so the router sends the request again
    elsewhere without spending one of its few migrations. Both pools get their blocks back. Last
    in this module: the decode exits."""
    s, infos = engines
    prefill, decode = infos["prefill-c"], infos["decode-c"]
    registry = Registry(s.redis_url)

    def view(name: str) -> Any:
        return next(i for i in registry.instances() if i.instance_id == name)

    holder = GenerateRequest(request_id="holder", prompt_token_ids=list(prompt_ids()[0]), reply_to=router.address,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True))
    router.send(decode.control_address, holder)  # keeps the decode draining until it is aborted
    deadline = time.monotonic() + 120
    while view("decode-c").num_blocks_in_use == 0:
        assert time.monotonic() < deadline, "the holder never ran"
        time.sleep(0.2)
    s.procs["decode-c"].popen.send_signal(signal.SIGTERM)
    while not view("decode-c").draining:
        assert time.monotonic() < deadline, "the decode never said it drains"
        time.sleep(0.1)
    request = _request("offered", router.address,
                       decode_target=DecodeTarget(instance_id=decode.instance_id, kv_address=decode.kv_address))
    router.send(prefill.control_address, request)
    outs = router.until_finished("offered")
    first, refusal = outs[0], outs[-1]
    assert first.phase == "prefill" and len(first.new_token_ids) == 1, outs
    assert refusal.finish_reason == "error" and refusal.retryable and refusal.overloaded, refusal
    assert "draining" in (refusal.error or "") and refusal.instance_id == "prefill-c", refusal
    router.send(decode.control_address, AbortRequest(request_id="holder"))
    assert s.procs["decode-c"].popen.wait(120) == 0, s.procs["decode-c"].log()
    while view("prefill-c").num_blocks_in_use > 0:
        assert time.monotonic() < deadline + 120, "the prefill kept the refused request's blocks"
        time.sleep(0.2)
