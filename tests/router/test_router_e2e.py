"""The router end to end: OpenAI client -> router -> fake engines over real ZMQ and Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, fake_stack, wait_until

REPLY_TEXT = "Hello, world! Ça va? 你好 🎉 The end."
LONG_PROMPT = "Tell me a story about a dragon who learns to paint, in several short sentences please."


@pytest.fixture(scope="module")
def reply_tokens(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(REPLY_TEXT, add_special_tokens=False))


@pytest.fixture(scope="module")
def stack(
    redis_url: str, prompts: Any, reply_tokens: list[int]
) -> Iterator[tuple[RouterServer, FakeCluster]]:
    with fake_stack(redis_url, prompts, reply_tokens, request_timeout_s=5.0) as stack:
        yield stack


@pytest.fixture
def client(stack: tuple[RouterServer, FakeCluster]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[0].url}/v1", api_key="unused", max_retries=0, timeout=20)


def _requests_for(cluster: FakeCluster, response_id: str) -> list[Any]:
    return [r for r in cluster.requests() if r.request_id.startswith(response_id)]


def test_chat_goes_through_prefill_then_decode(
    client: openai.OpenAI, stack: Any, reply_tokens: list[int]
) -> None:
    _, cluster = stack
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=100
    )
    assert response.choices[0].message.content == REPLY_TEXT
    assert response.choices[0].finish_reason == "stop"
    assert response.usage is not None
    assert response.usage.completion_tokens == len(reply_tokens)
    assert response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens == 16
    [sent] = _requests_for(cluster, response.id)
    assert sent.request_id == f"{response.id}-0"
    assert sent.decode_target is not None and sent.decode_target.instance_id == "decode-0"
    assert sent in cluster.engine("prefill-0").requests
    assert response.usage.prompt_tokens == len(sent.prompt_token_ids)


def _stream_text(chunks: Any) -> tuple[dict[int, str], dict[int, str | None], Any]:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    return texts, finish, usage


def test_chat_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=SERVED_MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], n=2, seed=7
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    texts, finish, usage = _stream_text(chunks)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert usage == full.usage
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=SERVED_MODEL, prompt=LONG_PROMPT, max_tokens=9)
    full = client.completions.create(**kwargs)
    texts, finish, _ = _stream_text(client.completions.create(stream=True, **kwargs))
    assert full.choices[0].finish_reason == "length"
    assert texts == {0: full.choices[0].text} and finish == {0: "length"}
    assert full.usage is not None and full.usage.completion_tokens == 9


@pytest.mark.parametrize("logprobs", [False, True])
def test_continuous_usage_stats_put_each_choice_s_usage_so_far_in_every_chunk(client: openai.OpenAI, logprobs: bool) -> None:
    """vLLM's ``continuous_usage_stats``: the plain chunks (written from fixed parts) and the model-built
    ones (logprobs) alike; the final usage chunk as without it."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = dict(model=SERVED_MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], n=2, seed=7, max_tokens=6,
                logprobs=logprobs)
    full = client.chat.completions.create(**chat)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, stream_options=options, **chat))  # type: ignore[call-overload]
    seen: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        assert chunk.usage is not None, chunk
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        seen.setdefault(choice.index, []).append(chunk.usage.completion_tokens)
    for counts in seen.values():
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6, counts  # the role chunk: 0
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    completion = dict(model=SERVED_MODEL, prompt=LONG_PROMPT, max_tokens=4, logprobs=1 if logprobs else None)
    texts = list(client.completions.create(stream=True, stream_options=options, **completion))  # type: ignore[call-overload]
    assert [c.usage.completion_tokens for c in texts[:-1]] == [1, 2, 3, 4]
    plain = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **completion))  # type: ignore[call-overload]
    assert all(c.usage is None for c in plain[:-1])


