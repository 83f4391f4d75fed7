"""How the router reads a model's pooling (sentence-transformers' files beside the weights) and makes an
embedding of the hidden state the engines pool."""

from __future__ import annotations

import base64
import json
import pathlib

import numpy as np
import pytest

from router.errors import APIError
from router.pooling import PoolingConfig, encode_embedding


def _model(folder: pathlib.Path, pooling: dict | None = None, normalize: bool = True, config: dict | None = None) -> pathlib.Path:  # type: ignore[type-arg]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "qwen3"}))
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    return folder


def test_a_generative_model_pools_its_last_token_normalized(tmp_path: pathlib.Path) -> None:
    config = PoolingConfig.from_model_dir(_model(tmp_path))
    assert config == PoolingConfig("lasttoken", True, None)
    config.check(None)
    hidden = np.array([3.0, 4.0, 0.0], dtype="<f4").tobytes()
    np.testing.assert_allclose(config.embed(hidden, None), [0.6, 0.8, 0.0])


def test_a_sentence_transformers_last_token_model_without_normalize(tmp_path: pathlib.Path) -> None:
    config = PoolingConfig.from_model_dir(_model(tmp_path, {"pooling_mode_lasttoken": True}, normalize=False))
    assert config == PoolingConfig("lasttoken", False, None)
    np.testing.assert_allclose(config.embed(np.array([3.0, 4.0], dtype="<f4").tobytes(), None), [3.0, 4.0])


