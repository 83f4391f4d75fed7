"""Sends one engine request to the chosen instances and follows its outputs to the end.

Disaggregated: the request goes to a prefill instance P with ``decode_target`` = decode instance
D; P answers with ``phase="prefill"`` (the first token), D with ``phase="decode"`` outputs.
Direct: a short prompt (or no prefill instance alive) goes to D alone, which answers ``"full"``.
A request with ``n > 1`` is sent once; the engines fork its choices (sharing the prompt's blocks)
and report choice ``i`` as ``choice_request_id(request_id, i)``, each followed by its own
``EngineRequest``.
However a request ends early (client gone, stop string, timeout, error), ``EngineRequest.close``
sends ``AbortRequest`` to P and D.

No request dies with an instance. ``EngineRequest`` remembers every token it has handed on; when
an instance holding it dies, stalls, drains or loses the KV transfer, it aborts that attempt and
continues the request elsewhere as prompt + those tokens (``GenerateRequest.output_token_ids``),
so the caller sees one unbroken stream and greedy output equals the uninterrupted run. Losses of
an instance that had started the request (``RequestsStarted``) are few before it fails
(``MAX_MIGRATIONS``); losses where it only waited in the instance's queue are more
(``MAX_WAITING_LOSSES``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from common.kvcache.hashing import adapter_model_key, compute_block_hashes
from common.protocol import (
    DecodeTarget,
    GenerateRequest,
    ImageInput,
    RequestOutput,
    choice_request_ids,
    image_spans,
    merge_outputs,
)
from common.registry import NO_KV_TRANSFER, InstanceInfo, PrefixIndex
from common.sampling_params import SamplingParams
from router.engine_client import EngineClient
from router.errors import APIError
from router.instance_pool import InstancePool
from router.metrics import RouterMetrics
from router.output_queue import WAKE_INTERVAL_S, OutputQueue
from router.routing import RoutingPolicy

logger = logging.getLogger(__name__)

PREFIX_LOOKUP_TIMEOUT_S = 0.25
LIVENESS_POLL_S = 1.0
# Losses of an instance that was running the request (it had said so, ``RequestsStarted``): the
# request may have caused them (a prompt that crashes every engine it reaches), so few.
MAX_MIGRATIONS = 3
# Losses of an instance where the request only waited, which it cannot have caused (under a high
# fault rate a queued request can meet several): more, yet not without end (an instance that died
# admitting it never said it ran it).
MAX_WAITING_LOSSES = 10
# An instance the registry no longer lists and that has been silent this long is dead.
GONE_SILENCE_S = 2.0
# How long a lost request waits for some instance to continue it (e.g. while one restarts).
MIGRATION_WAIT_S = 60.0
# How long a request refused by overloaded instances keeps being sent again before it fails (429).
OVERLOADED_WAIT_S = 60.0


class EngineRequestError(Exception):
    """An engine request that failed after it was sent (engine error, timeout, lost too often)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class InstanceLost(Exception):
    """The attempt's instance died, stalled, drained or lost the transfer; the request goes on."""

    def __init__(self, reason: str, instance_id: str | None = None, healthy: bool = False) -> None:
        super().__init__(reason)
        self.instance_id = instance_id
        # The instance is fine now (restarted under its id): it may take the request again at once.
        self.healthy = healthy


