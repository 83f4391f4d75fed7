"""Long prompts: refused by their length in characters when they cannot fit, never when they can,
and otherwise tokenized off the event loop, so one huge prompt does not stall other requests."""

from __future__ import annotations

import asyncio
import json
import random
import string
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from common.registry import InstanceInfo
from router.app import create_app
from router.errors import APIError
from router.token_bound import TokenBound, token_bound
from router.tokenization import INLINE_TEXT_CHARS, PromptProcessor
from tests.router.fake_engine import FakeEngine
from tests.router.router_harness import SERVED_MODEL, RouterServer, make_state, wait_until

LONG_TEXT_CHARS = 100_000  # texts at least this long are "huge" for the spy below


class SpyTokenizer:
    """The real tokenizer, recording on which thread, and when, each huge text was encoded; with
    ``hold`` set, every huge encode waits for it to be released first."""

    def __init__(self, inner: Any, hold: threading.Event | None = None) -> None:
        self._inner = inner
        self._hold = hold
        self.huge_encodes: list[tuple[str, float, float]] = []  # (thread name, start, end)
        self.huge_encode_started = threading.Event()
        self.held_threads: list[str] = []  # the huge encodes waiting for ``hold``

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def encode(self, text: str, **kwargs: Any) -> Any:
        if len(text) < LONG_TEXT_CHARS:
            return self._inner.encode(text, **kwargs)
        start = time.monotonic()
        self.huge_encode_started.set()
        try:
            if self._hold is not None:
                self.held_threads.append(threading.current_thread().name)
                assert self._hold.wait(60)
            return self._inner.encode(text, **kwargs)
        finally:
            self.huge_encodes.append((threading.current_thread().name, start, time.monotonic()))


def random_words(num_chars: int, seed: int = 0) -> str:
    """Text no tokenizer cache helps with: random letters and spaces."""
    return "".join(random.Random(seed).choices(string.ascii_lowercase + "     ", k=num_chars))


# --- the bound itself -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bound(tokenizer: Any) -> TokenBound:
    value = token_bound(tokenizer)
    assert value is not None, "the default model's byte-level BPE must have a bound"
    return value


def test_bound_knows_the_longest_token_and_the_characters_dropped(tokenizer: Any, bound: TokenBound) -> None:
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    assert bound.max_chars_per_token == max(len(token) for token in vocab)
    dropped = {chr(c) for c in range(128) if not tokenizer.encode(chr(c), add_special_tokens=False)}
    assert set(bound.dropped_chars) == dropped and dropped  # the default model drops a few controls


@pytest.fixture(scope="module")
def dense_text(tokenizer: Any) -> str:
    """The text of the vocabulary's longest tokens: as many characters per token as it gets."""
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    longest = sorted(vocab, key=len, reverse=True)[:64]
    return "".join(tokenizer.decode([vocab[token]]) for token in longest)


_pieces = [" ", "\n", "\t", "=", "#", "-", "ab", "<|im_start|>", "é", "🎉", "\x16", "\x04", "\U00040000"]
_texts = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=300),
    st.lists(st.sampled_from(_pieces), max_size=300).map("".join),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_texts)
def test_no_text_has_fewer_tokens_than_the_bound(tokenizer: Any, bound: TokenBound, text: str) -> None:
    assert bound.min_num_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("kind", ["dense", "mostly dropped characters"])
def test_a_prompt_that_fits_is_never_refused_by_its_length(
    tokenizer: Any, dense_text: str, kind: str
) -> None:
    text = dense_text if kind == "dense" else "\x16" * 200_000 + "hello"
    num_tokens = len(tokenizer.encode(text, add_special_tokens=True))
    processor = PromptProcessor(tokenizer)
    processor.check_length(text, max_model_len=num_tokens + 1)  # fits, just: one token of room


def test_length_check_refuses_exactly_past_the_bound(tokenizer: Any, bound: TokenBound) -> None:
    processor = PromptProcessor(tokenizer)
    max_model_len, max_chars = 100, bound.max_chars_per_token
    processor.check_length("a" * ((max_model_len - 1) * max_chars), max_model_len)
    with pytest.raises(APIError) as refused:
        processor.check_length("a" * ((max_model_len - 1) * max_chars + 1), max_model_len)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"


