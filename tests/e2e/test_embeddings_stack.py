"""POST /v1/embeddings through the real stack (router, one prefill and one decode instance) with the openai
client: each embedding is transformers' last hidden state of its input's last token, normalized (vLLM's
pooling of a decoder model without a sentence-transformers config), computed on the prefill instance; an
instance stopped with the request on it costs a retry elsewhere, not the request."""

from __future__ import annotations

import functools
import json
import os
import signal

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.e2e.stack import prefill_decode_stack
from tests.engine.conftest import PROMPTS, hf_model, model_path, tokenizer
from tests.router.router_harness import wait_until

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
TEXTS = [PROMPTS[6], PROMPTS[2], "An embedding of a short text."]


@pytest.fixture(scope="module")
def stack(redis_url):  # type: ignore[no-untyped-def]
    # A stopped instance is taken for dead after 3 s of silence (the default 10 s would only slow the test).
    with prefill_decode_stack(redis_url, model_path(), router_args=["--engine-stall-timeout", "3"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@functools.cache
def expected(token_ids: tuple[int, ...]) -> np.ndarray:
    with torch.inference_mode():
        hidden = hf_model().model(torch.tensor([token_ids])).last_hidden_state[0, -1].double().numpy()
    return hidden / np.linalg.norm(hidden)


def _ids(text: str) -> tuple[int, ...]:
    return tuple(tokenizer()(text).input_ids)


def _router_metrics(stack) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The router's Prometheus samples, summed over labels, by metric name."""
    values: dict[str, float] = {}
    for line in httpx.get(stack.url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key.split("{", 1)[0]] = values.get(key.split("{", 1)[0], 0.0) + float(value)
    return values


def test_embeddings_are_transformers_last_hidden_state_normalized(stack, client):  # type: ignore[no-untyped-def]
    prefill_before, decode_before = stack.metrics("prefill-a"), stack.metrics("decode-a")
    router_before = _router_metrics(stack)
    got = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == MODEL
    for text, item in zip(TEXTS, got.data, strict=True):
        np.testing.assert_allclose(item.embedding, expected(_ids(text)), rtol=1e-4, atol=1e-5)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(_ids(t)) for t in TEXTS)
    # Run on the prefill instance: it looked the prompts up in its prefix cache; the decode did nothing. (An engine
    # publishes its counters between steps, twice a second: they may trail the answer.)
    key = "pdserve:prefix_cache_queries_total"
    assert wait_until(lambda: stack.metrics("prefill-a")[key] - prefill_before[key] >= got.usage.prompt_tokens,
                      30, 0.1), (stack.metrics("prefill-a")[key], prefill_before[key], got.usage.prompt_tokens)
    assert stack.metrics("decode-a").get(key, 0.0) == decode_before.get(key, 0.0)
    # The router counts each input as a finished request, as it counts a generation's end.
    router_after = _router_metrics(stack)
    for name in ("pdserve:request_success_total", "pdserve:e2e_request_latency_seconds_count"):
        assert router_after[name] - router_before.get(name, 0.0) == len(TEXTS), name
    # Floats, and token ids as input, give the same, to rounding: run alone, and from the blocks the first request
    # cached, its sums are not the batch's to the last bit (5e-7 apart in one run).
    floats = client.embeddings.create(model=MODEL, input=[list(_ids(TEXTS[1]))], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, got.data[1].embedding, rtol=1e-4, atol=1e-5)
    # Texts that differ embed differently.
    assert not np.allclose(got.data[0].embedding, got.data[2].embedding)


def test_a_conversation_embeds_as_its_rendered_chat_template(stack, client):  # type: ignore[no-untyped-def]
    """vLLM's chat form: ``messages`` rendered by the model's template (without the generation prompt unless
    asked, without extra BOS) embed as those token ids would; asking for the generation prompt changes them."""
    messages = [{"role": "system", "content": "You rank documents."}, {"role": "user", "content": "Query: fox"}]

    def embed(**body: object) -> tuple[list[float], int]:
        response = httpx.post(stack.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"], response.json()["usage"]["prompt_tokens"]

    def rendered(**options: object) -> list[int]:
        response = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "messages": messages, **options},
                              timeout=60)
        return response.json()["tokens"]

    ids = rendered(add_generation_prompt=False)
    got, num_tokens = embed(messages=messages)
    assert num_tokens == len(ids)
    np.testing.assert_allclose(got, embed(input=ids)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected(tuple(ids)), rtol=1e-4, atol=1e-5)
    with_prompt, more = embed(messages=messages, add_generation_prompt=True)
    assert more == len(rendered(add_generation_prompt=True)) > num_tokens
    assert not np.allclose(with_prompt, got)


def test_vllms_use_activation_false_gives_the_hidden_state_as_it_is(stack) -> None:  # type: ignore[no-untyped-def]
    ids = _ids(TEXTS[2])
    for field in ("use_activation", "normalize"):  # vLLM's name for it, and its name before
        response = httpx.post(stack.url + "/v1/embeddings", timeout=60,
                              json={"model": MODEL, "input": TEXTS[2], field: False, "request_id": f"raw-{field}"})
        assert response.json()["id"] == f"embd-raw-{field}"  # vLLM's request_id names the response
        raw = np.asarray(response.json()["data"][0]["embedding"])
        np.testing.assert_allclose(raw / np.linalg.norm(raw), expected(ids), rtol=1e-4, atol=1e-5)
        assert abs(np.linalg.norm(raw) - 1.0) > 0.1  # not normalized


