"""Sends one engine request to the chosen instances and follows its outputs to the end.

Disaggregated: the request goes to a prefill instance P with ``decode_target`` = decode instance
D; P answers with ``phase="prefill"`` (the first token), D with ``phase="decode"`` outputs.
Direct: a short prompt (or no prefill instance alive) goes to D alone, which answers ``"full"``.
However a request ends early (client gone, stop string, timeout, error), ``EngineRequest.close``
sends ``AbortRequest`` to P and D.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from common.kvcache.hashing import compute_block_hashes
from common.protocol import DecodeTarget, GenerateRequest, RequestOutput
from common.registry import InstanceInfo, PrefixIndex
from common.sampling_params import SamplingParams
from router.engine_client import EngineClient
from router.errors import APIError
from router.instance_pool import InstancePool
from router.metrics import RouterMetrics
from router.routing import RoutingPolicy

logger = logging.getLogger(__name__)

PREFIX_LOOKUP_TIMEOUT_S = 0.25
LIVENESS_POLL_S = 1.0
MAX_RETRIES = 2


def _retryable_error(error: str | None) -> bool:
    """Failures of an instance or a transfer, not of the request itself (those fail the same twice)."""
    return bool(error) and str(error).startswith("KV transfer failed")


class EngineRequestError(Exception):
    """An engine request that failed after it was sent (engine error, timeout, instance gone)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class EngineRequest:
    """One sent request; iterate ``outputs()`` once, and ``close()`` (idempotent) when done with it."""

    request_id: str
    queue: asyncio.Queue[RequestOutput]
    holders: list[InstanceInfo]  # [P, D] or [D]; the first one answers first
    dispatcher: Dispatcher
    request: GenerateRequest | None = None  # kept so a lost request can be sent again
    retries_left: int = MAX_RETRIES
    finished: bool = False
    closed: bool = False
    _first_seen: bool = field(default=False, repr=False)
    _yielded: bool = field(default=False, repr=False)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Outputs in order (prefill before decode); raises ``EngineRequestError`` on failure."""
        overtaken: list[RequestOutput] = []  # decode outputs that arrived before the prefill output
        try:
            while not self.finished:
                try:
                    output = await self._next()
                    if output.finish_reason == "error" and _retryable_error(output.error) and self._can_retry():
                        raise EngineRequestError(output.error or "engine error", status=502)
                except EngineRequestError as exc:
                    if exc.status != 502 or not self._can_retry():
                        raise
                    logger.warning("request %s lost (%s); sending it again", self.request_id, exc)
                    await self._retry()
                    overtaken = []
                    continue
                if self._awaiting_prefill() and output.phase == "decode" and output.finish_reason != "error":
                    overtaken.append(output)
                    continue
                batch = [output]
                if output.phase == "prefill":
                    batch, overtaken = [output, *overtaken], []
                for out in batch:
                    self._on_output(out)
                    self._yielded = True
                    yield out
                    if self.finished:
                        break
        finally:
            self.close()

    def _can_retry(self) -> bool:
        """Only a request whose client has seen nothing yet can be sent again transparently."""
        return not self._yielded and self.retries_left > 0 and self.request is not None

    async def _retry(self) -> None:
        """Abort the lost attempt everywhere and route the request again under a new id."""
        assert self.request is not None
        self.retries_left -= 1
        self.close()
        attempt = MAX_RETRIES - self.retries_left
        request = msgspec.structs.replace(self.request, request_id=f"{self.request.request_id}.retry{attempt}")
        try:
            fresh = await self.dispatcher.submit_request(request)
        except APIError as exc:
            raise EngineRequestError(f"request lost and no instance can take it again: {exc}", 502) from None
        self.request_id, self.queue, self.holders = fresh.request_id, fresh.queue, fresh.holders
        self.closed = False
        self._first_seen = False
        self.dispatcher.metrics.retries.inc()

    def _awaiting_prefill(self) -> bool:
        return len(self.holders) == 2 and not self._first_seen

    def _on_output(self, output: RequestOutput) -> None:
        if self._awaiting_prefill():
            self.dispatcher.pool.release(self.holders[0].instance_id)  # P is done with it
        self._first_seen = True
        if output.finish_reason == "error":  # not "finished": close() aborts it on every holder
            raise EngineRequestError(
                f"engine {output.instance_id or '?'} failed: {output.error or 'unknown error'}"
            )
        if output.finish_reason is not None:
            self.finished = True

    def _current_holder(self) -> InstanceInfo:
        return self.holders[-1] if self._first_seen else self.holders[0]

    async def _next(self) -> RequestOutput:
        timeout_s = self.dispatcher.request_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineRequestError(f"no output from the engines for {timeout_s:.0f}s", status=504)
            try:
                return await asyncio.wait_for(self.queue.get(), min(remaining, LIVENESS_POLL_S))
            except asyncio.TimeoutError:
                holder = self._current_holder()
                if self.dispatcher.pool.vanished(holder.instance_id):
                    raise EngineRequestError(f"instance {holder.instance_id} went away", status=502) from None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        client = self.dispatcher.client
        client.discard(self.request_id)
        if not self.finished:
            client.abort(self.request_id, [h.control_address for h in self.holders])
        pool = self.dispatcher.pool
        if self._awaiting_prefill():
            pool.release(self.holders[0].instance_id)
        pool.release(self.holders[-1].instance_id)


class Dispatcher:
    """Chooses instances (routing policy + prefix index) and sends requests without blocking."""

    def __init__(
        self,
        client: EngineClient,
        pool: InstancePool,
        policy: RoutingPolicy,
        prefix_index: PrefixIndex | None,
        metrics: RouterMetrics,
        request_timeout_s: float = 120.0,
        direct_prompt_tokens: int = 0,
    ) -> None:
        self.client = client
        self.pool = pool
        self.policy = policy
        self.prefix_index = prefix_index
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.direct_prompt_tokens = direct_prompt_tokens

    def _is_direct(self, num_prompt_tokens: int, decode: InstanceInfo, has_prefill: bool) -> bool:
        if not has_prefill:
            return True
        threshold = decode.block_size if self.direct_prompt_tokens == 0 else self.direct_prompt_tokens
        return num_prompt_tokens < threshold

    async def _prefix_matches(
        self, prefills: list[InstanceInfo], prompt: list[int], salt: str | None
    ) -> tuple[dict[str, int], int]:
        """Leading cached blocks per prefill instance, and the prompt's number of full blocks."""
        if self.prefix_index is None or not self.policy.uses_prefix:
            return {}, 0
        groups: dict[tuple[int, str], set[str]] = {}
        for info in prefills:
            groups.setdefault((info.block_size, info.model), set()).add(info.instance_id)
        matched: dict[str, int] = {}
        num_blocks = 0
        for (block_size, model), ids in groups.items():
            hashes = compute_block_hashes(prompt, block_size, model, salt)
            num_blocks = max(num_blocks, len(hashes))
            if not hashes:
                continue
            try:
                found = await asyncio.wait_for(
                    asyncio.to_thread(self.prefix_index.match, hashes), PREFIX_LOOKUP_TIMEOUT_S
                )
            except asyncio.TimeoutError:
                found = {}
            self.metrics.prefix_query_blocks.inc(len(hashes))
            matched.update({i: n for i, n in found.items() if i in ids})
        return matched, num_blocks

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None
    ) -> EngineRequest:
        """Route and send; raises a 503 ``APIError`` when no instance can take the request."""
        request = GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            reply_to=self.client.reply_address,
            cache_salt=cache_salt,
            arrival_time=time.time(),
        )
        return await self.submit_request(request)

    async def submit_request(self, request: GenerateRequest) -> EngineRequest:
        """Route and send a prepared request; raises a 503 ``APIError`` when nothing can take it."""
        queue = self.client.open(request.request_id)  # before sending: no output may arrive unclaimed
        try:
            holders = await self._route_and_send(request)
        except BaseException:
            self.client.discard(request.request_id)
            raise
        for holder in holders:
            self.pool.acquire(holder.instance_id)
        sent = msgspec.structs.replace(request, decode_target=None)
        return EngineRequest(
            request_id=request.request_id, queue=queue, holders=holders, dispatcher=self, request=sent
        )

    async def _route_and_send(self, request: GenerateRequest) -> list[InstanceInfo]:
        """Send to [P] with D as decode target, or straight to D; the instances now holding it."""
        pool = self.pool
        prefills, decodes = pool.alive("prefill"), pool.alive("decode")
        if not decodes:
            raise APIError(503, "no decode instance is available", code="no_instances")
        ranked_decodes = self.policy.rank_decode(decodes, pool.inflight)
        # Prefer a decode instance whose connection is up: a dead one cannot be sent to directly.
        ranked_decodes.sort(key=lambda d: not self.client.writable(d.control_address))
        decode = ranked_decodes[0]
        prompt = request.prompt_token_ids
        if not self._is_direct(len(prompt), decode, bool(prefills)):
            matched, num_blocks = await self._prefix_matches(prefills, prompt, request.cache_salt)
            request.decode_target = DecodeTarget(instance_id=decode.instance_id, kv_address=decode.kv_address)
            for prefill in self.policy.rank_prefill(prefills, pool.inflight, matched, num_blocks):
                if await self.client.send(prefill.control_address, request):
                    self.metrics.routed.labels(path="disaggregated").inc()
                    self.metrics.prefix_hit_blocks.inc(matched.get(prefill.instance_id, 0))
                    return [prefill, decode]
                pool.mark_unavailable(prefill.instance_id)
            logger.warning(
                "no prefill instance reachable; running %s on a decode instance", request.request_id
            )
        request.decode_target = None
        for candidate in ranked_decodes:
            if await self.client.send(candidate.control_address, request):
                self.metrics.routed.labels(path="direct").inc()
                return [candidate]
            pool.mark_unavailable(candidate.instance_id)
        raise APIError(503, "no engine instance is reachable", code="no_instances")
