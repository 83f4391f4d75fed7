"""The scheduler's request lifecycle keeps its invariants under any sequence of events.

A hypothesis state machine drives one ``Scheduler`` (no model: steps only do the bookkeeping) with
local requests, prefill-only requests that end *held for transfer*, decode-side requests *waiting
for remote KV*, arrivals, releases (a transfer ending however it ends), aborts and preemptions
from a small pool. After every event: each request is in exactly one state, holds the blocks that
state implies, no id holds blocks it should not, and the pool passes ``check_integrity``. At the
end every request is retired and every block is back.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.engine.request import Request, RequestStatus
from common.engine.scheduler import Scheduler
from common.kvcache.kv_cache_manager import KVCacheManager
from common.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 12  # small, so preemption and deferral happen


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.scheduler = Scheduler(self.kv, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64)
        self.num_ids = 0

    def _new(self, prompt_len: int, doc: int, max_tokens: int, kv_transfer: bool = False,
             outputs: list[int] | None = None) -> Request:
        self.num_ids += 1
        prompt = [doc * 100 + i for i in range(prompt_len)]  # shared prefixes between requests of a doc
        return Request(
            f"r{self.num_ids}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
            block_size=BLOCK_SIZE, model_id="m", kv_transfer=kv_transfer, output_token_ids=outputs,
        )

    def _in(self, status: RequestStatus) -> list[Request]:
        return sorted(self.scheduler.held(status), key=lambda r: r.request_id)

    @rule(prompt_len=st.integers(1, 14), doc=st.integers(0, 1), max_tokens=st.integers(1, 6),
          kv_transfer=st.booleans())
    def add(self, prompt_len: int, doc: int, max_tokens: int, kv_transfer: bool) -> None:
        self.scheduler.add(self._new(prompt_len, doc, max_tokens, kv_transfer))

    @rule(prompt_len=st.integers(1, 14), doc=st.integers(0, 1), max_tokens=st.integers(2, 6))
    def offer_remote(self, prompt_len: int, doc: int, max_tokens: int) -> None:
        req = self._new(prompt_len, doc, max_tokens, outputs=[7])
        used = self.kv.pool.num_used_blocks
        if not self.scheduler.add_remote(req, req.num_tokens - 1):
            assert self.kv.pool.num_used_blocks == used and req.request_id not in self.scheduler.requests

    @rule()
    def step(self) -> None:
        out = self.scheduler.schedule()
        completing = [s.request for s in out.scheduled if s.completes]
        self.scheduler.update_after_step(out)
        for req in completing:
            req.append_output_token(3)
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
            elif req.kv_transfer:
                self.scheduler.hold_for_transfer(req)

    @precondition(lambda self: self.scheduler.held(RequestStatus.WAITING_FOR_REMOTE_KV))
    @rule(data=st.data())
    def kv_arrives(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._in(RequestStatus.WAITING_FOR_REMOTE_KV)))
        self.scheduler.remote_kv_arrived(req.request_id, req.num_tokens - 1)
        assert req.status == RequestStatus.WAITING and req in self.scheduler.waiting

    @precondition(lambda self: any(
        self.scheduler.held(s) for s in (RequestStatus.HELD_FOR_TRANSFER, RequestStatus.WAITING_FOR_REMOTE_KV)
    ))
    @rule(data=st.data())
    def transfer_ends(self, data: st.DataObject) -> None:
        held = self._in(RequestStatus.HELD_FOR_TRANSFER) + self._in(RequestStatus.WAITING_FOR_REMOTE_KV)
        req = data.draw(st.sampled_from(held))
        assert self.scheduler.release(req.request_id) is req
        assert self.scheduler.release(req.request_id) is None  # one release call; a second does nothing
        assert req.request_id not in self.kv.req_blocks

    @precondition(lambda self: self.scheduler.waiting or self.scheduler.running)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        queued = sorted([*self.scheduler.waiting, *self.scheduler.running], key=lambda r: r.request_id)
        req = data.draw(st.sampled_from(queued))
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        assert req.request_id not in self.kv.req_blocks

    @rule(data=st.data())
    def release_of_a_queued_request_does_nothing(self, data: st.DataObject) -> None:
        if not (self.scheduler.waiting or self.scheduler.running):
            return
        req = data.draw(st.sampled_from([*self.scheduler.waiting, *self.scheduler.running]))
        assert self.scheduler.release(req.request_id) is None
        assert req.request_id in self.scheduler.requests

    @invariant()
    def every_request_in_exactly_one_state_with_the_blocks_it_implies(self) -> None:
        s = self.scheduler
        waiting, running = [r.request_id for r in s.waiting], [r.request_id for r in s.running]
        held = [r.request_id for r in s.held(RequestStatus.HELD_FOR_TRANSFER)]
        remote = [r.request_id for r in s.held(RequestStatus.WAITING_FOR_REMOTE_KV)]
        everyone = waiting + running + held + remote
        assert len(everyone) == len(set(everyone)) and set(everyone) == set(s.requests)
        for r in s.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        for r in s.running:
            assert r.status == RequestStatus.RUNNING
            assert len(self.kv.req_blocks[r.request_id]) >= self.kv.cdiv(r.num_computed_tokens)
        for rid in held:
            r = s.requests[rid]
            assert len(self.kv.req_blocks[rid]) >= self.kv.cdiv(r.num_computed_tokens) > 0
        for rid in remote:
            r = s.requests[rid]
            assert len(self.kv.req_blocks[rid]) == self.kv.cdiv(r.num_tokens - 1)
        # Blocks only for requests that exist here (a waiting one only after a chunk of it ran).
        assert set(self.kv.req_blocks) <= set(s.requests)
        self.kv.check_integrity()

    def teardown(self) -> None:
        s = self.scheduler
        for req in list(s.requests.values()):
            if s.release(req.request_id) is None:
                s.finish(req, RequestStatus.FINISHED_ABORTED)
        assert not s.requests and not self.kv.req_blocks
        assert self.kv.pool.num_used_blocks == 0
        self.kv.check_integrity()


LifecycleMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
test_request_lifecycle = LifecycleMachine.TestCase