@pytest.fixture(scope="module")
def spec_json(tokenizer: Any) -> str:
    """The default model's tokenizer.json, which the variants below change."""
    return str(tokenizer.backend_tokenizer.to_str())


def _with_spec_change(spec_json: str, change: Any) -> Any:
    spec = json.loads(spec_json)
    change(spec)
    return SimpleNamespace(backend_tokenizer=Tokenizer.from_str(json.dumps(spec)))


def _lstrip_first_added_token(spec: dict[str, Any]) -> None:
    spec["added_tokens"][0]["lstrip"] = True


def _drop_a_continuation_byte(spec: dict[str, Any]) -> None:
    """Take byte 0x80 out of the vocabulary (and every token and merge that holds it)."""
    char = ByteLevel(add_prefix_space=False).pre_tokenize_str("\x80")[0][0][1]  # UTF-8: C2 80
    model = spec["model"]
    model["vocab"] = {token: i for token, i in model["vocab"].items() if char not in token}
    model["merges"] = [m for m in model["merges"] if char not in (m if isinstance(m, str) else "".join(m))]


def _metaspace(spec: dict[str, Any]) -> None:
    """Llama-2 style: prepend and replace spaces with a metaspace, which only lengthen the text."""
    spec["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    spec["pre_tokenizer"] = None


def _metaspace_with_byte_fallback(spec: dict[str, Any]) -> None:
    _metaspace(spec)
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    spec["model"]["byte_fallback"] = True


def _metaspace_with_unknown_token(spec: dict[str, Any]) -> None:
    _metaspace(spec)
    spec["model"]["unk_token"] = "<|endoftext|>"


def _metaspace_with_fused_unknown_tokens(spec: dict[str, Any]) -> None:
    """One unknown token for any run of unknown characters."""
    _metaspace_with_unknown_token(spec)
    spec["model"]["fuse_unk"] = True


def _byte_level_with_fused_unknown_tokens(spec: dict[str, Any]) -> None:
    """The bytes missing from the vocabulary become unknown tokens, one per run."""
    spec["model"].update(unk_token="<|endoftext|>", fuse_unk=True)


BOUNDED_VARIANTS = [
    _metaspace_with_byte_fallback,
    _metaspace_with_unknown_token,
    _byte_level_with_fused_unknown_tokens,
]


@pytest.fixture(scope="module")
def variants(spec_json: str) -> dict[str, tuple[Any, TokenBound | None]]:
    """Each variant's backend tokenizer, and its bound (computed once: it reads the whole vocabulary)."""
    result = {}
    for change in BOUNDED_VARIANTS:
        variant = _with_spec_change(spec_json, change)
        result[change.__name__] = (variant.backend_tokenizer, token_bound(variant))
    return result


@pytest.mark.parametrize("name", [change.__name__ for change in BOUNDED_VARIANTS])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_texts)
def test_other_bounded_pipelines_never_have_fewer_tokens_than_the_bound(
    variants: dict[str, tuple[Any, TokenBound | None]], name: str, text: str
) -> None:
    backend, bound = variants[name]
    assert bound is not None
    assert bound.min_num_tokens(text) <= len(backend.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda s: s.update(normalizer={"type": "NFC"}), id="NFC-composes"),
        pytest.param(
            lambda s: s.update(normalizer={"type": "Strip", "strip_left": True, "strip_right": True}),
            id="strip",
        ),
        pytest.param(
            lambda s: s.update(normalizer={"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}),
            id="regex-replace",
        ),
        pytest.param(
            lambda s: s.update(normalizer={"type": "Replace", "pattern": {"String": "  "}, "content": " "}),
            id="shortening-replace",
        ),
        pytest.param(lambda s: s.update(pre_tokenizer={"type": "WhitespaceSplit"}), id="drops-spaces"),
        pytest.param(_lstrip_first_added_token, id="added-token-lstrip"),
        pytest.param(_metaspace_with_fused_unknown_tokens, id="fused-unknowns"),
        pytest.param(_drop_a_continuation_byte, id="byte-level-without-a-continuation-byte"),
        pytest.param(_metaspace, id="no-byte-level-no-fallback-no-unknown"),
    ],
)
def test_no_bound_for_pipelines_that_drop_or_merge_characters(spec_json: str, change: Any) -> None:
    assert token_bound(_with_spec_change(spec_json, change)) is None