@dataclass(slots=True)  # attributes read per streamed token
class EngineRequest:
    """One request to the engines, across migrations; iterate ``outputs()`` once, and ``close()``
    (idempotent) when done with it. ``request_id`` and ``holders`` are the current attempt's."""

    request_id: str
    queue: OutputQueue
    holders: list[InstanceInfo]  # [P, D] or [D]; the first one answers first
    dispatcher: Dispatcher
    request: GenerateRequest  # as first sent (no decode target): what a migration continues
    streamed_token_ids: list[int] = field(default_factory=list)  # handed on, across attempts
    num_migrations: int = 0  # losses of instances running it
    num_waiting_losses: int = 0  # losses of instances where it waited
    num_refusals: int = 0  # attempts an overloaded instance refused
    overloaded_since: float | None = None
    finished: bool = False
    closed: bool = False
    sent_at: float = field(default_factory=time.monotonic)
    _first_seen: bool = field(default=False, repr=False)
    _decode_seen: bool = field(default=False, repr=False)
    _interrupt: BaseException | None = field(default=None, repr=False)
    _sink: Callable[[RequestOutput], bool] | None = field(default=None, repr=False)
    # When the reader last got an output (or began to wait): ``_next``'s deadline counts from it.
    _last_progress: float = field(default=0.0, repr=False)

    def interrupt(self, exc: BaseException) -> None:
        """Make ``outputs()`` raise ``exc`` at its next wait, or now if it waits (say, the client
        went away): the reader learns it without a task or queue of its own between it and the
        engines."""
        self._interrupt = exc
        self.queue.wake()

    def set_sink(self, sink: Callable[[RequestOutput], bool] | None) -> None:
        """Offer outputs to ``sink`` while the reader waits (``router/inline_stream.py``); it stays
        with the request across migrations."""
        self._sink = sink
        self.queue.sink = sink

    def can_take_inline(self, output: RequestOutput) -> bool:
        """Whether ``output`` may be handed on outside ``outputs()`` (the caller sends it, then calls
        ``took_inline``): if ``outputs()`` would hand it on as it is. Not while the prefill's output is
        awaited (``outputs()`` releases its instance, holds back decode outputs that overtook it),
        after an interrupt, a finish or a close, or for an error (a migration, a failure)."""
        return not (
            self._interrupt is not None or self.finished or self.closed or self._awaiting_prefill()
            or output.phase == "prefill" or output.finish_reason == "error"
        )

    def took_inline(self, output: RequestOutput, now: float) -> None:
        """The bookkeeping of an output the caller handed on (``can_take_inline``), as ``outputs()``
        does its own; the router's sink does it once the whole engine message is sent, before
        anything else runs (``EngineClient.after_sends``). A finish makes the caller end the reader
        (``interrupt``), and ``close`` then aborts nothing."""
        self._on_output(output)
        self._last_progress = now

    def _check_interrupt(self) -> None:
        if self._interrupt is not None:
            raise self._interrupt

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Outputs in order (prefill before decode); raises ``EngineRequestError`` on failure."""
        overtaken: list[RequestOutput] = []  # decode outputs that arrived before the prefill output
        try:
            while not self.finished:
                try:
                    output = await self._next()
                    if output.finish_reason == "error" and output.overloaded:
                        await self._send_again_later(output)
                        overtaken = []
                        continue
                    if output.finish_reason == "error" and output.retryable:
                        raise InstanceLost(f"{output.instance_id or '?'}: {output.error}")
                except InstanceLost as exc:
                    await self._migrate(exc)
                    overtaken = []
                    continue
                if self._awaiting_prefill() and output.phase == "decode" and output.finish_reason != "error":
                    overtaken.append(output)
                    continue
                if output.finish_reason is None and not self._awaiting_prefill():
                    output = self._coalesce(output)
                batch = [output]
                if output.phase == "prefill":
                    batch, overtaken = [output, *overtaken], []
                for out in batch:
                    self._on_output(out)
                    yield out
                    if self.finished:
                        break
        finally:
            self.close()
            # An interrupt raised here holds, through its traceback, the frames that hold this
            # request: kept, it would keep the request's stream and everything it holds in a
            # reference cycle, freed only by a garbage collection (one pause for many streams).
            self._interrupt = None

    async def _migrate(self, lost: InstanceLost) -> None:
        """Abort the lost attempt everywhere and continue the request on other instances. A loss
        counts against ``MAX_MIGRATIONS`` where the instance was running the request (or which one
        is not known), else against ``MAX_WAITING_LOSSES``."""
        ran_there = lost.instance_id is None or lost.instance_id in self.queue.started_on
        if ran_there:
            if self.num_migrations >= MAX_MIGRATIONS:
                raise EngineRequestError(
                    f"request lost {self.num_migrations + 1} times on instances running it, giving up; "
                    f"last: {lost}", status=502,
                )
            self.num_migrations += 1
        else:  # it only waited there
            if self.num_waiting_losses >= MAX_WAITING_LOSSES:
                raise EngineRequestError(
                    f"request lost {self.num_waiting_losses + 1} times while waiting, giving up; last: {lost}",
                    status=502,
                )
            self.num_waiting_losses += 1
        attempt = self.num_migrations + self.num_waiting_losses
        logger.warning(
            "request %s lost after %d tokens (%s; %s); continuing it elsewhere",
            self.request.request_id, len(self.streamed_token_ids), lost,
            "it was running there" if ran_there else "it was waiting there",
        )
        if lost.instance_id is not None and not lost.healthy:
            self.dispatcher.pool.mark_unavailable(lost.instance_id)
        self.close()
        request = msgspec.structs.replace(
            self.request,
            request_id=f"{self.request.request_id}.m{attempt}",
            output_token_ids=[*self.request.output_token_ids, *self.streamed_token_ids],
        )
        await self.dispatcher.pool.refresh_soon()  # where the registry says it can go now
        deadline = time.monotonic() + MIGRATION_WAIT_S
        while True:
            self._check_interrupt()
            try:
                [fresh] = await self.dispatcher.submit_request(request)
                break
            except APIError as exc:
                if time.monotonic() >= deadline:
                    raise EngineRequestError(
                        f"request lost and no instance could continue it within {MIGRATION_WAIT_S:.0f}s: {exc}",
                        status=502,
                    ) from None
                await asyncio.sleep(LIVENESS_POLL_S / 2)
        self._continue_as(fresh)
        self.dispatcher.metrics.migrations.labels(where="running" if ran_there else "waiting").inc()

    async def _send_again_later(self, refusal: RequestOutput) -> None:
        """An instance refused the attempt as overloaded (nothing started there): send it again
        after a back-off, wherever the routing policy says then. Not a migration; past
        ``OVERLOADED_WAIT_S`` of refusals the request fails with a 429."""
        now = time.monotonic()
        if self.overloaded_since is None:
            self.overloaded_since = now
        if now - self.overloaded_since > OVERLOADED_WAIT_S:
            raise EngineRequestError(
                f"every instance stayed overloaded for {OVERLOADED_WAIT_S:.0f}s; retry later", status=429
            )
        self.num_refusals += 1
        self.close()
        await asyncio.sleep(min(0.05 * 2 ** min(self.num_refusals, 5), 1.0))
        await self.dispatcher.pool.refresh_soon()  # a draining instance (it refused so) is passed over
        self._check_interrupt()  # the client may have left during the back-off: send nothing more
        request = msgspec.structs.replace(
            self.request,
            request_id=f"{self.request.request_id}.r{self.num_refusals}",
            output_token_ids=[*self.request.output_token_ids, *self.streamed_token_ids],
        )
        try:
            [fresh] = await self.dispatcher.submit_request(request)
        except APIError as exc:
            raise EngineRequestError(str(exc), status=exc.status) from None
        self._continue_as(fresh)

    def _continue_as(self, fresh: EngineRequest) -> None:
        """Carry on as ``fresh``, the attempt just sent (a migration, or a send after a refusal)."""
        self.request_id, self.queue, self.holders, self.sent_at = (
            fresh.request_id, fresh.queue, fresh.holders, fresh.sent_at
        )
        self.queue.sink = self._sink
        self.closed = False
        self._first_seen = self._decode_seen = False

    def _awaiting_prefill(self) -> bool:
        return len(self.holders) == 2 and not self._first_seen

    def _on_output(self, output: RequestOutput) -> None:
        """The bookkeeping of an output handed on: instances released, tokens a migration continues
        from, the finish (an error output raises instead)."""
        if self._awaiting_prefill():
            self.dispatcher.pool.release(self.holders[0].instance_id)  # P is done with it
        self._first_seen = True
        self._decode_seen = self._decode_seen or output.phase == "decode"
        if output.finish_reason == "error":  # not "finished": close() aborts it on every holder
            raise EngineRequestError(
                f"engine {output.instance_id or '?'} failed: {output.error or 'unknown error'}"
            )
        if output.finish_reason is not None:
            self.finished = True
        self.streamed_token_ids.extend(output.new_token_ids)

    def _watched(self) -> list[InstanceInfo]:
        """Holders whose loss loses this attempt: P too until D has produced (P may die mid-transfer)."""
        if len(self.holders) == 2 and not self._decode_seen:
            return self.holders
        return self.holders[-1:]

    def _lost_holder(self) -> InstanceLost | None:
        client, pool = self.dispatcher.client, self.dispatcher.pool
        for holder in self._watched():
            if pool.restarted(holder):
                return InstanceLost(f"instance {holder.instance_id} restarted", holder.instance_id, healthy=True)
            silence = client.silent_for(holder.instance_id, self.sent_at)
            if silence > self.dispatcher.stall_timeout_s:
                return InstanceLost(f"instance {holder.instance_id} made no progress for {silence:.0f}s",
                                    holder.instance_id)
            if silence > GONE_SILENCE_S and pool.vanished(holder.instance_id):
                return InstanceLost(f"instance {holder.instance_id} went away", holder.instance_id)
        return None

    async def _next(self) -> RequestOutput:
        """The next output. Waiting, it is woken at least every ``WAKE_INTERVAL_S`` to check the
        request's deadline and its instances' liveness."""
        self._check_interrupt()
        queue = self.queue
        if not queue.empty():
            return queue.get_nowait()
        timeout_s = self.dispatcher.request_timeout_s
        self._last_progress = time.monotonic()
        while True:
            remaining = self._last_progress + timeout_s - time.monotonic()  # outputs taken inline move it
            if remaining <= 0:
                raise EngineRequestError(f"no output from the engines for {timeout_s:.0f}s", status=504)
            await queue.wait(remaining if remaining < WAKE_INTERVAL_S else None)
            self._check_interrupt()
            if not queue.empty():
                return queue.get_nowait()
            lost = self._lost_holder()
            if lost is not None:
                raise lost

    def _coalesce(self, output: RequestOutput) -> RequestOutput:
        """``output`` with the plain token outputs queued right behind it (a reader that fell behind
        handles them as one: one delta, one SSE event)."""
        queue = self.queue
        merged = output
        while (
            merged.finish_reason is None
            and (nxt := queue.peek()) is not None
            and nxt.phase == merged.phase
            and nxt.finish_reason != "error"
            and (nxt.logprobs is None) == (merged.logprobs is None)
        ):
            merged = merge_outputs(merged, queue.get_nowait())
        return merged

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
        stall_timeout_s: float = 10.0,
    ) -> None:
        self.client = client
        self.pool = pool
        self.policy = policy
        self.prefix_index = prefix_index
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.direct_prompt_tokens = direct_prompt_tokens
        self.stall_timeout_s = stall_timeout_s

    def _is_direct(self, num_prompt_tokens: int, decode: InstanceInfo, has_prefill: bool) -> bool:
        if not has_prefill:
            return True
        threshold = decode.block_size if self.direct_prompt_tokens == 0 else self.direct_prompt_tokens
        return num_prompt_tokens < threshold

    async def _prefix_matches(
        self, prefills: list[InstanceInfo], prompt: list[int], salt: str | None, lora_name: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> tuple[dict[str, int], int]:
        """Leading cached blocks per prefill instance (of a model windowed on every layer: those a hit there would
        count, ``PrefixIndex.match``), and the prompt's number of full blocks (a block that holds an image's tokens
        hashed with the image's digest, as the engines hash it)."""
        if self.prefix_index is None or not self.policy.uses_prefix:
            return {}, 0
        groups: dict[tuple[int, str, int], set[str]] = {}
        for info in prefills:
            groups.setdefault((info.block_size, info.model, info.kv_window), set()).add(info.instance_id)
        matched: dict[str, int] = {}
        num_blocks = 0
        spans = image_spans(images or [])
        for (block_size, model, kv_window), ids in groups.items():
            hashes = compute_block_hashes(prompt, block_size, adapter_model_key(model, lora_name), salt, images=spans)
            num_blocks = max(num_blocks, len(hashes))
            if not hashes:
                continue
            # Not asyncio.wait_for, which before Python 3.12 can swallow the caller's cancellation.
            lookup = asyncio.ensure_future(asyncio.to_thread(self.prefix_index.match, hashes, block_size, kv_window))
            try:
                await asyncio.wait([lookup], timeout=PREFIX_LOOKUP_TIMEOUT_S)
            finally:
                timed_out = not lookup.done()
                if timed_out:
                    lookup.cancel()  # the thread runs on; its answer is dropped
            found = {} if timed_out else lookup.result()
            self.metrics.prefix_query_blocks.inc(len(hashes))
            matched.update({i: n for i, n in found.items() if i in ids})
        return matched, num_blocks

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None,
        lora_name: str | None = None, images: list[ImageInput] | None = None,
    ) -> list[EngineRequest]:
        """Route and send; one ``EngineRequest`` per choice (``params.n``), each carrying the prompt's
        ``images`` (a migration re-sends them with the rest). Raises a 503 ``APIError`` when no instance
        can take the request."""
        request = GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            reply_to=self.client.reply_address,
            cache_salt=cache_salt,
            arrival_time=time.time(),
            lora_name=lora_name,
            images=images or [],
        )
        return await self.submit_request(request)

    async def submit_request(self, request: GenerateRequest) -> list[EngineRequest]:
        """Route and send a prepared request; one ``EngineRequest`` per choice. Raises a 503
        ``APIError`` when nothing can take it."""
        params = request.sampling_params
        choice_ids = choice_request_ids(request.request_id, params.n)
        # Before sending: no output may arrive unclaimed.
        queues = [self.client.open(choice_id) for choice_id in choice_ids]
        try:
            holders = await self._route_and_send(request)
        except BaseException:
            for choice_id in choice_ids:
                self.client.discard(choice_id)
            raise
        choices = []
        for index, (choice_id, queue) in enumerate(zip(choice_ids, queues, strict=True)):
            for holder in holders:
                self.pool.acquire(holder.instance_id)
            # What a migration of this choice continues: an n = 1 request drawing from the
            # choice's own seed (the engines' fork seeds choice i with seed + i).
            own = params if params.n == 1 else msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + index
            )
            sent = msgspec.structs.replace(request, request_id=choice_id, sampling_params=own, decode_target=None)
            choices.append(EngineRequest(
                request_id=choice_id, queue=queue, holders=list(holders), dispatcher=self, request=sent
            ))
        return choices

    async def _route_and_send(self, request: GenerateRequest) -> list[InstanceInfo]:
        """Send to [P] with D as decode target, or straight to D; the instances now holding it."""
        if request.pooling is not None:
            return await self._route_pooling(request)
        pool = self.pool
        prefills, decodes = pool.alive("prefill"), pool.alive("decode")
        lora = request.lora_name
        if lora is not None:  # only instances that serve the request's adapter
            prefills = [p for p in prefills if lora in p.lora_names]
            decodes = [d for d in decodes if lora in d.lora_names]
            if not decodes:
                raise APIError(503, f"no decode instance serving LoRA adapter '{lora}' is available",
                               code="no_instances")
        if not decodes:
            raise APIError(503, "no decode instance is available", code="no_instances")
        ranked_decodes = self.policy.rank_decode(decodes, pool.inflight)
        # Prefer a decode instance whose connection is up: a dead one cannot be sent to directly.
        ranked_decodes.sort(key=lambda d: not self.client.writable(d.control_address))
        decode = ranked_decodes[0]
        prompt = [*request.prompt_token_ids, *request.output_token_ids]  # a continued request's too
        # A prefill hands its KV only to a decode whose cache it fits (a fleet part way through a change of
        # --kv-cache-dtype or block size, say): the others would fail the transfer.
        # One that takes no KV (``NO_KV_TRANSFER``) runs every request whole.
        fitting = [] if decode.kv_layout == NO_KV_TRANSFER else [
            p for p in prefills if not (p.kv_layout and decode.kv_layout) or p.kv_layout == decode.kv_layout]
        if prefills and not fitting and decode.kv_layout != NO_KV_TRANSFER:
            logger.warning("no prefill instance's KV layout fits decode %s (%s); running %s there", decode.instance_id,
                           decode.kv_layout, request.request_id)
        prefills = fitting
        if not self._is_direct(len(prompt), decode, bool(prefills)):
            matched, num_blocks = await self._prefix_matches(prefills, prompt, request.cache_salt, request.lora_name,
                                                             request.images)
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
        return [await self._send_whole(request, ranked_decodes, "direct")]

    async def _send_whole(self, request: GenerateRequest, candidates: list[InstanceInfo], path: str) -> InstanceInfo:
        """Send a request that runs whole where it goes to the first of ``candidates`` that takes it (those
        unreachable marked so); a 503 when none does."""
        for candidate in candidates:
            if await self.client.send(candidate.control_address, request):
                self.metrics.routed.labels(path=path).inc()
                return candidate
            self.pool.mark_unavailable(candidate.instance_id)
        raise APIError(503, "no engine instance is reachable", code="no_instances")

    async def _route_pooling(self, request: GenerateRequest) -> list[InstanceInfo]:
        """An embedding is the prompt's forward alone, run whole where it is sent: on a prefill instance
        (the one holding most of the prompt's blocks, as a prefill is chosen), else a decode instance; the
        instance now holding it. Any KV layout does: nothing is transferred."""
        pool, lora = self.pool, request.lora_name
        prefills, decodes = pool.alive("prefill"), pool.alive("decode")
        if lora is not None:
            prefills = [p for p in prefills if lora in p.lora_names]
            decodes = [d for d in decodes if lora in d.lora_names]
        candidates: list[InstanceInfo] = []
        if prefills:
            matched, num_blocks = await self._prefix_matches(prefills, request.prompt_token_ids, request.cache_salt,
                                                             lora)
            candidates += self.policy.rank_prefill(prefills, pool.inflight, matched, num_blocks)
        candidates += self.policy.rank_decode(decodes, pool.inflight) if decodes else []
        if not candidates:
            raise APIError(503, "no engine instance is available" + (f" serving LoRA adapter '{lora}'" if lora else ""),
                           code="no_instances")
        return [await self._send_whole(request, candidates, "pooling")]