def test_n_choices_go_as_one_engine_request_per_prompt(client: openai.OpenAI, stack: Any) -> None:
    """The engines fork the choices (sharing the prompt's blocks): one request per prompt, with n."""
    response = client.completions.create(model=SERVED_MODEL, prompt=LONG_PROMPT, n=3, seed=41, max_tokens=4)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.text for c in response.choices)
    [sent] = _requests_for(stack[1], response.id)
    assert sent.request_id == f"{response.id}-0"
    assert (sent.sampling_params.n, sent.sampling_params.seed) == (3, 41)
    two = client.completions.create(model=SERVED_MODEL, prompt=[LONG_PROMPT, LONG_PROMPT + " again"], n=2,
                                    max_tokens=3)
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    sent_two = sorted(_requests_for(stack[1], two.id), key=lambda r: r.request_id)
    assert [(r.request_id, r.sampling_params.n) for r in sent_two] == [(f"{two.id}-0", 2), (f"{two.id}-1", 2)]


def test_short_prompt_goes_directly_to_decode(client: openai.OpenAI, stack: Any) -> None:
    response = client.completions.create(model=SERVED_MODEL, prompt="Hi", max_tokens=3)
    [sent] = _requests_for(stack[1], response.id)
    assert sent.decode_target is None and sent in stack[1].engine("decode-0").requests
    assert response.choices[0].text == REPLY_TEXT[: len(response.choices[0].text)] != ""


def test_stop_string_across_tokens_truncates_and_aborts(
    client: openai.OpenAI, stack: Any, tokenizer: Any
) -> None:
    stop = "d! Ç"  # spans the tokens of "world", "!" and " Ça"
    response = client.completions.create(model=SERVED_MODEL, prompt=LONG_PROMPT, max_tokens=50, stop=[stop])
    assert response.choices[0].text == REPLY_TEXT[: REPLY_TEXT.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    request_id = f"{response.id}-0"
    assert wait_until(lambda: all(request_id in a for a in stack[1].aborts().values()))


def test_logprobs_have_openai_shapes(client: openai.OpenAI, reply_tokens: list[int]) -> None:
    chat = client.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(reply_tokens)
    assert b"".join(bytes(e.bytes or []) for e in content).decode() == REPLY_TEXT
    assert all(e.logprob == -0.25 and len(e.top_logprobs) == 2 for e in content)
    completion = client.completions.create(model=SERVED_MODEL, prompt=LONG_PROMPT, max_tokens=4, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 4
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_client_disconnect_aborts_engine_request(stack: Any) -> None:
    server, cluster = stack
    slow = cluster.engine("decode-0")
    slow.token_delay_s = 0.2
    try:
        body = {"model": SERVED_MODEL, "prompt": LONG_PROMPT, "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=10) as response:
            first = next(response.iter_lines())
        request_id = json.loads(first.removeprefix("data: "))["id"] + "-0"
        assert wait_until(lambda: request_id in slow.aborts, timeout_s=5)
        # Sent to both at once, on sockets of their own: the prefill's may land after the decode's.
        assert wait_until(lambda: request_id in cluster.engine("prefill-0").aborts, timeout_s=5)
        assert wait_until(lambda: server.state.num_inflight == 0)
    finally:
        slow.token_delay_s = 0.005


def test_client_leaving_a_non_streaming_request_aborts_it(stack: Any) -> None:
    server, cluster = stack
    slow = cluster.engine("decode-0")
    slow.token_delay_s = 0.2
    try:
        body = {"model": SERVED_MODEL, "prompt": LONG_PROMPT, "max_tokens": 40}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
        sent = cluster.engine("prefill-0").requests[-1]
        assert wait_until(lambda: sent.request_id in slow.aborts)
        assert wait_until(lambda: server.state.num_inflight == 0)
    finally:
        slow.token_delay_s = 0.005


def test_health_ready_models_metrics(stack: Any, client: openai.OpenAI) -> None:
    server, _ = stack
    assert httpx.get(f"{server.url}/health").status_code == 200
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 200 and ready.json()["prefill"] == 1
    assert [m.id for m in client.models.list()] == [SERVED_MODEL]
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        "pdserve:time_to_first_token_seconds_bucket",
        "pdserve:e2e_request_latency_seconds_count",
        "pdserve:inter_token_latency_seconds_count",
        'pdserve:request_success_total{finished_reason="stop"}',
        "pdserve:prompt_tokens_total",
        'pdserve:generation_tokens_total{role="router"}',
    ):
        assert name in metrics
