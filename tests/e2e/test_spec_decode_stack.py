"""Speculative decoding through the real stack: the decode instance runs with ``--speculative-config``
(n-gram drafts) behind a prefill instance and the router; the openai client's streamed greedy text
equals transformers', a stop string that lands inside a step's several tokens cuts the text there, and
the decode instance's metrics count the drafts it checked and kept."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.stack import prefill_decode_stack
from tests.engine.conftest import PROMPTS, hf_greedy, model_path, tokenizer
from tests.router.router_harness import wait_until

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
PROMPT = PROMPTS[6]  # "The quick brown fox jumps over the lazy dog. " six times: its output repeats it
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def stack(redis_url):  # type: ignore[no-untyped-def]
    with prefill_decode_stack(redis_url, model_path(), decode_args=["--speculative-config", SPEC]) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _hf_text() -> str:
    ids = hf_greedy(tuple(tokenizer()(PROMPT).input_ids), MAX_TOKENS)
    return tokenizer().decode(list(ids), skip_special_tokens=True)


def test_streamed_greedy_text_equals_transformers_and_drafts_were_kept(stack, client):  # type: ignore[no-untyped-def]
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    before = stack.metrics("decode-a")
    events = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in events if c.choices)
    assert text == _hf_text()
    assert events[-1].usage.completion_tokens == MAX_TOKENS

    def grew(after: dict[str, float], name: str) -> float:
        key = f"pdserve:spec_decode_{name}_total"
        return after.get(key, 0.0) - before.get(key, 0.0)

    def counted() -> bool:  # an engine publishes its counters between steps, twice a second: they may trail
        after = stack.metrics("decode-a")
        # Every kept draft is a token the decode instance did not need a step of its own for.
        return grew(after, "num_drafts") > 0 and grew(after, "num_accepted_tokens") >= MAX_TOKENS // 4

    assert wait_until(counted, 30, 0.1), stack.metrics("decode-a")
    after = stack.metrics("decode-a")
    assert 0 < grew(after, "num_accepted_tokens") <= grew(after, "num_draft_tokens")


def test_a_stop_string_inside_a_step_s_tokens_cuts_the_text_there(client):  # type: ignore[no-untyped-def]
    full = _hf_text()
    stop = " lazy dog"
    assert full.find(stop) > 0
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
