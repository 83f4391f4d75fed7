"""Hostile messages on every ZMQ socket of live engines: the processes survive, then serve.

Real prefill and decode processes. Hypothesis-generated, well-typed messages with extreme or
invalid field values go to both control sockets and to the decode's KV socket, followed by pickles
(one that would create a file if anything unpickled it), garbage and frames above each socket's
size limit. Afterwards both processes are alive, nothing was unpickled, and a request through
prefill -> KV transfer -> decode is served. A longer run: ``pdserve bench fuzz``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from common.protocol import DecodeTarget, GenerateRequest, RequestOutput, decode_output, request_outputs
from common.sampling_params import SamplingParams
from ops.bench.fuzz_messages import FuzzStats, abort_all, fuzz_control, fuzz_kv, pickle_marker
from tests.conftest import RedisServer
from tests.e2e.stack import Stack
from tests.e2e.test_engine_control_plane import FakeRouter
from tests.engine.conftest import model_path, prompt_ids

pytestmark = pytest.mark.timeout(600)

NUM_EXAMPLES = 40  # per socket; ``pdserve bench fuzz --examples N`` runs more
WAITING_BOUND = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Stack, dict[str, Any]]]:
    redis = RedisServer()
    s = Stack(redis_url=redis.url, model=model_path())
    bound = ["--max-waiting-requests", str(WAITING_BOUND)]
    s.start_engine("prefill", "prefill-z", bound)
    s.start_engine("decode", "decode-z", bound)
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


def _alive(s: Stack) -> None:
    for proc in s.procs.values():
        assert proc.popen.poll() is None, f"{proc.name} died:\n{proc.log()}"


def test_hostile_messages_on_every_engine_socket_leave_both_engines_serving(engines, router) -> None:  # type: ignore[no-untyped-def]
    s, infos = engines
    prefill, decode = infos["prefill-z"], infos["decode-z"]
    stats = FuzzStats()
    kv_addresses = [decode.kv_address]
    with pickle_marker() as marker:
        for name, info in (("prefill control", prefill), ("decode control", decode)):
            fuzz_control(router.ctx, info.control_address, router.address, kv_addresses, stats,
                         max_examples=NUM_EXAMPLES, name=name, marker=marker)
            _alive(s)
        fuzz_kv(router.ctx, decode.kv_address, router.address, stats, max_examples=NUM_EXAMPLES,
                name="decode kv", marker=marker)
        for info in (prefill, decode):
            abort_all(router.ctx, info.control_address, stats.request_ids)
        print(f"\nmessages sent per socket: {dict(stats.sent)}")
        _alive(s)
        assert not os.path.exists(marker), "a socket unpickled a payload"
    assert min(stats.sent.values()) >= NUM_EXAMPLES // 2, stats.sent

    target = DecodeTarget(instance_id=decode.instance_id, kv_address=decode.kv_address)
    for request_id, address, decode_target in (("after-fuzz-pd", prefill.control_address, target),
                                               ("after-fuzz-d", decode.control_address, None)):
        request = GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt_ids()[0]),
                                  sampling_params=GREEDY, reply_to=router.address, decode_target=decode_target)
        deadline = time.monotonic() + 120
        while True:  # an overloaded refusal (the fuzzer's requests still queued) is tried again
            router.send(address, request)
            outs = router.until_finished(request_id, timeout_s=180)
            if not outs[-1].overloaded or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert outs[-1].finish_reason == "length", outs[-1]
        assert sum(len(o.new_token_ids) for o in outs) == GREEDY.max_tokens
    _alive(s)


def test_an_engine_past_its_waiting_bound_refuses_with_a_retryable_overloaded_error(engines, router) -> None:  # type: ignore[no-untyped-def]
    s, infos = engines
    decode = infos["decode-z"].control_address
    num = 80  # more than --max-num-seqs (32) + the waiting bound, sent in one burst
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(num):
        router.send(decode, GenerateRequest(request_id=f"burst-{i}", prompt_token_ids=list(prompt_ids()[0]),
                                            sampling_params=params, reply_to=router.address))
    finished: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + 300
    while len(finished) < num:
        assert time.monotonic() < deadline, f"only {len(finished)} of {num} requests ended"
        if not router.pull.poll(200):
            continue
        for msg in request_outputs(decode_output(router.pull.recv())):
            if msg.request_id.startswith("burst-") and msg.finish_reason:
                finished[msg.request_id] = msg
    refused = [m for m in finished.values() if m.finish_reason == "error"]
    served = [m for m in finished.values() if m.finish_reason == "length"]
    assert refused and served, {m.finish_reason for m in finished.values()}
    assert all(m.overloaded and m.retryable and "overloaded" in (m.error or "") for m in refused), refused[:3]
    assert len(served) + len(refused) == num
    _alive(s)
