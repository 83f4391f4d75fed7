"""vLLM's classification and scoring endpoints: ``/classify``, ``/score`` and ``/rerank`` (Jina's and
Cohere's form, also under ``/v1/rerank`` and ``/v2/rerank``).

A sequence classifier (``...ForSequenceClassification``: classifiers, reward models, rerankers) pools a
prompt as the engines' "classify" request: the ``score`` head's logits of its last token, through the
activation its config asks for (``router.pooling.ClassifierConfig``). ``/score`` and ``/rerank`` give a
classifier of one label each pair's input as its tokenizer encodes a text with its ``text_pair`` (a
cross-encoder's), and the activated logit is the score. Any other model scores a pair by the cosine
similarity of the two texts' embeddings (the last token's hidden states, ``/v1/embeddings``'), as vLLM
scores with an embedding model. The engine side, admission, retries and aborts are the embeddings'
(``router.serving_pooling``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictBool, StrictStr

from router.admission import CLIENT_KEY
from router.config import RequestLimits
from router.errors import bad_request
from router.openai_models import parse_request
from router.pooling import ClassifierConfig
from router.serving import DisconnectWaiter, response_ids
from router.serving_pooling import (
    PoolingInputRequest,
    PoolingRequest,
    check_num_inputs,
    check_truncation,
    fit_prompts,
    pool,
)
from router.state import RouterState


class _Activation(BaseModel):
    # vLLM's: the activation of a classifier's logits, or none (``use_activation``; before it ``activation``).
    use_activation: StrictBool | None = None
    activation: StrictBool | None = None

    def activated(self) -> bool:
        if None not in (self.use_activation, self.activation) and self.use_activation != self.activation:
            raise bad_request("use_activation and activation disagree", param="activation")
        return (self.activation if self.use_activation is None else self.use_activation) is not False


class ClassificationRequest(PoolingInputRequest, _Activation):
    pass


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


ScoreInput = StrictStr | list[StrictStr]


class _ScoringRequest(PoolingRequest, _Activation):
    # vLLM's extras not implemented: refused unless they ask for what is done anyway.
    instruction: Any = None
    max_tokens_per_query: Any = None
    max_tokens_per_doc: Any = None

    def check(self, limits: RequestLimits) -> None:
        self.refuse_unless_nothing({"priority": 0, "mm_processor_kwargs": None, "instruction": None,
                                    "max_tokens_per_query": 0, "max_tokens_per_doc": 0},
                                   "scoring runs text pairs only, at priority 0, truncated by truncate_prompt_tokens")
        check_truncation(self.truncate_prompt_tokens)


class ScoreRequest(_ScoringRequest):
    """vLLM's four spellings of the two sides: ``text_1``/``text_2``, ``queries``/``documents``,
    ``queries``/``items``, ``data_1``/``data_2``. One text on the left is paired with each on the right;
    else the two lists pair up in order."""

    text_1: ScoreInput | None = None
    text_2: ScoreInput | None = None
    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    items: ScoreInput | None = None
    data_1: ScoreInput | None = None
    data_2: ScoreInput | None = None

    def check(self, limits: RequestLimits) -> None:
        super().check(limits)
        left, right = self.sides()
        if len(left[1]) != 1 and len(left[1]) != len(right[1]):
            raise bad_request(f"{left[0]} holds {len(left[1])} texts and {right[0]} {len(right[1])}: give one on "
                              "the left, or as many as on the right", param=left[0])
        check_num_inputs(len(right[1]), limits, right[0])

    def sides(self) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
        found = []
        for names in (("text_1", "queries", "data_1"), ("text_2", "documents", "items", "data_2")):
            given = [(name, getattr(self, name)) for name in names if getattr(self, name) is not None]
            if len(given) != 1:
                raise bad_request(f"give exactly one of {', '.join(names)}", param=names[0])
            name, value = given[0]
            texts = [value] if isinstance(value, str) else list(value)
            if not texts:
                raise bad_request(f"{name} must not be empty", param=name)
            found.append((name, texts))
        return found[0], found[1]

    def pairs(self) -> tuple[list[tuple[str, str]], tuple[str, str]]:
        (left_name, left), (right_name, right) = self.sides()
        return list(zip(left * len(right) if len(left) == 1 else left, right, strict=True)), (left_name, right_name)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(_ScoringRequest):
    query: StrictStr
    documents: list[StrictStr] = Field(min_length=1)
    # The best ``top_n`` documents (0: all of them), best first; Cohere's ``return_documents``.
    top_n: int = Field(default=0, ge=0)
    return_documents: StrictBool = True

    def check(self, limits: RequestLimits) -> None:
        super().check(limits)
        check_num_inputs(len(self.documents), limits, "documents")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _classifier(state: RouterState, endpoint: str) -> ClassifierConfig:
    classifier = state.config.pooling.classifier
    if classifier is None:
        raise bad_request(f"{endpoint} needs a sequence classifier (a ...ForSequenceClassification checkpoint); "
                          "this model has no classification head", param="model")
    return classifier


async def create_classification(
    state: RouterState, body: Any, cache_salt: str | None, wait_disconnect: DisconnectWaiter
) -> JSONResponse:
    request = parse_request(ClassificationRequest, body, state.config.limits)
    model = state.check_model(request.model)
    classifier = _classifier(state, "/classify")
    activation = classifier.activation if request.activated() else "identity"
    state.admission.check(CLIENT_KEY.get() or "-", request.num_inputs())
    prompts = await request.prompts(state)
    classifier.check_prompts(prompts, "messages" if request.messages is not None else "input")
    response_id, engine_id = response_ids("classify", request.request_id)
    outputs = await pool(state, engine_id, prompts, "classify", cache_salt, request.cache_salt, request.model,
                         wait_disconnect)
    data = []
    for i, logits in enumerate(outputs):
        probs = classifier.outputs(logits, activation)
        data.append(ClassificationData(index=i, label=classifier.labels[int(np.argmax(probs))],
                                       probs=probs.tolist(), num_classes=len(probs)))
    return _listed(ClassificationResponse, response_id, model, data, sum(len(prompt) for prompt in prompts))


async def create_score(
    state: RouterState, body: Any, cache_salt: str | None, wait_disconnect: DisconnectWaiter
) -> JSONResponse:
    request = parse_request(ScoreRequest, body, state.config.limits)
    model = state.check_model(request.model)
    pairs, params = request.pairs()
    response_id, engine_id = response_ids("score", request.request_id)
    scores, num_tokens = await _score_pairs(state, request, pairs, params, engine_id, cache_salt, wait_disconnect)
    return _listed(ScoreResponse, response_id, model,
                   [ScoreData(index=i, score=score) for i, score in enumerate(scores)], num_tokens)


async def create_rerank(
    state: RouterState, body: Any, cache_salt: str | None, wait_disconnect: DisconnectWaiter
) -> JSONResponse:
    request = parse_request(RerankRequest, body, state.config.limits)
    model = state.check_model(request.model)
    pairs = [(request.query, document) for document in request.documents]
    response_id, engine_id = response_ids("rerank", request.request_id)
    scores, num_tokens = await _score_pairs(state, request, pairs, ("query", "documents"), engine_id, cache_salt,
                                            wait_disconnect)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:request.top_n or None]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=request.documents[i]) if request.return_documents else None)
               for i in order]
    return JSONResponse(RerankResponse(
        id=response_id, model=model, results=results,
        usage=RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)).model_dump(exclude_none=True))


def _listed(response: type[ClassificationResponse | ScoreResponse], response_id: str, model: str, data: list[Any],
            num_tokens: int) -> JSONResponse:
    """vLLM's list response of a pooling endpoint, its usage the prompt tokens pooled."""
    return JSONResponse(response(id=response_id, created=int(time.time()), model=model, data=data,
                                 usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)).model_dump())


