"""Real prefill and decode processes started with a cluster key, spoken to as a router would.

With the key a request runs through every plane (control, reply, KV transfer). A socket without
the key, or with another key, cannot submit or abort: its handshake fails and the engine never
sees the message. Addresses in messages that no connect may use fail that request alone.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from common.cluster_key import ENV_KEY, ClusterKey
from common.protocol import (
    AbortRequest,
    DecodeTarget,
    GenerateRequest,
    RequestOutput,
    decode_output,
    encode,
    request_outputs,
)
from common.registry import InstanceInfo, Registry
from common.sampling_params import SamplingParams
from kvtransfer.wire.curve import CurveConfig, make_client
from tests.conftest import RedisServer
from tests.e2e.stack import Stack
from tests.engine.conftest import model_path, prompt_ids

pytestmark = pytest.mark.timeout(900)

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class KeyedRouter:
    """What the router holds: a reply socket (a CURVE server admitting the cluster key) and a
    CURVE client PUSH socket per engine."""

    def __init__(self, key: ClusterKey) -> None:
        self.key = key
        self.ctx = zmq.Context()
        self.zap = key.authenticate(self.ctx)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        key.serve(self.pull)
        self.address = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.pushes: dict[str, zmq.Socket] = {}
        self.others: list[RequestOutput] = []

    def send(self, address: str, msg: Any) -> None:
        if address not in self.pushes:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            self.key.connect_as_client(sock)
            sock.connect(address)
            self.pushes[address] = sock
        self.pushes[address].send(encode(msg))

    def outputs(self, request_id: str, timeout_s: float, until_finished: bool = True) -> list[RequestOutput]:
        """Outputs of ``request_id`` until it finishes (or, with ``until_finished=False``, until the
        timeout); outputs of other requests are kept in ``self.others``."""
        outs: list[RequestOutput] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.pull.poll(200):
                continue
            for msg in request_outputs(decode_output(self.pull.recv())):
                if msg.request_id != request_id:
                    self.others.append(msg)
                    continue
                outs.append(msg)
                if until_finished and msg.finish_reason is not None:
                    return outs
        if until_finished:
            raise AssertionError(f"{request_id} did not finish in {timeout_s}s: {outs}")
        return outs

    def close(self) -> None:
        for sock in [self.pull, *self.pushes.values()]:
            sock.close(0)
        self.zap.stop()
        self.ctx.term()


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Stack, ClusterKey, dict[str, InstanceInfo]]]:
    key = ClusterKey.generate()
    redis = RedisServer()
    s = Stack(redis_url=redis.url, model=model_path(), env={ENV_KEY: key.secret_text})
    s.start_engine("prefill", "prefill-k")
    s.start_engine("decode", "decode-k")
    try:
        yield s, key, s.wait_registered(2, Registry(redis.url, cluster_key=key), timeout_s=600)
    finally:
        s.stop()
        redis.stop()


@pytest.fixture
def router(cluster: tuple[Stack, ClusterKey, dict[str, InstanceInfo]]) -> Iterator[KeyedRouter]:
    r = KeyedRouter(cluster[1])
    yield r
    r.close()


def _request(request_id: str, reply_to: str, max_tokens: int = 8, **kw: Any) -> GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt_ids()[0]),
                           sampling_params=params, reply_to=reply_to, **kw)


def _outsider(ctx: zmq.Context, address: str, curve: CurveConfig | None) -> tuple[zmq.Socket, zmq.Socket]:
    """A PUSH socket to ``address`` (a CURVE client with ``curve``, else plain) and its monitor."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    # Where the refused handshake has already dropped the connection, a send has no peer to queue for and
    # would wait forever: it gives up (``_send``).
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    if curve is not None:
        make_client(sock, curve)
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    return sock, monitor


def _send(sock: zmq.Socket, data: bytes) -> None:
    """Queue ``data`` where the socket still has a connection to queue for; an outsider's whose refused
    handshake already dropped it sends nothing, which refuses it all the same."""
    with contextlib.suppress(zmq.Again):
        sock.send(data)