def test_score_and_rerank_of_a_model_without_a_classifier_are_cosine_similarities(stack) -> None:  # type: ignore[no-untyped-def]
    """vLLM's scoring with an embedding model: each pair's score is the cosine similarity of the two texts'
    embeddings (each distinct text embedded once); /rerank orders the documents by it; /classify needs a
    classification head."""
    query, documents = TEXTS[2], [TEXTS[0], TEXTS[1], TEXTS[2]]
    cosine = [float(expected(_ids(query)) @ expected(_ids(d))) for d in documents]
    response = httpx.post(stack.url + "/score", json={"model": MODEL, "text_1": query, "text_2": documents}, timeout=60)
    assert response.status_code == 200, response.text
    np.testing.assert_allclose([d["score"] for d in response.json()["data"]], cosine, rtol=1e-4, atol=1e-5)
    assert response.json()["data"][2]["score"] == pytest.approx(1.0, abs=1e-5)  # a text against itself
    # The query is one of the documents: embedded once, its tokens counted once.
    assert response.json()["usage"]["prompt_tokens"] == len(_ids(TEXTS[0])) + len(_ids(TEXTS[1])) + len(_ids(query))
    ranked = httpx.post(stack.url + "/v1/rerank", json={"model": MODEL, "query": query, "documents": documents},
                        timeout=60).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: -cosine[i])
    refused = httpx.post(stack.url + "/classify", json={"model": MODEL, "input": query}, timeout=60)
    assert refused.status_code == 400 and "needs a sequence classifier" in refused.json()["error"]["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hello", "dimensions": 32}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [[1, 2], "mixed"]}, "input"),
    ({"input": "hello", "messages": [{"role": "user", "content": "hi"}]}, "input"),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, "continue_final_message"),
    ({"input": "hello", "priority": 1}, "priority"),
    ({"input": "hello", "embed_dtype": "float16"}, "embed_dtype"),
    ({"input": "hello", "endianness": "big"}, "endianness"),
    ({"input": "hello", "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
])
def test_what_is_not_served_is_refused_by_name(stack, body: dict, param: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    response = httpx.post(stack.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"] or response.json()["error"]["param"].startswith(param)


def test_an_embedding_on_a_stopped_prefill_is_computed_again_elsewhere(stack, client):  # type: ignore[no-untyped-def]
    """SIGSTOP the prefill instance: the router sends the request there, hears nothing for 3 s, takes the
    instance for stalled and runs the request on the decode instance; the embedding is the same."""
    victim = stack.procs["prefill-a"].popen.pid
    os.kill(victim, signal.SIGSTOP)
    try:
        got = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    finally:
        os.kill(victim, signal.SIGCONT)
    np.testing.assert_allclose(got.data[0].embedding, expected(_ids(TEXTS[0])), rtol=1e-4, atol=1e-5)
    router = httpx.get(stack.url + "/metrics", timeout=5).text
    assert any(line.startswith("pdserve:request_migrations_total") and not line.endswith(" 0.0")
               for line in router.splitlines()), "the request was not continued elsewhere"
    stack.wait_ready(1, 1)  # the prefill serves again for the tests after this one


def test_a_mean_pooling_sentence_transformers_model_embeds_the_mean_of_every_position(  # type: ignore[no-untyped-def]
        private_redis_url, tmp_path):
    """A model folder whose sentence-transformers config pools the mean (``1_Pooling``) and normalizes
    (``2_Normalize``), served by a router and one decode instance: each embedding is the mean of transformers'
    final hidden states over every position of its input, normalized; the same input again, its blocks now
    cached, computes every position again and gives the same."""
    from pathlib import Path

    from tests.e2e.stack import Stack

    folder = tmp_path / "mean-pooling-model"
    folder.mkdir()
    for source in Path(model_path()).iterdir():
        (folder / source.name).symlink_to(source.resolve())
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hf_model().config.hidden_size, "pooling_mode_mean_tokens": True}))
    stack = Stack(redis_url=private_redis_url, model=str(folder))
    try:
        stack.start_engine("decode", "decode-mean")
        stack.start_router()
        stack.wait_ready(0, 1)
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(2):  # the second time, every block of both inputs is in the prefix cache
            got = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS[:2])
            for text, item in zip(TEXTS[:2], got.data, strict=True):
                with torch.inference_mode():
                    hidden = hf_model().model(torch.tensor([_ids(text)])).last_hidden_state[0].double()
                mean = hidden.mean(dim=0).numpy()
                np.testing.assert_allclose(item.embedding, mean / np.linalg.norm(mean), rtol=1e-4, atol=1e-5)
                assert not np.allclose(item.embedding, expected(_ids(text)), atol=1e-3)  # not the last token's
    finally:
        stack.stop()
