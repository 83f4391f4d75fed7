"""The real stack end to end: redis-server, router, prefill and decode processes, the openai client.

Greedy output through router -> prefill -> KV transfer -> decode must equal transformers'.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.e2e.stack import Stack
from tests.engine.conftest import hf_greedy, model_path, tokenizer

pytestmark = pytest.mark.timeout(600)

LONG_PREFIX = (
    "You are a meticulous assistant. Answer in one short sentence. Use plain words and avoid lists. "
    "Here is some background about the solar system: the Sun is a star, and eight planets orbit it. "
) * 3


@pytest.fixture(scope="module")
def stack(redis_url):  # type: ignore[no-untyped-def]
    s = Stack(redis_url=redis_url, model=model_path())
    s.start_engine("prefill", "prefill-a")
    s.start_engine("decode", "decode-a")
    s.start_router()
    try:
        s.wait_ready(1, 1)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(stack):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_ids(content: str) -> tuple[int, ...]:
    text = tokenizer().apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tuple(tokenizer()(text, add_special_tokens=False).input_ids)


def _hf_text(prompt_ids: tuple[int, ...], max_tokens: int) -> str:
    """transformers' greedy continuation, cut at EOS as the server does."""
    ids = list(hf_greedy(prompt_ids, max_tokens))
    eos = tokenizer().eos_token_id
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer().decode(ids, skip_special_tokens=True)