async def _score_pairs(state: RouterState, request: _ScoringRequest, pairs: list[tuple[str, str]],
                       params: tuple[str, str], engine_id: str, cache_salt: str | None,
                       wait_disconnect: DisconnectWaiter) -> tuple[list[float], int]:
    """Each pair's score, and the prompt tokens pooled for them: a classifier's activated logit of the pair
    encoded as one input, else the cosine similarity of the two texts' embeddings."""
    for i, pair in enumerate(pairs):
        for text, param in zip(pair, params, strict=True):
            if not text:
                raise bad_request(f"{param} must not be empty (pair {i})", param=param)
    classifier = state.config.pooling.classifier
    truncate = request.truncate_prompt_tokens
    if classifier is not None:
        classifier.check_score()
        activation = classifier.score_activation if request.activated() else "identity"
        state.admission.check(CLIENT_KEY.get() or "-", len(pairs))
        max_model_len = state.max_model_len()
        limit = None if truncate is None else max_model_len - 1 if truncate == -1 else truncate
        prompts = await state.prompts.tokenize_pairs(pairs, max_model_len, params, limit, classifier.joins_pairs)
        prompts = fit_prompts(state, prompts, None, [f"{params[1]}.{i}" for i in range(len(prompts))])
        classifier.check_prompts(prompts, params[1])
        outputs = await pool(state, engine_id, prompts, "classify", cache_salt, request.cache_salt, request.model,
                             wait_disconnect)
        return [float(classifier.outputs(logits, activation)[0]) for logits in outputs], sum(map(len, prompts))
    if request.use_activation is False or request.activation is False:
        raise bad_request("use_activation: this model scores by the cosine similarity of embeddings, which has "
                          "no activation to leave out", param="use_activation")
    state.config.pooling.check(None)
    # Each distinct text embedded once (a query against many documents: once).
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    state.admission.check(CLIENT_KEY.get() or "-", len(texts))
    context = None if truncate is not None else state.max_model_len()
    prompts = await state.prompts.tokenize_completion(texts, context, field="text")
    prompts = fit_prompts(state, prompts, truncate, "text")
    hidden = await pool(state, engine_id, prompts, state.config.pooling.engine_pooling, cache_salt, request.cache_salt, request.model,
                        wait_disconnect)
    unit = {}
    for text, vector in zip(texts, hidden, strict=True):
        values = np.frombuffer(vector, dtype="<f4").astype(np.float64)
        unit[text] = values / max(float(np.linalg.norm(values)), 1e-12)
    return [float(unit[first] @ unit[second]) for first, second in pairs], sum(map(len, prompts))