@pytest.mark.parametrize("change", [_metaspace_with_byte_fallback, _metaspace_with_unknown_token])
def test_sentencepiece_style_pipelines_keep_their_bound(
    spec_json: str, bound: TokenBound, change: Any
) -> None:
    changed = token_bound(_with_spec_change(spec_json, change))
    assert changed == TokenBound(bound.max_chars_per_token)  # no byte-level: nothing dropped


def test_slow_tokenizer_has_no_bound() -> None:
    assert token_bound(SimpleNamespace()) is None  # its pipeline is Python code: nothing to inspect


# --- at the HTTP boundary ---------------------------------------------------------------------


@pytest.fixture
def spy(tokenizer: Any) -> SpyTokenizer:
    return SpyTokenizer(tokenizer)


def test_huge_prompt_that_cannot_fit_is_refused_without_tokenizing(spy: SpyTokenizer) -> None:
    state = make_state(PromptProcessor(spy, max_model_len=256), redis_url=None)
    huge = "a" * 4_000_000
    with TestClient(create_app(state)) as client:
        for path, body in [
            ("/v1/completions", {"model": SERVED_MODEL, "prompt": huge}),
            ("/v1/completions", {"model": SERVED_MODEL, "prompt": ["hi", huge]}),
            (
                "/v1/chat/completions",
                {"model": SERVED_MODEL, "messages": [{"role": "user", "content": huge}]},
            ),
        ]:
            response = client.post(path, json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] in (
                "prompt",
                "prompt.1",
                "messages",
            )
    assert spy.huge_encodes == []


LONG_CONTEXT = 500_000


class LongContextEngine(FakeEngine):
    def info(self) -> InstanceInfo:
        return msgspec.structs.replace(super().info(), max_model_len=LONG_CONTEXT)


@pytest.fixture
def long_context_router(redis_url: str, tokenizer: Any, spy: SpyTokenizer) -> Iterator[RouterServer]:
    """A router whose instances take half a million tokens, so a prompt of millions of characters
    passes the length check and has to be tokenized."""
    namespace = f"long-{uuid.uuid4().hex[:8]}"
    reply_tokens = list(tokenizer.encode(" one two three four five six", add_special_tokens=False))
    peers: dict[str, FakeEngine] = {}
    for role in ("prefill", "decode"):
        peers[f"{role}-0"] = LongContextEngine(role, f"{role}-0", redis_url, namespace, reply_tokens, peers)
    for engine in peers.values():
        engine.start()
    try:
        state = make_state(
            PromptProcessor(spy, max_model_len=LONG_CONTEXT), redis_url=redis_url, namespace=namespace
        )
        with RouterServer(state) as server:
            server.wait_ready()
            yield server
    finally:
        for engine in peers.values():
            engine.stop()


def _stream_small_completion(url: str) -> str:
    body = {"model": SERVED_MODEL, "prompt": "Say something", "max_tokens": 6, "stream": True}
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += "".join(choice["text"] for choice in json.loads(line[6:])["choices"])
    return text


def test_small_requests_stream_while_a_huge_prompt_is_tokenized(
    long_context_router: RouterServer, spy: SpyTokenizer
) -> None:
    url = long_context_router.url
    assert _stream_small_completion(url) == " one two three four five six"  # warm: connections, threads
    huge = random_words(2_000_000)  # about 1.1M tokens: over the context, but only tokenizing tells
    outcome: dict[str, Any] = {}

    def send_huge() -> None:
        outcome["response"] = httpx.post(
            f"{url}/v1/completions",
            json={"model": SERVED_MODEL, "prompt": huge, "max_tokens": 4},
            timeout=120,
        )

    sender = threading.Thread(target=send_huge)
    sender.start()
    assert spy.huge_encode_started.wait(60), "the huge prompt was never tokenized"
    small: list[tuple[float, float]] = []
    while sender.is_alive() and len(small) < 50:
        start = time.monotonic()
        assert _stream_small_completion(url) == " one two three four five six"
        small.append((start, time.monotonic()))
    sender.join(120)

    response = outcome["response"]
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    [(thread_name, encode_start, encode_end)] = spy.huge_encodes
    assert thread_name.startswith("tokenizer-long"), f"tokenized on {thread_name}, not in a worker thread"
    encode_s = encode_end - encode_start
    first_latency_s = small[0][1] - small[0][0]
    finished_during = [end for _, end in small if end < encode_end]
    # On the event loop, the first small request would wait out the whole tokenization.
    assert finished_during, f"no small request finished during the {encode_s:.2f}s of tokenizing: {small}"
    assert first_latency_s < encode_s / 2, (first_latency_s, encode_s)