def _handshake_outcome(monitor: zmq.Socket, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(200):
            return int(recv_monitor_message(monitor)["event"])
    raise AssertionError("no handshake outcome")


def _outsiders(key: ClusterKey) -> dict[str, CurveConfig | None]:
    stranger = ClusterKey.generate().curve
    # Another cluster's pair that knows this cluster's public key: CURVE works, ZAP refuses it.
    return {"no key": None, "another key": CurveConfig(stranger.public_key, stranger.secret_key, key.public_key)}


def test_with_the_key_a_request_crosses_control_reply_and_kv_planes(cluster: Any, router: KeyedRouter) -> None:
    _, _, infos = cluster
    prefill, decode = infos["prefill-k"], infos["decode-k"]
    target = DecodeTarget(instance_id=decode.instance_id, kv_address=decode.kv_address)
    router.send(prefill.control_address, _request("keyed", router.address, decode_target=target))
    outs = router.outputs("keyed", 300)
    assert outs[-1].finish_reason == "length", outs
    assert outs[0].phase == "prefill" and {o.phase for o in outs[1:]} == {"decode"}
    assert sum(len(o.new_token_ids) for o in outs) == 8


@pytest.mark.parametrize("who", ["no key", "another key"])
def test_a_socket_without_the_key_cannot_submit(cluster: Any, router: KeyedRouter, who: str) -> None:
    _, key, infos = cluster
    decode = infos["decode-k"].control_address
    ctx = zmq.Context()
    sock, monitor = _outsider(ctx, decode, _outsiders(key)[who])
    try:
        rid = f"outsider-{uuid.uuid4().hex[:6]}"
        _send(sock, encode(_request(rid, router.address)))  # queued; would be answered to the real router
        assert _handshake_outcome(monitor) & HANDSHAKE_FAILED
        router.send(decode, _request("insider", router.address))
        assert router.outputs("insider", 300)[-1].finish_reason == "length"
        router.outputs(rid, 3, until_finished=False)
        assert [o for o in router.others if o.request_id == rid] == []
    finally:
        monitor.close(0)
        sock.close(0)
        ctx.term()


def test_a_socket_without_the_key_cannot_abort_and_one_with_it_can(cluster: Any, router: KeyedRouter) -> None:
    s, key, infos = cluster
    decode = infos["decode-k"].control_address
    router.send(decode, _request("long", router.address, max_tokens=2000))
    first: list[RequestOutput] = []
    deadline = time.monotonic() + 300
    while not first:
        assert time.monotonic() < deadline, "the long request never started"
        first = router.outputs("long", 1, until_finished=False)
    ctx = zmq.Context()
    try:
        for who, curve in _outsiders(key).items():
            sock, monitor = _outsider(ctx, decode, curve)
            _send(sock, encode(AbortRequest(request_id="long")))
            assert _handshake_outcome(monitor) & HANDSHAKE_FAILED, who
            monitor.close(0)
            sock.close(0)
            later = router.outputs("long", 3, until_finished=False)
            assert later and all(o.finish_reason is None for o in later), f"{who} aborted the request"
    finally:
        ctx.term()
    router.send(decode, AbortRequest(request_id="long"))
    registry = Registry(s.redis_url, cluster_key=key)

    def running() -> int:
        return next(i for i in registry.instances() if i.instance_id == "decode-k").num_requests_running

    deadline = time.monotonic() + 120
    while running() > 0:
        assert time.monotonic() < deadline, "the keyed abort did not end the request"
        time.sleep(0.2)


def test_addresses_no_connect_may_use_fail_only_that_request(cluster: Any, router: KeyedRouter) -> None:
    s, _, infos = cluster
    prefill, decode = infos["prefill-k"], infos["decode-k"]
    for bad in ("inproc://decode", "tcp://*:5555", "tcp://127.0.0.1"):
        rid = f"bad-kv-{uuid.uuid4().hex[:6]}"
        target = DecodeTarget(instance_id="decode-k", kv_address=bad)
        router.send(prefill.control_address, _request(rid, router.address, decode_target=target))
        [refused] = router.outputs(rid, 60)
        assert refused.finish_reason == "error" and "decode_target.kv_address" in (refused.error or ""), refused
    for bad_reply in ("inproc://router", "tcp://0.0.0.0:1", "pgm://x"):
        router.send(decode.control_address, _request(f"bad-reply-{bad_reply[:3]}", bad_reply))
    router.send(decode.control_address, _request("after-bad", router.address))
    assert router.outputs("after-bad", 300)[-1].finish_reason == "length"
    for name in ("prefill-k", "decode-k"):
        assert s.procs[name].popen.poll() is None, s.procs[name].log()
    assert "dropped request 'bad-reply-inp'" in s.procs["decode-k"].log()
