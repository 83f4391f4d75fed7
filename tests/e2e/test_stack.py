"""The real stack end to end: redis-server, router, prefill and decode processes, the openai client.

Greedy output through router -> prefill -> KV transfer -> decode must equal transformers'.
The decode instance runs with ``--stream-interval 3``, and both engines with ``--async-scheduling``
(the other stacks of the suite with the defaults: every token sent at once, synchronous steps): every
test here also checks that held-back tokens, and steps scheduled while the one before is in flight,
change no output.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from common.sampling_params import SamplingParams
from tests.e2e.stack import prefill_decode_stack
from tests.engine.conftest import hf_greedy, make_engine, model_path, tokenizer
from tests.router.router_harness import wait_until

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
STREAM_INTERVAL = 3

LONG_PREFIX = (
    "You are a meticulous assistant. Answer in one short sentence. Use plain words and avoid lists. "
    "Here is some background about the solar system: the Sun is a star, and eight planets orbit it. "
) * 3


@pytest.fixture(scope="module")
def stack(redis_url):  # type: ignore[no-untyped-def]
    decode_args = ["--stream-interval", str(STREAM_INTERVAL), "--async-scheduling"]
    with prefill_decode_stack(redis_url, model_path(), decode_args=decode_args, prefill_args=["--async-scheduling"]) as s:
        yield s


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
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert done.choices[0].text == _hf_text(tuple(tokenizer()(prompt).input_ids), 24)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a large ocean."}], max_tokens=24,
        temperature=0,
    )
    assert chat.choices[0].message.content == _hf_text(_chat_ids("Name a large ocean."), 24)
    assert chat.usage.prompt_tokens == len(_chat_ids("Name a large ocean."))
    assert chat.usage.completion_tokens >= 1
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_streaming_text_equals_non_streaming_and_reports_usage(client):  # type: ignore[no-untyped-def]
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Describe rain in a sentence."}],
              "max_tokens": 32, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_the_decode_instance_streams_every_stream_interval_tokens(client):  # type: ignore[no-untyped-def]
    """The first token (from the prefill instance) and the decode instance's first come at once; the
    rest in events of ``STREAM_INTERVAL`` tokens; the text is the same as unstreamed."""
    num_tokens = 20
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": num_tokens, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kwargs)
    events = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices]
    texts = [t for t in events if t]
    assert "".join(texts) == full.choices[0].text and full.usage.completion_tokens == num_tokens
    assert len(texts) <= 2 + -(-(num_tokens - 2) // STREAM_INTERVAL), texts  # 8 events for 20 tokens
    assert len(texts) >= 3


def test_n2_stop_max_tokens_seed_and_logprobs(client):  # type: ignore[no-untyped-def]
    prompt = "Count: one, two, three, four, five, six,"
    two = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=2)
    assert len(two.choices) == 2 and two.choices[0].text == two.choices[1].text
    limited = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert limited.choices[0].finish_reason == "length" and limited.usage.completion_tokens == 3
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = full.strip().split()[1]
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and full.startswith(stopped.choices[0].text)
    seeded = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=7)
        .choices[0].text for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    lp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_n_choices_fork_on_the_engines_and_equal_one_engine(client):  # type: ignore[no-untyped-def]
    """n > 1 through prefill -> one KV transfer -> decode, where the choices fork and share the
    prompt's blocks: every seeded choice equals the one-engine fork, streaming or not."""
    prompt = list(tokenizer()(LONG_PREFIX + "Now name three planets.").input_ids)
    params = SamplingParams(temperature=0.8, top_k=20, seed=123, max_tokens=12, ignore_eos=True, n=3)
    [expected_ids] = make_engine().generate([prompt], params)
    expected = [tokenizer().decode(ids, skip_special_tokens=True) for ids in expected_ids]
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.8, "n": 3, "seed": 123,
              "extra_body": {"top_k": 20, "ignore_eos": True}}
    full = client.completions.create(**kwargs)
    assert [c.text for c in sorted(full.choices, key=lambda c: c.index)] == expected
    assert len(set(expected)) > 1  # the choices really differ: each draws from its own seed
    texts = ["", "", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected
    assert full.usage.completion_tokens == 36


def test_client_disconnect_mid_stream_frees_every_block(stack):  # type: ignore[no-untyped-def]
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 400,
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
        ({"model": MODEL}, 400),
        ({"model": MODEL, "messages": "hello"}, 400),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10_000_000}, 400),
        ({"model": MODEL, "prompt": "hi", "n": 1000}, 400),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400),
        ({"model": MODEL, "prompt": "x" * (17 << 20)}, 413),
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
    ok = httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200


