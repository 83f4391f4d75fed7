"""Hostile messages for an engine's sockets: well-typed wire messages with extreme or invalid field
values (Hypothesis strategies), and raw payloads no socket should act on (pickle, garbage, frames
above the socket's size limit). Used by ``pdserve bench fuzz`` and ``tests/security``.

``fuzz_control`` speaks to an engine's control socket as a router would (PUSH); ``fuzz_kv`` to a
decode instance's KV socket as a prefill's sender would (DEALER): a Hello, then offers, data and
aborts. Neither waits for the engine to act; whether it survived is the caller's check.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pickle
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.protocol import (
    MAX_MESSAGE_BYTES,
    AbortRequest,
    DecodeTarget,
    GenerateRequest,
    RouterHeartbeat,
    TransferMeta,
)
from common.protocol import encode as encode_engine
from common.sampling_params import SamplingParams, StructuredOutput
from kvtransfer.blocks.layout import KVLayout
from kvtransfer.wire.messages import Abort, Data, Hello, Offer
from kvtransfer.wire.messages import encode as encode_kv

Prepare = Callable[[zmq.Socket], None]

# A KV frame larger than any receiver takes (its limit is at most the 64 MiB metadata ceiling).
KV_OVERSIZED_BYTES = (64 << 20) + 4096 + 1

_INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 49151, 49152, 1 << 20]),
)
_SMALL_INTS = st.integers(-3, 100)
_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e308, -1e308, float("nan"), float("inf"), -float("inf")]),
)
_TEXTS = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "x" * 256, "x" * 257, "y" * 5000, "\x00", "tcp://", "tcp://*:1", "tcp://0.0.0.0:1",
                     "ipc:///tmp/none", "inproc://x", "tcp://256.1.1.1:99999", "udp://1.2.3.4:5"]),
)
# Mostly values that pass the wire checks, so most messages reach the engine's own validation.
_VERSIONS = st.one_of(st.just(1), st.just(1), st.just(1), _INTS)
_IDS = st.one_of(*[st.from_regex(r"fz-[a-z0-9]{1,12}", fullmatch=True)] * 3, _TEXTS)
_TOKEN_LISTS = st.one_of(
    st.lists(_INTS, max_size=40),
    st.lists(st.integers(0, 49151), max_size=300),
    st.builds(lambda n: [1] * n, st.sampled_from([0, 1 << 16, 300_000])),
)


def sampling_params() -> st.SearchStrategy[SamplingParams]:
    """Every field of ``SamplingParams`` at extreme, invalid or plain values."""
    return st.builds(
        SamplingParams,
        n=st.one_of(_SMALL_INTS, _INTS), max_tokens=st.one_of(_SMALL_INTS, _INTS), min_tokens=_SMALL_INTS,
        temperature=_FLOATS, top_p=_FLOATS, top_k=st.one_of(_SMALL_INTS, _INTS), min_p=_FLOATS,
        presence_penalty=_FLOATS, frequency_penalty=_FLOATS, repetition_penalty=_FLOATS,
        seed=st.none() | _INTS, stop_token_ids=st.lists(_INTS, max_size=100), ignore_eos=st.booleans(),
        logprobs=st.none() | _SMALL_INTS | _INTS,
        logit_bias=st.just({}) | st.dictionaries(_INTS, _FLOATS, max_size=4),
        structured_output=st.none() | st.builds(
            StructuredOutput, kind=st.sampled_from(["json_object", "json_schema", "regex", "choice"]),
            spec=_TEXTS | st.sampled_from(['{"type": "object"}', "[a-z]{1,5}", '["yes", "no"]', "[" * 5000]),
        ),
    )


def generate_requests(reply_to: str, kv_addresses: list[str]) -> st.SearchStrategy[GenerateRequest]:
    """Requests that mostly reach ``reply_to`` (so answers flow), with hostile everything else."""
    targets = st.none() | st.builds(
        DecodeTarget, instance_id=_TEXTS, kv_address=st.sampled_from(kv_addresses) | _TEXTS if kv_addresses else _TEXTS
    )
    return st.builds(
        GenerateRequest,
        version=_VERSIONS, request_id=_IDS, prompt_token_ids=_TOKEN_LISTS,
        sampling_params=sampling_params(), reply_to=st.one_of(*[st.just(reply_to)] * 3, _TEXTS),
        cache_salt=st.none() | _TEXTS,
        decode_target=targets, arrival_time=_FLOATS, output_token_ids=_TOKEN_LISTS,
    )


def control_messages(reply_to: str, kv_addresses: list[str]) -> st.SearchStrategy[Any]:
    return st.one_of(
        generate_requests(reply_to, kv_addresses),
        st.builds(AbortRequest, version=_VERSIONS, request_id=_IDS),
        st.builds(RouterHeartbeat, version=_VERSIONS, reply_to=st.just(reply_to) | _TEXTS),
    )


class _PickleProbe:
    """Unpickling this creates ``path``: a socket that unpickled anything would leave it behind."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def raw_payloads(marker: str) -> list[tuple[str, bytes]]:
    """Frames no socket may act on: pickles, garbage, msgpack of the wrong shape, an extension type."""
    probe = pickle.dumps(_PickleProbe(marker))
    return [
        ("pickle", probe),
        ("pickle-of-a-request", pickle.dumps({"type": "generate", "request_id": "p", "probe": _PickleProbe(marker)})),
        ("empty", b""),
        ("garbage", os.urandom(512)),
        ("msgpack-list", msgspec.msgpack.encode([1, 2, 3])),
        ("msgpack-wrong-types", msgspec.msgpack.encode({"type": "generate", "request_id": 5, "prompt_token_ids": "x"})),
        ("msgpack-ext", msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\x00" * 16))),
        ("deep-nesting", b"\x91" * 100_000 + b"\x00"),
        ("huge-declared-array", b"\xdd\xff\xff\xff\xff"),
    ]


class FuzzStats:
    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()  # messages per socket
        self.request_ids: set[str] = set()


def _examples(max_examples: int, seed: int | None) -> Any:
    kw: dict[str, Any] = {"max_examples": max_examples, "deadline": None, "database": None,
                          "suppress_health_check": list(HealthCheck)}
    if seed is not None:
        kw["derandomize"] = True
    return settings(**kw)


def fuzz_control(
    ctx: zmq.Context, control_address: str, reply_to: str, kv_addresses: list[str], stats: FuzzStats,
    *, max_examples: int, name: str, marker: str, seed: int | None = None, prepare: Prepare | None = None,
) -> None:
    """Send hostile messages, raw payloads and an oversized frame to one control socket.
    ``prepare`` sets a socket up before it connects (e.g. as a CURVE client holding the cluster key)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)  # a peer that never completes the handshake fails the run
    if prepare is not None:
        prepare(sock)
    sock.connect(control_address)
    try:
        @_examples(max_examples, seed)
        @given(msg=control_messages(reply_to, kv_addresses))
        def one(msg: Any) -> None:
            try:
                raw = encode_engine(msg)
            except (OverflowError, msgspec.EncodeError):
                return  # not even encodable: nothing to send
            sock.send(raw)
            stats.sent[name] += 1
            if isinstance(msg, GenerateRequest) and isinstance(msg.request_id, str):
                stats.request_ids.add(msg.request_id)

        one()
        for _, payload in raw_payloads(marker):
            sock.send(payload)
            stats.sent[name] += 1
        sock.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))  # above MAXMSGSIZE: the connection is dropped
        stats.sent[name] += 1
        time.sleep(0.2)  # let ZMQ flush before the socket closes (LINGER 0)
    finally:
        sock.close(0)


def abort_all(ctx: zmq.Context, control_address: str, request_ids: set[str], prepare: Prepare | None = None) -> None:
    """Abort every request id the fuzzer sent, so none keeps the engine busy afterwards."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    if prepare is not None:
        prepare(sock)
    sock.connect(control_address)
    try:
        for request_id in request_ids:
            sock.send(encode_engine(AbortRequest(request_id=request_id or "-")))
    finally:
        sock.close(2000)


def _kv_messages(layout: KVLayout | None, reply_to: str) -> st.SearchStrategy[list[bytes]]:
    layouts = st.builds(KVLayout, model_id=_TEXTS, dtype=_TEXTS, num_layers=_INTS, num_kv_heads=_INTS,
                        head_size=_INTS, block_size=_INTS, hash_scheme=_TEXTS)
    if layout is not None:
        layouts = st.just(layout) | layouts
    metas = st.one_of(
        st.binary(max_size=64),
        st.builds(lambda req, first: encode_engine(TransferMeta(request=req, first_token_id=first)),
                  generate_requests(reply_to, []), _INTS),
    )
    hashes = st.lists(st.binary(min_size=0, max_size=70), max_size=40)
    messages = st.one_of(
        st.builds(lambda lay: [encode_kv(Hello(layout=lay, sender_id="fuzz"))], layouts),
        st.builds(lambda rid, num, hs, meta, ka: [encode_kv(Offer(request_id=rid, num_tokens=num, block_hashes=hs,
                                                                   meta=meta, keepalive_s=ka))],
                  _IDS, _INTS, hashes, metas, _FLOATS),
        st.builds(lambda rid, a, b, c, d, parts: [encode_kv(Data(request_id=rid, layer_start=a, num_layers=b,
                                                                  block_start=c, num_blocks=d)), *parts],
                  _IDS, _INTS, _INTS, _INTS, _INTS, st.lists(st.binary(max_size=256), max_size=4)),
        st.builds(lambda rid, why: [encode_kv(Abort(request_id=rid, reason=why))], _IDS, _TEXTS),
    )
    return messages


def fuzz_kv(
    ctx: zmq.Context, kv_address: str, reply_to: str, stats: FuzzStats, *, max_examples: int, name: str,
    marker: str, seed: int | None = None, prepare: Prepare | None = None,
) -> None:
    """Hello with the receiver's own layout (learnt from its reply), then hostile KV messages, raw
    payloads and an oversized frame, on one connection (and a fresh one after the oversized frame)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    if prepare is not None:
        prepare(sock)
    sock.connect(kv_address)
    layout: KVLayout | None = None
    try:
        probe = KVLayout(model_id="fuzz", dtype="float32", num_layers=1, num_kv_heads=1, head_size=1, block_size=1)
        sock.send(encode_kv(Hello(layout=probe, sender_id="fuzz")))
        stats.sent[name] += 1
        if sock.poll(10_000):
            reply = msgspec.msgpack.decode(sock.recv())
            with_layout = reply.get("layout") if isinstance(reply, dict) else None
            if isinstance(with_layout, dict):
                layout = msgspec.convert(with_layout, KVLayout)
                sock.send(encode_kv(Hello(layout=layout, sender_id="fuzz")))
                stats.sent[name] += 1

        @_examples(max_examples, seed)
        @given(parts=_kv_messages(layout, reply_to))
        def one(parts: list[bytes]) -> None:
            try:
                sock.send_multipart(parts)
            except zmq.ZMQError:
                return
            stats.sent[name] += 1
            while sock.poll(0):
                sock.recv_multipart()  # replies (rejections, defers) are not what is tested

        one()
        for _, payload in raw_payloads(marker):
            sock.send(payload)
            stats.sent[name] += 1
        sock.send(b"\x00" * KV_OVERSIZED_BYTES)
        stats.sent[name] += 1
        time.sleep(0.5)
    finally:
        sock.close(0)


@contextlib.contextmanager
def pickle_marker() -> Iterator[str]:
    """A path that must still not exist after the fuzzing (see ``_PickleProbe``), in a new folder that is
    removed on leaving the block: check it inside."""
    folder = tempfile.mkdtemp(prefix="pdserve-fuzz-")
    try:
        yield os.path.join(folder, "unpickled")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