def test_a_burst_of_huge_prompts_does_not_hold_up_short_ones(tokenizer: Any) -> None:
    """Huge prompts wait for tokenizer threads among themselves: with every one of them busy (and
    more queued), a short prompt is still tokenized at once."""
    hold = threading.Event()
    spy = SpyTokenizer(tokenizer, hold=hold)
    num_threads = 2
    prompts = PromptProcessor(spy, max_model_len=LONG_CONTEXT, num_threads=num_threads)
    state = make_state(prompts, redis_url=None)  # no instances: a request ends, 503, once tokenized
    body = {"model": SERVED_MODEL, "prompt": random_words(200_000), "max_tokens": 4}
    with RouterServer(state) as server:
        senders = [
            threading.Thread(
                target=httpx.post,
                args=(f"{server.url}/v1/completions",),
                kwargs={"json": body, "timeout": 90},
            )
            for _ in range(2 * num_threads)
        ]
        try:
            for sender in senders:
                sender.start()
            assert wait_until(lambda: len(spy.held_threads) == num_threads, timeout_s=30), (
                "huge prompts not held"
            )
            start = time.monotonic()
            response = httpx.post(
                f"{server.url}/v1/completions", json={"model": SERVED_MODEL, "prompt": "hello"}, timeout=30
            )
            short_s = time.monotonic() - start
            assert response.json()["error"]["code"] == "no_instances"  # tokenized, then found no engine
            assert len(spy.held_threads) == num_threads and not spy.huge_encodes  # all still held
        finally:
            hold.set()
            for sender in senders:
                sender.join(90)
    assert len(spy.huge_encodes) == 2 * num_threads
    assert short_s < 10, short_s  # held huge prompts would hold it for the whole test's 60 s


class _ThreadRecorder(SpyTokenizer):
    """The real tokenizer, recording the thread each text was encoded on."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.threads: list[str] = []

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return super().encode(text, **kwargs)


def test_short_texts_are_tokenized_on_the_loop_and_longer_ones_in_a_worker(tokenizer: Any) -> None:
    """Below ``INLINE_TEXT_CHARS`` the hop to a worker thread costs more than the tokenizing."""
    recorder = _ThreadRecorder(tokenizer)
    prompts = PromptProcessor(recorder, max_model_len=LONG_CONTEXT)
    short, longer = "x " * (INLINE_TEXT_CHARS // 2 - 1), "x " * (INLINE_TEXT_CHARS // 2)
    messages = [{"role": "user", "content": short}]

    async def tokenize() -> str:
        await prompts.tokenize_completion(short, LONG_CONTEXT)
        await prompts.tokenize_chat(messages, LONG_CONTEXT)
        await prompts.tokenize_for_count(short, None, add_special_tokens=True)
        await prompts.tokenize_completion(longer, LONG_CONTEXT)
        await prompts.tokenize_completion([short, short], LONG_CONTEXT)  # the sum of their lengths
        return threading.current_thread().name

    loop_thread = asyncio.run(tokenize())
    assert recorder.threads[:3] == [loop_thread] * 3
    assert [name.startswith("tokenizer-short") for name in recorder.threads[3:]] == [True] * 3


@pytest.mark.parametrize(("config", "expected"), [
    ({"max_position_embeddings": 4096}, 4096),
    # An image-text checkpoint (Gemma 3, Mistral 3): the language model's own config says it.
    ({"model_type": "gemma3", "text_config": {"max_position_embeddings": 131072}}, 131072),
    ({"model_type": "mistral3", "text_config": {}}, None),
])
def test_the_context_length_is_read_from_the_config_or_its_language_model_s(tmp_path, config, expected) -> None:  # type: ignore[no-untyped-def]
    from router.tokenization import _config_max_len

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _config_max_len(tmp_path) == expected
