"""POST /v1/embeddings, as OpenAI's (and vLLM's, for its extras) answer it.

Each input (a text, a list of texts, token ids or lists of them, or a conversation) is one engine request
that returns the last token's final hidden state (``router.serving_pooling``); the router turns it into the
embedding the model's sentence-transformers config asks for (``router.pooling``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, StrictBool

from router.admission import CLIENT_KEY
from router.config import RequestLimits
from router.errors import bad_request
from router.openai_models import parse_request
from router.pooling import encode_embedding
from router.serving import DisconnectWaiter, response_ids
from router.serving_pooling import PoolingInputRequest, pool
from router.state import RouterState

# Writing a response hands the event loop back after this many embeddings, or this long, whichever first.
YIELD_EVERY = 8
YIELD_AFTER_S = 0.001


class EmbeddingRequest(PoolingInputRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    # vLLM's: normalize or not, whatever the model's pooling says (``use_activation``, before it ``normalize``).
    use_activation: StrictBool | None = None
    normalize: StrictBool | None = None
    # vLLM's extras not implemented: refused unless they ask for what is done anyway.
    embed_dtype: Any = None
    endianness: Any = None

    def check(self, limits: RequestLimits) -> None:
        super().check(limits)
        self.refuse_unless_nothing({"embed_dtype": "float32"}, "embeddings are float32")
        if self.endianness not in (None, "native", "little"):
            raise bad_request("endianness is not supported (base64 embeddings are little-endian)", param="endianness")
        if None not in (self.use_activation, self.normalize) and self.use_activation != self.normalize:
            raise bad_request("use_activation and normalize disagree", param="normalize")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


async def create_embedding(
    state: RouterState, body: Any, cache_salt: str | None, wait_disconnect: DisconnectWaiter
) -> Response:
    request = parse_request(EmbeddingRequest, body, state.config.limits)
    model = state.check_model(request.model)
    pooling = state.config.pooling
    pooling.check(request.dimensions)
    state.admission.check(CLIENT_KEY.get() or "-", request.num_inputs())
    prompts = await request.prompts(state)
    response_id, engine_id = response_ids("embd", request.request_id)
    hidden_states = await pool(state, engine_id, prompts, pooling.engine_pooling, cache_salt, request.cache_salt, request.model,
                               wait_disconnect)
    num_tokens = sum(len(prompt) for prompt in prompts)
    normalize = request.normalize if request.use_activation is None else request.use_activation
    head = {"id": response_id, "object": "list", "created": int(time.time()), "model": model}
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens).model_dump()
    body = await response_body(head, hidden_states, usage, lambda hidden: encode_embedding(
        pooling.embed(hidden, request.dimensions, normalize), request.encoding_format))
    return Response(body, media_type="application/json")


async def response_body(head: dict[str, Any], hidden_states: list[bytes], usage: dict[str, Any],
                        encode: Callable[[bytes], list[float] | str]) -> bytes:
    """The ``EmbeddingResponse`` JSON, written an embedding at a time, handing the event loop back between
    them: floats are slow to write (64 embeddings of 4,096 took 161 ms in one piece on this host), and the
    loop meanwhile streams every other request's tokens."""
    parts = [json.dumps(head)[:-1].encode(), b', "data": [']
    last_yield = time.perf_counter()
    for i, hidden in enumerate(hidden_states):
        if i:
            parts.append(b", ")
        parts.append(json.dumps({"object": "embedding", "embedding": encode(hidden), "index": i}).encode())
        if i % YIELD_EVERY == YIELD_EVERY - 1 or time.perf_counter() - last_yield > YIELD_AFTER_S:
            await asyncio.sleep(0)
            last_yield = time.perf_counter()
    parts.append(b'], "usage": ' + json.dumps(usage).encode() + b"}")
    return b"".join(parts)