@pytest.mark.parametrize(("flags", "engine_pooling"), [
    ({"pooling_mode_lasttoken": True}, "last"), ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_max_tokens": True}, "max"), ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean_sqrt_len"),
    ({"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
])
def test_the_poolings_the_engines_compute_are_served(tmp_path: pathlib.Path, flags: dict, engine_pooling: str) -> None:  # type: ignore[type-arg]
    config = PoolingConfig.from_model_dir(_model(tmp_path, flags))
    config.check(None)
    assert config.engine_pooling == engine_pooling


@pytest.mark.parametrize(("flags", "mode"), [
    ({}, "none"),
    ({"pooling_mode_lasttoken": True, "pooling_mode_max_tokens": True}, "max+lasttoken"),
    ({"pooling_mode_mean_tokens": True, "include_prompt": False}, "mean without the prompt (include_prompt false)"),
])
def test_a_pooling_the_engines_do_not_compute_is_refused_by_name(tmp_path: pathlib.Path, flags: dict, mode: str) -> None:  # type: ignore[type-arg]
    config = PoolingConfig.from_model_dir(_model(tmp_path, flags))
    assert sorted(config.mode.split("+")) == sorted(mode.split("+"))
    with pytest.raises(APIError, match="is not implemented") as err:
        config.check(None)
    assert err.value.status == 400


def test_matryoshka_dimensions_truncate_then_normalize(tmp_path: pathlib.Path) -> None:
    listed = PoolingConfig.from_model_dir(_model(tmp_path / "a", config={"matryoshka_dimensions": [2, 4]}))
    assert listed.matryoshka == (2, 4)
    listed.check(2)
    with pytest.raises(APIError, match=r"one of \[2, 4\]"):
        listed.check(3)
    hidden = np.array([3.0, 4.0, 12.0, 0.0], dtype="<f4").tobytes()
    np.testing.assert_allclose(listed.embed(hidden, 2), [0.6, 0.8])
    anywidth = PoolingConfig.from_model_dir(_model(tmp_path / "b", config={"is_matryoshka": True}))
    anywidth.check(3)
    with pytest.raises(APIError, match="must be positive"):
        anywidth.check(0)
    with pytest.raises(APIError, match="at most the model's 4"):
        anywidth.embed(hidden, 5)
    with pytest.raises(APIError, match="does not support Matryoshka"):
        PoolingConfig.from_model_dir(_model(tmp_path / "c")).check(2)


def test_base64_is_the_float32_little_endian_bytes() -> None:
    vector = np.array([0.25, -1.5, 3.0], dtype=np.float32)
    assert np.array_equal(np.frombuffer(base64.b64decode(encode_embedding(vector, "base64")), dtype="<f4"), vector)
    assert encode_embedding(vector, "float") == [0.25, -1.5, 3.0]


def test_a_broken_modules_file_is_an_error_naming_it(tmp_path: pathlib.Path) -> None:
    folder = _model(tmp_path)
    (folder / "modules.json").write_text("{not json")
    with pytest.raises(ValueError, match="modules.json"):
        PoolingConfig.from_model_dir(folder)


def test_a_model_without_an_output_head_is_refused_for_generation_by_name(prompts) -> None:  # type: ignore[no-untyped-def]
    """The router of a base model saved without ``lm_head`` (``headless_architecture``) answers generation
    endpoints with a 400 naming it; /v1/embeddings goes on to the engines (none here: 503)."""
    from fastapi.testclient import TestClient

    from router.app import create_app
    from tests.router.router_harness import SERVED_MODEL, make_state

    state = make_state(prompts, redis_url=None, headless_architecture="Qwen3Model")
    with TestClient(create_app(state)) as client:
        for path, body in [("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/responses", {"input": "hi"})]:
            response = client.post(path, json={"model": SERVED_MODEL, **body})
            assert response.status_code == 400, response.text
            assert "(Qwen3Model) has no language-model output head" in response.json()["error"]["message"]
        assert client.post("/v1/embeddings", json={"model": SERVED_MODEL, "input": "hi"}).status_code == 503


def test_the_router_reads_whether_a_checkpoint_has_its_output_head() -> None:
    from common.model.loader import headless_architecture

    assert headless_architecture({"architectures": ["Qwen3Model"]}) == "Qwen3Model"
    assert headless_architecture({"architectures": ["MistralModel"]}) == "MistralModel"
    for causal in (["Qwen3ForCausalLM"], ["GPT2LMHeadModel"], ["Mistral3ForConditionalGeneration"], [], None):
        assert headless_architecture({"architectures": causal}) is None


def test_a_large_response_is_written_an_embedding_at_a_time_handing_the_loop_back() -> None:
    """200 embeddings of 4,096 floats: while the body is written, another task on the loop runs again and
    again (every few embeddings, whatever the host's speed); the body is the response the API documents."""
    import asyncio

    from router.serving_embeddings import YIELD_EVERY, EmbeddingResponse, response_body

    hidden = [np.full(4096, i, dtype="<f4").tobytes() for i in range(200)]
    config = PoolingConfig(normalize=False)

    async def run() -> tuple[bytes, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        start = ticks
        body = await response_body({"id": "embd-1", "object": "list", "created": 1, "model": "m"}, hidden,
                                   {"prompt_tokens": 7, "total_tokens": 7},
                                   lambda h: encode_embedding(config.embed(h, None), "float"))
        task.cancel()
        return body, ticks - start

    body, ticks = asyncio.run(run())
    assert ticks >= 200 // YIELD_EVERY
    response = EmbeddingResponse.model_validate_json(body)
    assert [d.index for d in response.data] == list(range(200)) and response.usage.prompt_tokens == 7
    assert response.data[5].embedding == [5.0] * 4096 and response.model == "m"


def _logits(*values: float) -> bytes:
    return np.array(values, dtype="<f4").tobytes()


def test_a_classifier_s_labels_and_activations_are_its_config_s() -> None:
    """``/classify``'s activation follows transformers' loss for ``problem_type`` (vLLM's rule): a softmax over
    labels, a sigmoid of one label or of each for multi-label, none for regression; ``/score``'s is the
    cross-encoder's own from sentence-transformers' config, else the same rule."""
    from router.pooling import ClassifierConfig

    assert ClassifierConfig.from_config({"architectures": ["LlamaForCausalLM"]}) is None
    three = ClassifierConfig.from_config({"architectures": ["Qwen2ForSequenceClassification"],
                                          "id2label": {"0": "neg", "1": "neu", "2": "pos"}})
    assert three is not None and three.labels == ("neg", "neu", "pos") and three.activation == "softmax"
    probs = three.outputs(_logits(1.0, 2.0, 3.0), three.activation)
    np.testing.assert_allclose(probs, np.exp([1.0, 2.0, 3.0]) / np.exp([1.0, 2.0, 3.0]).sum())
    np.testing.assert_allclose(three.outputs(_logits(1.0, 2.0, 3.0), "identity"), [1.0, 2.0, 3.0])
    with pytest.raises(APIError, match="has 3 labels: a score needs a classifier of one"):
        three.check_score()
    default = ClassifierConfig.from_config({"architectures": ["LlamaForSequenceClassification"]})
    assert default is not None and default.labels == ("LABEL_0", "LABEL_1")  # transformers' default: 2
    multi = ClassifierConfig.from_config({"architectures": ["LlamaForSequenceClassification"], "num_labels": 2,
                                          "problem_type": "multi_label_classification"})
    assert multi is not None and multi.activation == "sigmoid"
    np.testing.assert_allclose(multi.outputs(_logits(0.0, 2.0), "sigmoid"), [0.5, 1 / (1 + np.exp(-2.0))])
    reward = ClassifierConfig.from_config({"architectures": ["LlamaForSequenceClassification"],
                                           "id2label": {"0": "LABEL_0"}, "problem_type": "regression"})
    assert reward is not None and reward.activation == "identity" and reward.score_activation == "sigmoid"
    reward.check_score()
    np.testing.assert_allclose(reward.outputs(_logits(-1.0), reward.score_activation), [1 / (1 + np.e)])
    for named, expected in [("torch.nn.modules.linear.Identity", "identity"),
                            ("torch.nn.modules.activation.Sigmoid", "sigmoid")]:
        ce = ClassifierConfig.from_config({"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1,
                                           "sentence_transformers": {"activation_fn": named}})
        assert ce is not None and ce.score_activation == expected
    tanh = ClassifierConfig.from_config({"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1,
                                         "sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"})
    assert tanh is not None
    with pytest.raises(APIError, match="activation 'torch.nn.modules.activation.Tanh'.*is not implemented"):
        tanh.check_score()


def test_a_causal_lm_made_a_classifier_joins_pairs_and_scores_its_last_token_pad_or_not() -> None:
    from router.pooling import ClassifierConfig

    reranker = ClassifierConfig.from_config({
        "architectures": ["Qwen3ForSequenceClassification"], "pad_token_id": 0,
        "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True})
    assert reranker is not None and reranker.labels == ("LABEL_0",) and reranker.joins_pairs
    reranker.check_score()
    reranker.check_prompts([[5, 0]], "documents")  # its transformers model (a causal LM) skips no padding
    seq_cls = ClassifierConfig.from_config({"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1,
                                            "pad_token_id": 0})
    assert seq_cls is not None and not seq_cls.joins_pairs
    with pytest.raises(APIError, match="ends with the model's pad token"):
        seq_cls.check_prompts([[5, 0]], "documents")
    kept = ClassifierConfig.from_config({"architectures": ["LlamaForSequenceClassification"], "use_pad_token": True,
                                         "classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"})
    assert kept is not None and not kept.joins_pairs


def test_the_router_reads_a_classifier_from_the_model_folder(tmp_path: pathlib.Path) -> None:
    config = PoolingConfig.from_model_dir(_model(tmp_path, config={
        "model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"], "id2label": {"0": "relevant"}}))
    assert config.classifier is not None and config.classifier.labels == ("relevant",)
    assert PoolingConfig.from_model_dir(_model(tmp_path / "lm")).classifier is None


def test_scoring_requests_are_checked_before_any_engine_is_asked(prompts) -> None:  # type: ignore[no-untyped-def]
    """Without engines (a valid request would be a 503): each malformed request is a 400 naming its field;
    /classify on a model without a classification head is a 400 naming that."""
    from fastapi.testclient import TestClient

    from router.app import create_app
    from tests.router.router_harness import SERVED_MODEL, make_state

    state = make_state(prompts, redis_url=None)
    with TestClient(create_app(state)) as client:
        for path, body, needle in [
            ("/classify", {"input": "hi"}, "/classify needs a sequence classifier"),
            ("/score", {"text_1": "a"}, "give exactly one of text_2, documents, items, data_2"),
            ("/score", {"text_1": "a", "queries": "b", "text_2": "c"}, "give exactly one of text_1, queries, data_1"),
            ("/v1/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "queries holds 2 texts and documents 3"),
            ("/score", {"text_1": "a", "text_2": []}, "text_2 must not be empty"),
            ("/score", {"text_1": "", "text_2": "b"}, "text_1 must not be empty"),
            ("/score", {"text_1": "a", "text_2": "b", "use_activation": False}, "cosine similarity"),
            ("/score", {"text_1": "a", "text_2": "b", "instruction": "x"}, "instruction is not supported"),
            ("/rerank", {"query": "a", "documents": []}, "documents"),
            ("/v2/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
            ("/v1/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0}, "must be -1 or positive"),
        ]:
            response = client.post(path, json={"model": SERVED_MODEL, **body})
            assert response.status_code == 400, (path, body, response.text)
            assert needle in response.json()["error"]["message"], (body, response.text)
        for path, body in [("/score", {"text_1": "a", "text_2": ["b", "c"]}),
                           ("/rerank", {"query": "a", "documents": ["b", "c"]})]:
            assert client.post(path, json={"model": SERVED_MODEL, **body}).status_code == 503  # no engines
