"""vLLM's ``/classify``, ``/score`` and ``/rerank`` through the real stack (router, one prefill and one decode
instance) serving a sequence classifier of one label (a reranker's, a reward model's form): each answer is
transformers' ``...ForSequenceClassification`` logit of the input (a pair: the tokenizer's encoding of the
text with its ``text_pair``), through a sigmoid unless ``use_activation`` is false."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.e2e.stack import prefill_decode_stack
from tests.engine.test_pooling import _classifier_checkpoint
from tests.engine.tiny_models import TINY_DIMS

pytestmark = pytest.mark.timeout(600)

QUERY = "w5 w17 w40"
DOCUMENTS = ["w40 w41 w42 w43", "w5 w17", "w99 w98 w97 w96 w95 w94", "w7"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    config = Qwen3Config(**TINY_DIMS, num_labels=1, id2label={0: "relevant"}, label2id={"relevant": 0})
    return _classifier_checkpoint(tmp_path_factory.mktemp("reranker"), config)


@pytest.fixture(scope="module")
def stack(redis_url, folder):  # type: ignore[no-untyped-def]
    float32 = ["--dtype", "float32"]
    with prefill_decode_stack(redis_url, str(folder), prefill_args=float32, decode_args=float32) as s:
        yield s


@functools.cache
def _hf(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    return (AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(str(folder)))


def logit(folder: Path, text: str, pair: str | None = None) -> float:
    model, tokenizer = _hf(folder)
    ids = tokenizer(text, text_pair=pair).input_ids
    with torch.inference_mode():
        return float(model(torch.tensor([ids])).logits[0, 0])


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + float(np.exp(-x)))


def post(stack, path: str, body: dict) -> dict:  # type: ignore[no-untyped-def,type-arg]
    response = httpx.post(stack.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_classify_gives_the_classifier_s_label_and_probability(stack, folder) -> None:  # type: ignore[no-untyped-def]
    texts = [QUERY, DOCUMENTS[2]]
    got = post(stack, "/classify", {"input": texts, "request_id": "c1"})
    assert got["id"] == "classify-c1" and got["object"] == "list"
    for i, (text, item) in enumerate(zip(texts, got["data"], strict=True)):
        assert item["index"] == i and item["label"] == "relevant" and item["num_classes"] == 1
        np.testing.assert_allclose(item["probs"], [sigmoid(logit(folder, text))], rtol=1e-4, atol=1e-6)
    assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] == 4 + 7  # with the tokenizer's <s>
    raw = post(stack, "/v1/classify", {"input": QUERY, "use_activation": False})
    np.testing.assert_allclose(raw["data"][0]["probs"], [logit(folder, QUERY)], rtol=1e-4, atol=1e-5)
    # A prompt ending in the pad token (0 here), which transformers would skip as padding: refused.
    padded = httpx.post(stack.url + "/classify", json={"input": [[5, 17, 0]]}, timeout=60)
    assert padded.status_code == 400 and "ends with the model's pad token (0)" in padded.json()["error"]["message"]


def test_score_pairs_each_text_with_the_query_as_a_cross_encoder(stack, folder) -> None:  # type: ignore[no-untyped-def]
    got = post(stack, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    expected = [sigmoid(logit(folder, QUERY, document)) for document in DOCUMENTS]
    assert [d["index"] for d in got["data"]] == [0, 1, 2, 3] and got["data"][0]["object"] == "score"
    np.testing.assert_allclose([d["score"] for d in got["data"]], expected, rtol=1e-4, atol=1e-6)
    assert len(set(np.round(expected, 6))) == len(expected)  # the documents score apart
    # Lists on both sides pair up in order; vLLM's other spelling; the raw logit.
    zipped = post(stack, "/v1/score", {"queries": [QUERY, DOCUMENTS[3]], "documents": DOCUMENTS[:2],
                                       "use_activation": False})
    np.testing.assert_allclose([d["score"] for d in zipped["data"]],
                               [logit(folder, QUERY, DOCUMENTS[0]), logit(folder, DOCUMENTS[3], DOCUMENTS[1])],
                               rtol=1e-4, atol=1e-5)
    # Truncated: the longer text cut first, as the tokenizer truncates a pair.
    cut = post(stack, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[2], "truncate_prompt_tokens": 5})
    model, tokenizer = _hf(folder)
    ids = tokenizer(QUERY, text_pair=DOCUMENTS[2], truncation=True, max_length=5).input_ids
    assert len(ids) == 5 and cut["usage"]["prompt_tokens"] == 5
    with torch.inference_mode():
        expected_cut = sigmoid(float(model(torch.tensor([ids])).logits[0, 0]))
    np.testing.assert_allclose(cut["data"][0]["score"], expected_cut, rtol=1e-4, atol=1e-6)


def test_rerank_orders_the_documents_by_score(stack, folder) -> None:  # type: ignore[no-untyped-def]
    scores = [sigmoid(logit(folder, QUERY, document)) for document in DOCUMENTS]
    best = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        got = post(stack, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
        assert [r["index"] for r in got["results"]] == best[:2], path
        for result in got["results"]:
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
            np.testing.assert_allclose(result["relevance_score"], scores[result["index"]], rtol=1e-4, atol=1e-6)
    every = post(stack, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
    assert [r["index"] for r in every["results"]] == best and "document" not in every["results"][0]
    assert every["usage"]["prompt_tokens"] > 0


def test_a_classifier_refuses_generation_and_embeds(stack, folder) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(stack.url + "/v1/completions", json={"prompt": QUERY}, timeout=60)
    assert response.status_code == 400
    assert "(Qwen3ForSequenceClassification) has no language-model output head" in response.json()["error"]["message"]
    got = post(stack, "/v1/embeddings", {"input": QUERY, "use_activation": False})
    model, tokenizer = _hf(folder)
    with torch.inference_mode():
        hidden = model.model(torch.tensor([tokenizer(QUERY).input_ids])).last_hidden_state[0, -1]
    np.testing.assert_allclose(got["data"][0]["embedding"], hidden.numpy(), rtol=1e-4, atol=1e-5)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForSequenceClassification"]


# Qwen3-Reranker's form: a causal LM served as a classifier of two tokens' logits by vLLM's --hf-overrides.
OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w10", "w11"],
             "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def causal_folder(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    from tests.engine.tiny_models import build_checkpoint, build_tokenizer

    folder = build_checkpoint(Qwen3Config(**TINY_DIMS), tmp_path_factory.mktemp("causal-reranker"))
    build_tokenizer(folder)
    return folder


def test_a_causal_lm_reranker_by_hf_overrides_scores_the_joined_pair(stack, folder, redis_url, causal_folder) -> None:  # type: ignore[no-untyped-def]
    """Router and engines given the same ``--hf-overrides``: /score and /rerank join each pair's texts into
    one prompt (vLLM's way for a causal LM made a classifier) and score it by the softmax of the true
    token's logit against the false one's, as Qwen3-Reranker's model card computes it with transformers.
    The module's classifier stack is up in the same Redis namespace: each router leaves out the other
    model's instances (without that, this router sent requests to the classifier's engines and answered
    with their scores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(causal_folder), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(causal_folder))
    query = QUERY + " "  # the prompt's templates end and begin the two texts, as a client formats them
    expected = []
    with torch.inference_mode():
        for document in DOCUMENTS:
            last = model(torch.tensor([tokenizer(query + document).input_ids])).logits[0, -1]
            expected.append(float(torch.softmax(last[[10, 11]], dim=0)[1]))
    flags = ["--hf-overrides", json.dumps(OVERRIDES)]
    float32 = [*flags, "--dtype", "float32"]
    with prefill_decode_stack(redis_url, str(causal_folder), router_args=flags, prefill_args=float32,
                              decode_args=float32, suffix="reranker") as reranker:
        assert len(reranker.procs) == 3 and httpx.get(stack.url + "/ready", timeout=10).json()["prefill"] == 1
        for _ in range(3):  # every instance of the namespace had its chance
            got = post(reranker, "/score", {"text_1": query, "text_2": DOCUMENTS})
            np.testing.assert_allclose([d["score"] for d in got["data"]], expected, rtol=1e-4, atol=1e-6)
        ranked = post(reranker, "/rerank", {"query": query, "documents": DOCUMENTS})
        assert [r["index"] for r in ranked["results"]] == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
        # The model is served under its own name, not the overridden folder's.
        names = [m["id"] for m in httpx.get(reranker.url + "/v1/models", timeout=10).json()["data"]]
        assert names == [causal_folder.name]
        # The classifier's router still answers with its own engines.
        np.testing.assert_allclose(post(stack, "/classify", {"input": QUERY})["data"][0]["probs"],
                                   [sigmoid(logit(folder, QUERY))], rtol=1e-4, atol=1e-6)