def test_echo_and_prompt_logprobs_through_prefill_equal_transformers(stack, client):  # type: ignore[no-untyped-def]
    """A prompt long enough for the prefill instance: it computes the prompt's logprobs and sends them
    with the first token; the router echoes the prompt and shares them among the n choices."""
    import torch

    from tests.engine.conftest import hf_model

    prompt = LONG_PREFIX + "Name the star at the centre of the solar system."
    ids = tuple(tokenizer()(prompt).input_ids)
    def disaggregated() -> float:
        text = httpx.get(stack.url + "/metrics", timeout=10).text
        return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith('pdserve:router_requests_routed_total{path="disaggregated"}'))

    routed = disaggregated()
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=2, echo=True, logprobs=2,
        extra_body={"prompt_logprobs": 2},
    )
    assert disaggregated() > routed, "meant to go through the prefill instance"
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model()(torch.tensor([ids])).logits[0].float(), dim=-1)
    completion = _hf_text(ids, 6)
    for choice in done.choices:
        assert choice.text == prompt + completion
        plp = choice.model_extra["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i][str(ids[i])]
            assert entry["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
            assert len(plp[i]) in (2, 3)  # the two most likely, and the prompt's token when it is not one
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + done.usage.completion_tokens // 2
        assert lp.token_logprobs[1:len(ids)] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                              abs=2e-3)
        assert lp.text_offset[len(ids)] == len(prompt)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompt + completion
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    chat_ids = _chat_ids("Say hi.")
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == len(chat_ids) and all(str(t) in e for t, e in zip(chat_ids[1:], plp[1:], strict=True))


def test_cache_salt_keeps_prefix_cache_hits_to_requests_with_the_same_salt(client):  # type: ignore[no-untyped-def]
    """vLLM's ``cache_salt``: through prefill -> KV -> decode, a long prompt's blocks are hits again
    for the same salt, and never for another salt or none."""
    # A prompt no other test sends: its blocks are cached only by what this test sends.
    prompt = "A salted prompt. " + "The quick brown fox jumps over the lazy dog. " * 8 + "Name three rivers."

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        return done.usage.prompt_tokens_details.cached_tokens  # type: ignore[no-any-return]

    assert cached("tenant-a") == 0  # the first with this salt
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached(None) > 0 and cached("tenant-b") > 0



def test_a_response_says_what_the_chat_completion_says(client):  # type: ignore[no-untyped-def]
    """``/v1/responses`` through prefill -> KV -> decode: greedy, its text is the chat completion's for
    the same conversation, whole and streamed."""
    question = LONG_PREFIX + "Now name three rivers."
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}])
    kwargs = {"model": MODEL, "temperature": 0, "max_output_tokens": 12, "instructions": "Answer briefly.",
              "input": question}
    whole = client.responses.create(**kwargs)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type == f"response.{whole.status}"  # response.incomplete when cut at max_output_tokens
    assert events[-1].response.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


def test_a_conversation_goes_on_from_a_stored_response(client):  # type: ignore[no-untyped-def]
    """``previous_response_id`` through the real stack: the second turn sees what a chat completion of
    the whole conversation sees (the same prompt tokens, the same greedy answer); the stored
    responses read back whole."""
    opening = {"role": "user", "content": LONG_PREFIX + "My name is Ada. Greet me."}
    question = {"role": "user", "content": "What is my name?"}
    first = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=[opening])
    second = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=[question],
                                     previous_response_id=first.id)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        opening, {"role": "assistant", "content": first.output_text}, question])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    assert [item.type for item in client.responses.input_items.list(second.id, order="asc").data] == ["message"] * 3