def test_greedy_completion_and_chat_equal_transformers(client):  # type: ignore[no-untyped-def]
    prompt = "The three primary colors are"
    done = client.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0)
    assert done.choices[0].text == _hf_text(tuple(tokenizer()(prompt).input_ids), 24)
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name a large ocean."}], max_tokens=24,
        temperature=0,
    )
    assert chat.choices[0].message.content == _hf_text(_chat_ids("Name a large ocean."), 24)
    assert chat.usage.prompt_tokens == len(_chat_ids("Name a large ocean."))
    assert chat.usage.completion_tokens >= 1
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_streaming_text_equals_non_streaming_and_reports_usage(client):  # type: ignore[no-untyped-def]
    kwargs = {"model": "default", "messages": [{"role": "user", "content": "Describe rain in a sentence."}],
              "max_tokens": 32, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n2_stop_max_tokens_seed_and_logprobs(client):  # type: ignore[no-untyped-def]
    prompt = "Count: one, two, three, four, five, six,"
    two = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0, n=2)
    assert len(two.choices) == 2 and two.choices[0].text == two.choices[1].text
    limited = client.completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0)
    assert limited.choices[0].finish_reason == "length" and limited.usage.completion_tokens == 3
    full = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = full.strip().split()[1]
    stopped = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and full.startswith(stopped.choices[0].text)
    seeded = [
        client.completions.create(model="default", prompt=prompt, max_tokens=16, temperature=1.0, seed=7)
        .choices[0].text for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    lp = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_client_disconnect_mid_stream_frees_every_block(stack):  # type: ignore[no-untyped-def]
    body = {"model": "default", "prompt": "Write a very long story about a dragon.", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = 0
        for line in resp.iter_lines():
            lines += bool(line.startswith("data:"))
            if lines >= 5:
                break
    deadline = time.monotonic() + 10
    usage = {}
    while time.monotonic() < deadline:
        usage = {n: stack.metrics(n).get("pdserve:kv_cache_usage_perc", 1.0) for n in ("prefill-a", "decode-a")}
        running = stack.metrics("decode-a").get("pdserve:num_requests_running", 1.0)
        if all(v == 0.0 for v in usage.values()) and running == 0:
            break
        time.sleep(0.3)
    assert all(v == 0.0 for v in usage.values()), f"blocks still in use after disconnect: {usage}"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ("{not json", 400),
        ({"model": "no-such-model", "prompt": "hi"}, 404),
        ({"model": "default"}, 400),
        ({"model": "default", "messages": "hello"}, 400),
        ({"model": "default", "prompt": "hi", "max_tokens": "ten"}, 400),
        ({"model": "default", "prompt": "hi", "max_tokens": 10_000_000}, 400),
        ({"model": "default", "prompt": "hi", "n": 1000}, 400),
        ({"model": "default", "prompt": "hi", "temperature": -1}, 400),
        ({"model": "default", "prompt": "hi", "top_p": 0}, 400),
        ({"model": "default", "prompt": "x" * (3 << 20)}, 413),
    ],
)
def test_bad_input_gets_openai_style_4xx_and_service_stays_up(stack, body, status):  # type: ignore[no-untyped-def]
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    if isinstance(body, str):
        resp = httpx.post(stack.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        resp = httpx.post(stack.url + path, json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    ok = httpx.post(stack.url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200


def test_two_by_two_prefix_routing_load_spread_and_decode_replacement(redis_url):  # type: ignore[no-untyped-def]
    from common.kvcache.hashing import compute_block_hashes
    from common.registry import PrefixIndex, Registry

    s = Stack(redis_url=redis_url, model=model_path())
    # A separate namespace of instances: reuse the same Redis, different ids.
    for name in ("prefill-x", "prefill-y"):
        s.start_engine("prefill", name)
    for name in ("decode-x", "decode-y"):
        s.start_engine("decode", name)
    s.start_router()
    try:
        s.wait_ready(2, 2)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        first = client.completions.create(model="default", prompt=LONG_PREFIX + "Question 0?", max_tokens=4,
                                          temperature=0)
        assert first.choices[0].text is not None
        time.sleep(1.5)  # the prefix index is written off the step loop
        hits_before = {n: s.metrics(n).get("pdserve:prefix_cache_hits_total", 0.0) for n in ("prefill-x", "prefill-y")}
        for i in range(1, 5):
            client.completions.create(model="default", prompt=LONG_PREFIX + f"Question {i}?", max_tokens=4,
                                      temperature=0)
        hits = {n: s.metrics(n).get("pdserve:prefix_cache_hits_total", 0.0) - hits_before[n] for n in hits_before}
        holder = max(hits, key=hits.get)  # type: ignore[arg-type]
        assert hits[holder] >= 4 * 64, f"repeated prefix was not routed to the instance caching it: {hits}"
        # Redis names that instance as holding the prefix's blocks.
        info = next(i for i in Registry(redis_url).instances("prefill") if i.instance_id == holder)
        ids = list(tokenizer()(LONG_PREFIX).input_ids)
        hashes = compute_block_hashes(ids, info.block_size, info.model)
        assert PrefixIndex(redis_url).match([bytes(h) for h in hashes]).get(holder, 0) >= len(hashes) - 1

        # Decode load spreads over both decode instances.
        gen_before = {n: s.metrics(n).get("pdserve:generation_tokens_total", 0.0) for n in ("decode-x", "decode-y")}
        threads = [
            threading.Thread(target=client.completions.create, kwargs={
                "model": "default", "prompt": f"Tell me about the number {i}.", "max_tokens": 16, "temperature": 0})
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gen = {n: s.metrics(n).get("pdserve:generation_tokens_total", 0.0) - gen_before[n] for n in gen_before}
        assert all(v > 0 for v in gen.values()), f"decode load did not spread: {gen}"

        # Kill one decode instance and start a new one while traffic runs: new requests succeed.
        failures: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    client.completions.create(model="default", prompt=f"Short fact {i}:", max_tokens=6, temperature=0)
                except openai.APIError as exc:
                    failures.append(f"{time.monotonic():.1f} {exc}")

        worker = threading.Thread(target=traffic)
        worker.start()
        time.sleep(1.0)
        s.procs["decode-x"].stop(kill=True)
        s.start_engine("decode", "decode-z")
        time.sleep(6.0)  # the dead instance's registry entry expires; the new one registers
        killed_at = time.monotonic()
        time.sleep(6.0)
        stop.set()
        worker.join(timeout=120)
        late = [f for f in failures if float(f.split()[0]) > killed_at]
        assert not late, f"requests failed after the replacement joined: {late}"
        ok = client.completions.create(model="default", prompt="Final check:", max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason in ("length", "stop")
        assert s.metrics("decode-z").get("pdserve:generation_tokens_total", 0.0) >= 0
    finally:
        s.stop()
