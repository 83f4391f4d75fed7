"""Continuous batching with chunked prefill, prefix-cache hits and preemption by recompute.

Bookkeeping only: the scheduler decides which requests advance by how many tokens each step and
which blocks they use; it never touches tensors. Running requests go first (oldest first), so
decodes are never starved by a long prompt; waiting requests fill what is left of the token
budget, a long prompt in chunks, in the order of the scheduling policy (``common.engine.waiting_queue``:
first come first served, or by priority). With ``long_prefill_token_threshold`` (as in vLLM), no request
prefills more than that many tokens in one step, so the rest of the budget goes to the prompts
queued behind a long one instead of them waiting until it has been prefilled whole. A chunk never ends
inside an image whose tokens attend to each other both ways (Gemma 3's, ``Request.image_groups``): such an
image is prefilled in one step.

Disaggregation adds two states that hold blocks outside the batch (see ``RequestStatus``): on a
prefill instance a request *held for transfer* after its first token, until ``release``; on a
decode instance a request *waiting for remote KV*, from ``add_remote`` until ``remote_kv_arrived``
(it joins the queue) or ``release`` (the transfer failed). ``requests`` has every request that
holds blocks here, whatever its state.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.engine.request import FINISHED, Request, RequestStatus
from common.engine.waiting_queue import SchedulingPolicy, priority_key, waiting_queue
from common.kvcache.block_pool import KVBlock
from common.kvcache.host_tier import HostCopy
from common.kvcache.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # The request's block table as the KV cache manager keeps it (``block_ids_view``): read-only.
    block_ids: list[int]
    # After this step the request's KV covers all its tokens, so it samples a token.
    completes: bool
    # Speculative decoding: draft tokens computed after the request's last token (counted in
    # ``num_new_tokens``); each gives a row of logits more to sample (``common.engine.spec_decode``).
    spec_token_ids: Sequence[int] = ()

    @classmethod
    def of(cls, request: Request, num_new_tokens: int, block_ids: list[int]) -> ScheduledRequest:
        """``num_new_tokens`` of ``request`` from where it stands, ``completes`` worked out."""
        done = request.num_computed_tokens + num_new_tokens >= request.num_tokens
        return cls(request, num_new_tokens, block_ids, done)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Copies between the KV cache and its host tier, in order, before the block copies (``KVCacheManager``).
    host_copies: list[HostCopy] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    started_ids: list[str] = field(default_factory=list)  # in the running batch for the first time

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: SchedulingPolicy = "fcfs",
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # Only chunks can be capped: without chunked prefill a prompt goes in one step or waits.
        self.max_prefill_chunk = long_prefill_token_threshold if enable_chunked_prefill else 0
        self.policy = policy
        self.waiting = waiting_queue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _check_new(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        if not request.forked and request.sampling_params.n > self.max_num_seqs:
            raise ValueError(
                f"n={request.sampling_params.n} exceeds max_num_seqs {self.max_num_seqs}: a request's choices "
                "are sampled side by side; lower n or raise --max-num-seqs"
            )
        for k, (first, stop) in enumerate(request.image_groups):
            if stop - first > self.max_num_batched_tokens:
                raise ValueError(
                    f"images[{k}]: its {stop - first} tokens attend to each other both ways, so one step prefills "
                    f"them together, more than max_num_batched_tokens {self.max_num_batched_tokens}; raise "
                    "--max-num-batched-tokens"
                )
        longest = min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.max_model_len)
        if not self.kv.can_fit(longest, self.max_num_batched_tokens):
            raise ValueError(
                f"request needs {self.kv.max_blocks_held(longest, self.max_num_batched_tokens)} KV blocks at its "
                f"longest, but the pool has only "
                f"{self.kv.pool.num_blocks}; lower max_tokens or enlarge the KV cache"
            )

    def add(self, request: Request) -> None:
        """Queue a request; raises ``ValueError`` if it could never fit in the pool."""
        self._check_new(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_remote(self, request: Request, num_kv_tokens: int) -> bool:
        """Hold blocks for a request whose first ``num_kv_tokens`` of KV arrive from another
        instance; its leading cached blocks are reused and count as computed, as do those out of a
        window (``KVCacheManager.allocate_remote``): the sender skips them. False (nothing held)
        when the pool cannot take it now; ``ValueError`` when it never could."""
        self._check_new(request)
        hits, _ = self.kv.get_computed_blocks(request, num_kv_tokens // self.kv.block_size)
        if self.kv.allocate_remote(request, num_kv_tokens, hits) is None:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        return True

    def remote_kv_arrived(self, request_id: str, num_kv_tokens: int) -> None:
        """The KV of a request from ``add_remote`` has landed: it queues like any other."""
        req = self.requests[request_id]
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV, req
        req.num_computed_tokens = num_kv_tokens
        self.kv.mark_computed(req)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def hold_for_transfer(self, req: Request) -> None:
        """Take a request out of the batch but keep its blocks (and its id) until ``release``."""
        self.running.remove(req)
        req.status = RequestStatus.HELD_FOR_TRANSFER

    def release(self, request_id: str) -> Request | None:
        """End a request held for transfer or waiting for remote KV, and free its blocks; the one
        call for however the transfer ended. None (nothing done) for any other id."""
        req = self.requests.get(request_id)
        if req is None or req.status not in (
            RequestStatus.HELD_FOR_TRANSFER, RequestStatus.WAITING_FOR_REMOTE_KV
        ):
            return None
        del self.requests[request_id]
        self.kv.free(request_id)
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            req.status = RequestStatus.FINISHED_ABORTED
        return req

    def held(self, status: RequestStatus) -> list[Request]:
        """Requests in ``status`` (for the two transfer states, which no queue lists)."""
        return [r for r in self.requests.values() if r.status == status]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "priority":  # the most urgent get the budget and blocks first (stable: cheap)
            self.running.sort(key=priority_key)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = len(req.all_token_ids) - req.num_computed_tokens  # 1 for a decode
            if num_new == 0:
                # Async scheduling: its token is being sampled by the step in flight, which will finish
                # it or hand it to a transfer (the engine leaves no placeholder then): it sits out.
                i += 1
                continue
            if num_new > 1:
                num_new = self._whole_images(req, min(self._capped(num_new), budget), budget)
                if num_new == 0:  # the next image does not fit what is left of the budget: it waits a step
                    i += 1
                    continue
            elif req.spec_token_ids:
                # A decode with drafts: as many as the budget and the free blocks take, none before a
                # running request is preempted for them.
                drafts = req.spec_token_ids[: budget - 1]
                if drafts and self.kv.allocate_slots(req, 1 + len(drafts)):
                    out.scheduled.append(ScheduledRequest(
                        req, 1 + len(drafts), self.kv.block_ids_view(req.request_id), True, drafts,
                    ))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self._victim()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(
                    req, num_new, self.kv.block_ids_view(req.request_id),
                    req.num_computed_tokens + num_new >= len(req.all_token_ids),
                ))
                budget -= num_new
                i += 1
                continue
            # ``req`` preempted itself: everything after it is gone too.
            break

        # Seats: a running request is one sequence, and one not forked yet is its n choices, which
        # its first sampling adds (or samples beside it, for a transfer): no step samples more rows
        # than max_num_seqs, the most the engine sized its memory for (``ModelRunner.profile_activations``).
        seats = len(self.running)
        if self.waiting and seats < self.max_num_seqs:
            seats += sum(r.sampling_params.n - 1 for r in self.running if not r.forked)
        while self.waiting and budget > 0 and seats < self.max_num_seqs and not out.preempted_ids:
            req = self.waiting.peek()
            need = 1 if req.forked else req.sampling_params.n
            if seats + need > self.max_num_seqs:
                break
            computed_blocks: list[KVBlock] = []
            # A request collecting prompt logprobs, or pooling every position, computes every prompt position:
            # no prefix hits.
            if req.num_computed_tokens == 0 and req.request_id not in self.kv.req_blocks and not req.computes_every_position:
                computed_blocks, num_hit = self.kv.get_computed_blocks(req)
                req.num_computed_tokens = num_hit
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                self._undo_hit(req, computed_blocks)
                break
            num_new = self._whole_images(req, min(self._capped(num_new), budget), budget)
            if num_new == 0 or not self.kv.allocate_slots(req, num_new, computed_blocks):
                self._undo_hit(req, computed_blocks)
                break
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
                self.kv.prefix_cache_queries += req.num_tokens
                self.kv.prefix_cache_hits += req.num_computed_tokens
            self.waiting.pop()
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
                out.started_ids.append(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest.of(req, num_new, self.kv.block_ids_view(req.request_id)))
            budget -= num_new
            seats += need

        out.block_copies = self.kv.take_pending_copies()
        out.host_copies = self.kv.take_host_copies()
        return out

    def _victim(self) -> Request:
        """The request to preempt: the last running one (under the priority policy the running ones
        are in priority order: the one of the highest ``priority`` value, the latest among equals),
        passing over those that sit this step out (async scheduling: their token, still on its way,
        ends them or hands them to a transfer). The request being scheduled never sits out, so there
        is always one; and it is never one already scheduled this step, which all come before it."""
        for victim in reversed(self.running):
            if victim.num_computed_tokens < len(victim.all_token_ids):
                return victim
        raise AssertionError("no running request to preempt")

    def _capped(self, num_new: int) -> int:
        return min(num_new, self.max_prefill_chunk) if self.max_prefill_chunk > 0 else num_new

    @staticmethod
    def _whole_images(req: Request, num_new: int, budget: int) -> int:
        """``num_new`` prompt tokens from where ``req`` stands, cut back so that the chunk does not end inside an
        image whose tokens attend to each other both ways (``Request.image_groups``): to the image's start, or,
        for a chunk that starts inside or at it, on to its end where ``budget`` allows (past a
        ``long_prefill_token_threshold``), else 0 (it waits)."""
        start = req.num_computed_tokens
        end = start + num_new
        for first, stop in req.image_groups:
            if first < end < stop:
                if first > start:
                    return first - start
                return stop - start if stop - start <= budget else 0
        return num_new

    def _undo_hit(self, req: Request, computed_blocks: list[KVBlock]) -> None:
        if computed_blocks:
            req.num_computed_tokens = 0

    def recompute(self, req: Request) -> None:
        """Take a running request out of the batch to compute its KV again (its blocks freed; it keeps its
        tokens), as a preemption does."""
        self._preempt(req)

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks and requeue it at the front; it recomputes later."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.requeue(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance progress of every scheduled request and cache its newly full blocks (not of one
        that finished meanwhile: async scheduling resolves the step before it after launching this)."""
        mark_computed = self.kv.mark_computed
        windowed = self.kv.sliding_window is not None
        for s in out.scheduled:
            req = s.request
            if req.status >= FINISHED:
                continue
            first_query = req.num_computed_tokens
            # Drafts count once the engine knows which the model agreed with (``LLMEngine._accept``).
            req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
            mark_computed(req)
            # Blocks out of every layer's window go back, a prefill's whose KV leaves for a decode's too: the
            # decode skips at least those (``KVCacheManager.allocate_remote``), and the sender checks it does.
            if windowed:
                self.kv.release_out_of_window(req, first_query)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request and return its blocks to the pool."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
        self.kv.free(req.request_id)

    def add_waiting(self, req: Request) -> None:
        """Queue a request that already holds its blocks (a choice forked on the decode side)."""
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Admit a forked child (n > 1) straight into the running set."""
        req.status = RequestStatus.RUNNING
        self.requests[req.request_id] = req
        self.running.append(req)