def test_a_conversation_goes_on_through_the_conversations_api(client):  # type: ignore[no-untyped-def]
    """``conversation`` through the real stack: each turn sees what a chat completion of the whole conversation so far
    sees (the same prompt tokens, the same greedy answer), and the conversation then holds both turns' items."""
    opening = {"role": "user", "content": LONG_PREFIX + "My name is Ada. Greet me."}
    question = {"role": "user", "content": "What is my name?"}
    conversation = client.conversations.create(items=[opening])
    first = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input="Hello.",
                                    conversation=conversation.id)
    second = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=[question],
                                     conversation=conversation.id)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        opening, {"role": "user", "content": "Hello."}, {"role": "assistant", "content": first.output_text}, question])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [item.role for item in items] == ["user", "user", "assistant", "user", "assistant"]
    assert items[-1].content[0].text == second.output_text


def _hf_beam_search(prompt_ids: tuple[int, ...], width: int, max_tokens: int, length_penalty: float = 1.0,
                    ) -> list[tuple[list[int], float, str]]:
    """vLLM's beam search over transformers' log-probabilities, every step run, no early end:
    each choice's tokens (a stop token kept), its cumulative logprob and finish reason, best first."""
    import torch

    from tests.engine.conftest import hf_model
    from tests.router.test_beam_search import vllm_beam_search

    def alternatives(tokens: list[int]) -> list[tuple[int, float]]:
        with torch.inference_mode():
            logits = hf_model()(torch.tensor([[*prompt_ids, *tokens]])).logits[0, -1].float()
        top = torch.log_softmax(logits, dim=-1).topk(2 * width)
        return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))

    beams = vllm_beam_search(alternatives, len(prompt_ids), width, max_tokens, length_penalty,
                             frozenset([tokenizer().eos_token_id]))
    return [(tokens, cum, "stop" if stopped else "length") for tokens, cum, stopped in beams]


def test_beam_search_equals_vllm_s_search_over_transformers_logprobs(stack, client):  # type: ignore[no-untyped-def]
    """``use_beam_search``: the n best beams, in order, as vLLM's search finds them over transformers'
    log-probabilities; chat and completions, streamed and not; a prompt long enough for the prefill
    instance (each step's prompt a prefix-cache hit there)."""
    prompt = LONG_PREFIX + "The planet closest to the Sun is"
    ids = tuple(tokenizer()(prompt).input_ids)
    want = _hf_beam_search(ids, width=3, max_tokens=6, length_penalty=0.5)
    hits, routed = stack.metrics("prefill-a").get("pdserve:prefix_cache_hits_total", 0.0), _routed(stack)
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, n=3, logprobs=1,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True},
    )
    # Every step after the first finds the prompt's full blocks (16 tokens each) in the prefill's prefix cache.
    steps = _routed(stack) - routed
    assert steps > 3
    assert wait_until(lambda: stack.metrics("prefill-a").get("pdserve:prefix_cache_hits_total", 0.0) - hits
                      >= (steps - 1) * (len(ids) // 16 * 16), 30, 0.1)
    got = [(c.model_extra["token_ids"], sum(c.logprobs.token_logprobs), c.finish_reason) for c in done.choices]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[2] for g in got] == [w[2] for w in want]
    assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=1e-3)
    eos = tokenizer().eos_token_id
    for choice, (tokens, _, _) in zip(done.choices, want, strict=True):
        assert choice.text == tokenizer().decode([t for t in tokens if t != eos], skip_special_tokens=True)
    assert len({c.text for c in done.choices}) == 3, "three different beams"
    assert done.usage.completion_tokens == sum(len(w[0]) for w in want)
    assert done.usage.prompt_tokens == len(ids)
    streamed = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, n=3, stream=True,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    ))
    texts = {i: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [c.text for c in done.choices]
    # Echoed with the prompt's logprobs (from the search's first step), and vLLM's prompt_logprobs.
    import torch

    from tests.engine.conftest import hf_model

    with torch.inference_mode():
        ref = torch.log_softmax(hf_model()(torch.tensor([ids])).logits[0].float(), dim=-1)
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, n=3, logprobs=1, echo=True,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 0},
    )
    for choice, plain in zip(echoed.choices, done.choices, strict=True):
        assert choice.text == prompt + plain.text
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:len(ids)] == pytest.approx(
            [ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=2e-3)
        assert [e and e[str(t)]["logprob"] for e, t in zip(choice.model_extra["prompt_logprobs"][1:], ids[1:],
                                                            strict=True)] == choice.logprobs.token_logprobs[1:len(ids)]


def _routed(stack) -> float:  # type: ignore[no-untyped-def]
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("pdserve:router_requests_routed_total{"))


@pytest.mark.parametrize(
    ("question", "length_penalty"),
    [("What is 2+2?", 1.0),  # beams ended on the end-of-sequence token among beams cut by max_tokens
     ("Say yes or no.", 10.0)],  # the penalty reorders them (by the prompt's and beam's length, less the stop)
)
def test_beam_search_in_chat_equals_vllm_s_search(stack, client, question, length_penalty):  # type: ignore[no-untyped-def]
    want = _hf_beam_search(_chat_ids(question), width=3, max_tokens=10, length_penalty=length_penalty)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=10, n=3,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty, "return_token_ids": True},
    )
    assert [c.model_extra["token_ids"] for c in chat.choices] == [w[0] for w in want]
    assert [c.finish_reason for c in chat.choices] == [w[2] for w in want]
    eos = tokenizer().eos_token_id
    assert [c.message.content for c in chat.choices] == [
        tokenizer().decode([t for t in w[0] if t != eos], skip_special_tokens=True) for w in want]


def test_beam_search_ends_once_no_live_beam_can_catch_up(stack, client):  # type: ignore[no-untyped-def]
    """Three beams end on the end-of-sequence token within a few steps, each scoring above anything the
    live ones can reach: the search stops there (vLLM's would run its 40 steps), with vLLM's answer."""
    question = "Say yes or no."
    want = _hf_beam_search(_chat_ids(question), width=3, max_tokens=40)
    assert [w[2] for w in want] == ["stop"] * 3
    before = _routed(stack)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=40, n=3,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )
    assert [c.model_extra["token_ids"] for c in chat.choices] == [w[0] for w in want]
    steps = _routed(stack) - before
    assert steps < 1 + 3 * 39 // 4, f"{steps} engine requests: the search did not end early"


def test_a_beam_search_whose_client_leaves_stops_sending_steps(stack):  # type: ignore[no-untyped-def]
    """The client gives up on a long search: the router sends no more steps, the engines hold no block."""
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 300, "n": 3,
            "ignore_eos": True, "use_beam_search": True}
    before = _routed(stack)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=3))
    deadline, last, steady_since = time.monotonic() + 30, -1.0, time.monotonic()
    while time.monotonic() < deadline:
        routed = _routed(stack)
        if routed != last:
            last, steady_since = routed, time.monotonic()
        elif time.monotonic() - steady_since > 2:
            break
        time.sleep(0.2)
    assert time.monotonic() < deadline, "the router went on sending the search's steps"
    assert 0 < last - before < 1 + 3 * 299, "the search ran to its end"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        usage = {n: stack.metrics(n).get("pdserve:kv_cache_usage_perc", 1.0) for n in ("prefill-a", "decode-a")}
        if all(v == 0.0 for v in usage.values()):
            break
        time.sleep(0.3)
    assert all(v == 0.0 for v in usage.values()), f"blocks still in use after the client left: {usage}"
