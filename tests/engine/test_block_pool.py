"""The block pool and the KV cache manager keep their invariants under any sequence of operations.

Two hypothesis state machines drive them with random operations while keeping their own model of
who holds which block, the eviction order, which hash maps to which block and what each block
slot contains; every step is checked against the model and against ``check_integrity``.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.engine.request import Request
from common.kvcache.block_pool import CONTIGUITY_WINDOW, BlockPool, FreeBlockQueue, KVBlock
from common.kvcache.hashing import BlockHash, hash_block_tokens
from common.kvcache.host_tier import SAVE
from common.kvcache.kv_cache_manager import RELEASED, KVCacheManager
from common.sampling_params import SamplingParams

MACHINE_SETTINGS = settings(max_examples=50, stateful_step_count=40, deadline=None)


def _h(token: int) -> BlockHash:
    return hash_block_tokens(None, [token])


def _num_runs(ids: list[int]) -> int:
    """Runs of consecutive ids in ascending ``ids`` (``[3, 4, 7]``: two)."""
    return sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)


# --------------------------------------------------------------------------- BlockPool
class BlockPoolMachine(RuleBasedStateMachine):
    NUM_BLOCKS = 4  # small, so eviction happens often

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.held: list[KVBlock] = []  # one entry per hold
        self.free_order = list(range(self.NUM_BLOCKS))  # expected eviction order, next victim first
        self.block_hash: dict[int, BlockHash] = {}  # hash each block carries (duplicates included)
        self.cached: dict[BlockHash, int] = {}  # hash -> the block that finds it
        self.stored_since_drain: set[BlockHash] = set()
        self.removed_since_drain: set[BlockHash] = set()
        self.index: set[BlockHash] = set()  # a prefix index fed only by drain_events

    def _holders(self) -> Counter[int]:
        return Counter(b.block_id for b in self.held)

    def _evicted(self, block_id: int) -> None:
        old = self.block_hash.pop(block_id, None)
        if old is not None and self.cached.get(old) == block_id:
            del self.cached[old]
            self.removed_since_drain.add(old)
            assert self.pool.get_cached_block(old) is None, "an evicted hash is still findable"

    @rule(num=st.integers(1, 4))
    def allocate(self, num: int) -> None:
        if num > len(self.free_order):
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(num)
            return
        blocks = self.pool.get_new_blocks(num)
        ids = [b.block_id for b in blocks]
        window = self.free_order[: CONTIGUITY_WINDOW * num] if num > 1 else self.free_order[:1]
        assert set(ids) <= set(window), "a block from outside the least recently freed window"
        assert len(set(ids)) == num
        assert _num_runs(ids) <= _num_runs(sorted(self.free_order[:num])), "more runs than strict LRU"
        assert ids == sorted(ids), "one allocation's blocks come in ascending id order"
        self.free_order = [b for b in self.free_order if b not in ids]
        for b in blocks:
            assert b.ref_cnt == 1 and b.block_hash is None
            self._evicted(b.block_id)
        self.held.extend(blocks)

    @precondition(lambda self: self.free_order)
    @rule()
    def evict_through_reuse(self) -> None:
        """Another request takes every free block for a moment: all free cached hashes are evicted."""
        num = len(self.free_order)
        self.allocate(num)
        reused = self.held[-num:]
        del self.held[-num:]
        self.pool.free_blocks(reused)
        self.free_order = [b.block_id for b in reversed(reused)] + self.free_order

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        idx = data.draw(st.lists(st.integers(0, len(self.held) - 1), min_size=1, max_size=4, unique=True))
        blocks = [self.held[i] for i in idx]
        for i in sorted(idx, reverse=True):
            del self.held[i]
        counts = self._holders()
        counts.update(b.block_id for b in blocks)
        self.pool.free_blocks(blocks)
        for b in blocks:
            counts[b.block_id] -= 1
            if counts[b.block_id] == 0:
                if b.block_id in self.block_hash:
                    self.free_order.append(b.block_id)
                else:
                    self.free_order.insert(0, b.block_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), token=st.integers(0, 5))
    def cache_full_block(self, data: st.DataObject, token: int) -> None:
        block = data.draw(st.sampled_from(self.held))
        h = _h(token)
        self.pool.cache_full_block(block, h)
        if block.block_id not in self.block_hash:
            self.block_hash[block.block_id] = h
            if h not in self.cached:
                self.cached[h] = block.block_id
                self.stored_since_drain.add(h)

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def prefix_hit(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.cached)))
        block = self.pool.get_cached_block(h)
        assert block is not None and block.block_id == self.cached[h]
        self.pool.touch([block])
        if block.block_id in self.free_order:  # from anywhere in the queue, not only its ends
            self.free_order.remove(block.block_id)
        self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        distinct = list({b.block_id: b for b in self.held}.values())
        blocks = data.draw(st.lists(st.sampled_from(distinct), min_size=1, max_size=4, unique_by=id))
        self.pool.touch(blocks)
        self.held.extend(blocks)

    @rule()
    def reset_prefix_cache(self) -> None:
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.held)
        if ok:
            for block_id in list(self.block_hash):
                self._evicted(block_id)

    @rule()
    def drain_events(self) -> None:
        stored, removed = self.pool.drain_events()
        assert len(stored) == len(set(stored)) and len(removed) == len(set(removed)), "reported twice"
        assert set(stored) == self.stored_since_drain & set(self.cached)
        assert set(removed) == self.removed_since_drain - set(self.cached)
        self.index -= set(removed)
        self.index |= set(stored)
        assert self.index == set(self.cached), "the index fed by the events disagrees with the pool"
        assert self.pool.drain_events() == ([], []), "events are reported once"
        self.stored_since_drain.clear()
        self.removed_since_drain.clear()

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_integrity(dict(self._holders()))
        assert [b.block_id for b in self.pool.free_queue] == self.free_order
        assert {h: b.block_id for h, b in self.pool.cached.items()} == self.cached
        for h, block_id in self.cached.items():
            found = self.pool.get_cached_block(h)
            assert found is not None and found.block_id == block_id
        assert {b.block_id: b.block_hash for b in self.pool.blocks if b.block_hash is not None} == self.block_hash


TestBlockPoolStateMachine = BlockPoolMachine.TestCase
TestBlockPoolStateMachine.settings = settings(MACHINE_SETTINGS, max_examples=100)  # cheap steps


# --------------------------------------------------------------------------- KVCacheManager
BS = 4
DOCS = [[(d * 97 + i * 31) % 50 + 10 for i in range(24)] for d in range(3)]


class KVCacheManagerMachine(RuleBasedStateMachine):
    NUM_BLOCKS = 10
    WINDOW: int | None = None  # how far back a query reads keys (None: the whole context)
    HOST_BLOCKS = 0  # slots of the host tier (0: none)

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BS, sliding_window=self.WINDOW, num_host_blocks=self.HOST_BLOCKS)
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.num_ids = 0
        # What the runner would have written in each slot: the token whose KV it holds.
        self.slots: dict[int, list[int | None]] = {i: [None] * BS for i in range(self.NUM_BLOCKS)}
        self.host_slots: dict[int, list[int | None]] = {i: [None] * BS for i in range(self.HOST_BLOCKS)}
        self.hash_tokens: dict[BlockHash, tuple[int, ...]] = {}

    def _copy_host(self) -> None:
        """What the runner does with the host tier's copies: each in the order queued."""
        for direction, block_id, slot in self.kv.take_host_copies():
            if direction == SAVE:
                self.host_slots[slot] = list(self.slots[block_id])
            else:
                self.slots[block_id] = list(self.host_slots[slot])

    def _cached(self, block_hash: BlockHash) -> bool:
        host = self.kv.host
        return self.kv.pool.get_cached_block(block_hash) is not None or (host is not None and block_hash in host)

    def _snapshot(self) -> tuple:
        pool = self.kv.pool
        return (
            tuple(b.ref_cnt for b in pool.blocks),
            tuple(b.block_id for b in pool.free_queue),
            {k: list(v) for k, v in self.kv.req_blocks.items()},
        )

    def _note_hashes(self, req: Request) -> None:
        for i, h in enumerate(req.block_hashes):
            self.hash_tokens[h] = tuple(req.all_token_ids[i * BS : (i + 1) * BS])

    def _compute(self, req: Request, num_new: int) -> None:
        """What the runner and ``update_after_step`` do: the host tier's copies, copy-on-write, store K/V, cache
        full blocks."""
        self._copy_host()
        for src, dst in self.kv.take_pending_copies():
            self.slots[dst] = list(self.slots[src])
        ids = self.kv.block_ids(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            block = self.kv.pool.blocks[ids[pos // BS]]
            assert block.ref_cnt == 1, f"{req} writes into {block}, which another sequence reads"
            self.slots[block.block_id][pos % BS] = req.all_token_ids[pos]
        req.num_computed_tokens += num_new
        self.kv.cache_blocks(req)

    def _first_read(self, num_blocks: int) -> int:
        """The first block a query right after ``num_blocks`` full blocks reads (one block at least is)."""
        if self.WINDOW is None:
            return 0
        return max(0, min((num_blocks * BS - self.WINDOW + 1) // BS, num_blocks - 1))

    def _admit(self, req: Request, chunk: int) -> None:
        hits, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit == len(hits) * BS <= req.num_tokens - 1
        skipped = self._first_read(len(hits))
        assert hits[:skipped] == [RELEASED] * skipped, "blocks a query after the hit reads are not taken"
        assert [b.block_hash for b in hits[skipped:]] == req.block_hashes[skipped : len(hits)]
        # The longest hit: every block a query right after it reads is cached (with a window, the early ones
        # need not be).
        cached = [self._cached(h) for h in req.block_hashes[: (req.num_tokens - 1) // BS]]
        assert len(hits) == max(k for k in range(len(cached) + 1) if all(cached[self._first_read(k) : k])), "hit cut short"
        req.num_computed_tokens = num_hit
        num_new = min(chunk, req.num_tokens - num_hit)
        before = self._snapshot()
        if not self.kv.allocate_slots(req, num_new, hits):
            assert self._snapshot() == before, "a failed allocation changed the pool"
            req.num_computed_tokens = 0
            self.waiting.append(req)
            return
        self._compute(req, num_new)
        self.running.append(req)

    @rule(doc=st.integers(0, 2), length=st.integers(1, 20), tail=st.lists(st.integers(0, 3), max_size=6),
          chunk=st.integers(1, 12))
    def admit_new(self, doc: int, length: int, tail: list[int], chunk: int) -> None:
        self.num_ids += 1
        req = Request(f"r{self.num_ids}", DOCS[doc][:length] + tail, SamplingParams(), block_size=BS,
                      model_id="m")
        self._note_hashes(req)
        self._admit(req, chunk)

    @rule(doc=st.integers(0, 2), length=st.integers(1, 20), tail=st.lists(st.integers(0, 3), max_size=6))
    def admit_remote(self, doc: int, length: int, tail: list[int]) -> None:
        """A request whose KV another instance sends: what ``allocate_remote`` skips needs no sending, the
        sender writes the rest."""
        self.num_ids += 1
        req = Request(f"r{self.num_ids}", DOCS[doc][:length] + tail + [1], SamplingParams(), block_size=BS,
                      model_id="m")
        self._note_hashes(req)
        num_kv = req.num_tokens - 1
        hits, _ = self.kv.get_computed_blocks(req, num_kv // BS)
        before = self._snapshot()
        skip = self.kv.allocate_remote(req, num_kv, hits)
        if skip is None:
            assert self._snapshot() == before, "a failed allocation changed the pool"
            return
        assert req.num_computed_tokens == skip * BS and skip >= min(len(hits), num_kv // BS)
        self._copy_host()  # before the sender writes the blocks (``LLMEngine._copy_host_now``)
        ids = self.kv.block_ids(req.request_id)
        for pos in range(skip * BS, num_kv):
            self.slots[ids[pos // BS]][pos % BS] = req.all_token_ids[pos]
        req.num_computed_tokens = num_kv
        self.kv.mark_computed(req)
        self.running.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def readmit(self, data: st.DataObject, chunk: int) -> None:
        req = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        self._admit(req, chunk)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.running))
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def advance(self, data: st.DataObject, chunk: int) -> None:
        req = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens < r.num_tokens]))
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        before = self._snapshot()
        if not self.kv.allocate_slots(req, num_new):
            assert self._snapshot() == before, "a failed allocation changed the pool"
            return
        self._compute(req, num_new)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(data=st.data(), token=st.integers(0, 3))
    def sample(self, data: st.DataObject, token: int) -> None:
        req = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens == r.num_tokens]))
        req.append_output_token(token)
        self._note_hashes(req)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from([r for r in self.running if r.num_computed_tokens == r.num_tokens]))
        self.num_ids += 1
        child = parent.fork(f"{parent.request_id}#{self.num_ids}", seed_offset=1)
        self.kv.fork(parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.kv.free(req.request_id)
        before = self._snapshot()
        self.kv.free(req.request_id)
        assert self._snapshot() == before, "free is not idempotent"
        if preempt:
            req.num_computed_tokens = 0
            self.waiting.append(req)

    @invariant()
    def sound(self) -> None:
        self.kv.check_integrity()
        assert set(self.kv.req_blocks) == {r.request_id for r in self.running}
        for req in self.running:
            ids = self.kv.block_ids(req.request_id)
            released = self.kv.num_released(req.request_id)
            assert len(ids) == self.kv.cdiv(req.num_computed_tokens) and len(set(ids[released:])) == len(ids) - released
            # Every key the next query reads is in a block still held, holding its token.
            assert released * BS <= (0 if self.WINDOW is None else max(0, req.num_computed_tokens - self.WINDOW + 1))
            for pos in range(released * BS, req.num_computed_tokens):
                assert self.slots[ids[pos // BS]][pos % BS] == req.all_token_ids[pos], (
                    f"{req}: slot of token {pos} holds another token's KV"
                )
        for h, block in self.kv.pool.cached.items():
            assert tuple(self.slots[block.block_id]) == self.hash_tokens[h], f"{block} does not hold its hash"
        host = self.kv.host
        if host is not None:
            pending = {c.slot for c in self.kv.host_copies}
            for h, slot in host.entries():
                if slot not in pending:
                    assert tuple(self.host_slots[slot]) == self.hash_tokens[h], f"host slot {slot} does not hold its hash"

    def teardown(self) -> None:
        for req in self.running:
            self.kv.free(req.request_id)
        self.kv.check_integrity()
        assert self.kv.pool.num_free_blocks == self.NUM_BLOCKS


TestKVCacheManagerStateMachine = KVCacheManagerMachine.TestCase
TestKVCacheManagerStateMachine.settings = MACHINE_SETTINGS


class WindowedKVCacheManagerMachine(KVCacheManagerMachine):
    """The same operations on a model whose queries see ``WINDOW`` keys at most: each computed chunk releases the
    blocks no later query reads, and every key a next query reads must still be in a block the request holds."""

    WINDOW = 6  # not a multiple of the blocks

    def _compute(self, req: Request, num_new: int) -> None:
        first_query = req.num_computed_tokens
        super()._compute(req, num_new)
        before = self.kv.num_released(req.request_id)
        held = self.kv.pool.num_used_blocks
        self.kv.release_out_of_window(req, first_query)
        after = self.kv.num_released(req.request_id)
        expected = max(before, min((first_query - self.WINDOW + 1) // BS, self.kv.cdiv(req.num_computed_tokens) - 1,
                                   req.num_computed_tokens // BS))
        assert after == expected, f"{req}: {after} blocks released, {expected} out of the window"
        assert self.kv.pool.num_used_blocks <= held


TestWindowedKVCacheManagerStateMachine = WindowedKVCacheManagerMachine.TestCase
TestWindowedKVCacheManagerStateMachine.settings = MACHINE_SETTINGS


class HostTierKVCacheManagerMachine(KVCacheManagerMachine):
    """The same operations with a host tier of fewer slots than blocks: every cached block the pool takes back is
    saved there first (if there is room), hits go on into it, and every hash either tier finds holds its tokens
    once the queued copies ran in order."""

    HOST_BLOCKS = 3


TestHostTierKVCacheManagerStateMachine = HostTierKVCacheManagerMachine.TestCase
TestHostTierKVCacheManagerStateMachine.settings = MACHINE_SETTINGS


class WindowedHostTierKVCacheManagerMachine(WindowedKVCacheManagerMachine):
    HOST_BLOCKS = 4


TestWindowedHostTierKVCacheManagerStateMachine = WindowedHostTierKVCacheManagerMachine.TestCase
TestWindowedHostTierKVCacheManagerStateMachine.settings = MACHINE_SETTINGS


# --------------------------------------------------------------------------- plain unit tests
def test_eviction_takes_the_least_recently_freed_cached_block_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, _h(i))
    for i in (2, 0, 3, 1):
        pool.free_blocks([blocks[i]])
    assert [b.block_id for b in pool.get_new_blocks(1)] == [2]
    assert [b.block_id for b in pool.get_new_blocks(1)] == [0]
    assert pool.get_cached_block(_h(2)) is None and pool.get_cached_block(_h(0)) is None
    assert pool.get_cached_block(_h(3)) is blocks[3] and pool.get_cached_block(_h(1)) is blocks[1]


def test_strict_lru_pool_takes_exactly_the_least_recently_freed_blocks():
    pool = BlockPool(4, contiguity_window=1)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, _h(i))
    for i in (2, 0, 3, 1):
        pool.free_blocks([blocks[i]])
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 2]


def test_several_blocks_come_as_one_run_from_the_oldest_window_instead_of_scattered():
    pool = BlockPool(12)
    blocks = pool.get_new_blocks(12)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, _h(i))
    # Strict LRU would take 0, 4, 8, 1 (four runs); the 8 oldest hold the run 4..7 whole.
    for i in (0, 4, 8, 1, 5, 6, 7, 9, 2, 3, 10, 11):
        pool.free_blocks([blocks[i]])
    taken = [b.block_id for b in pool.get_new_blocks(4)]
    assert taken == [4, 5, 6, 7]
    assert all(pool.get_cached_block(_h(i)) is None for i in taken)
    # Everything else stays cached, in its eviction order.
    assert [b.block_id for b in pool.free_queue] == [0, 8, 1, 9, 2, 3, 10, 11]
    pool.check_integrity()


def _reference_runs_to_take(queue: list[KVBlock], num_blocks: int, contiguity_window: int) -> list[int]:
    """The allocation's choice written plainly, as it was first written: the window's blocks sorted by
    id, cut into runs, runs taken longest first (the one with the oldest block first among equals),
    a run longer than needed giving the stretch of least total place (the first such)."""
    window = list(enumerate(queue[: contiguity_window * num_blocks]))
    window.sort(key=lambda pb: pb[1].block_id)
    runs: list[list[tuple[int, KVBlock]]] = []
    for pb in window:
        if runs and runs[-1][-1][1].block_id + 1 == pb[1].block_id:
            runs[-1].append(pb)
        else:
            runs.append([pb])
    runs.sort(key=lambda run: (-len(run), min(place for place, _ in run)))
    out: list[int] = []
    for run in runs:
        need = num_blocks - len(out)
        if need <= 0:
            break
        if len(run) > need:
            sums = [0]
            for place, _ in run:
                sums.append(sums[-1] + place)
            best = min(range(len(run) - need + 1), key=lambda i: sums[i + need] - sums[i])
            run = run[best : best + need]
        out.extend(block.block_id for _, block in run)
    return sorted(out)


@settings(max_examples=300, deadline=None)
@given(
    order=st.permutations(list(range(24))).flatmap(
        lambda perm: st.tuples(st.just(perm), st.integers(1, 24), st.integers(2, 24), st.integers(2, 4))
    )
)
def test_an_allocation_takes_the_blocks_the_plain_rule_picks(order: tuple[list[int], int, int, int]) -> None:
    """Whatever the free queue's order, ``get_new_blocks`` takes exactly the blocks of the rule as first
    written (``_reference_runs_to_take``), and leaves the rest of the queue in its order."""
    perm, num_free, num_blocks, window = order
    num_blocks = min(num_blocks, num_free)
    pool = BlockPool(24, contiguity_window=window)
    blocks = pool.get_new_blocks(24)
    for i in perm[:num_free]:  # freed in this order: the queue holds them oldest first
        pool.cache_full_block(blocks[i], _h(i))
        pool.free_blocks([blocks[i]])
    queue = list(pool.free_queue)
    expected = (
        _reference_runs_to_take(queue, num_blocks, window) if num_blocks > 1 else [queue[0].block_id]
    )
    taken = [b.block_id for b in pool.get_new_blocks(num_blocks)]
    assert taken == expected
    assert [b.block_id for b in pool.free_queue] == [b.block_id for b in queue if b.block_id not in taken]
    pool.check_integrity()


def test_a_long_free_run_gives_its_oldest_stretch():
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(10)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, _h(i))
    for i in (9, 8, 7, 6, 5, 4, 3, 2, 1, 0):  # the run 0..9, newest first
        pool.free_blocks([blocks[i]])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [7, 8, 9]


def test_equally_old_stretches_of_a_run_give_the_first_by_id():
    pool = BlockPool(4, contiguity_window=2)
    blocks = pool.get_new_blocks(4)
    for i in (0, 2, 3, 1):  # queue places by id: 0, 3, 1, 2; stretches of 2 sum to 3, 4, 3
        pool.cache_full_block(blocks[i], _h(i))
        pool.free_blocks([blocks[i]])
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]


def test_a_requests_tail_block_is_evicted_before_its_head():
    kv = KVCacheManager(8, BS)
    req = Request("r", list(range(3 * BS + 1)), SamplingParams(), block_size=BS, model_id="m")
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    head, middle, tail, partial = kv.block_ids("r")
    kv.free("r")
    order = [b.block_id for b in kv.pool.free_queue]
    # The unhashed partial block goes first, then the request's full blocks from the tail back.
    assert order.index(partial) < order.index(tail) < order.index(middle) < order.index(head)
    assert order[-3:] == [tail, middle, head]


def test_blocks_freed_together_come_back_as_one_run_of_ids():
    kv = KVCacheManager(8, BS)
    first = Request("a", list(range(4 * BS)), SamplingParams(), block_size=BS, model_id="m")
    assert kv.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_blocks(first)
    other = Request("b", [7] * (4 * BS), SamplingParams(), block_size=BS, model_id="m")
    assert kv.allocate_slots(other, other.num_tokens)  # the pool's other four blocks
    kv.free("a")  # cached blocks join the queue tail first: 3, 2, 1, 0
    again = Request("c", list(range(100, 100 + 4 * BS)), SamplingParams(), block_size=BS, model_id="m")
    assert kv.allocate_slots(again, again.num_tokens)
    assert kv.block_ids("c") == [0, 1, 2, 3]  # what a KV transfer sends and receives as one run
    kv.free("b")
    kv.free("c")


def test_blocks_without_a_hash_are_reused_before_cached_ones():
    pool = BlockPool(3)
    cached, plain, other = pool.get_new_blocks(3)
    pool.cache_full_block(cached, _h(1))
    pool.free_blocks([cached])
    pool.free_blocks([plain])  # freed later, but holds nothing worth keeping
    (got,) = pool.get_new_blocks(1)
    assert got is plain
    assert pool.get_cached_block(_h(1)) is cached
    pool.free_blocks([other, got])
    assert [b.block_id for b in pool.free_queue][-1] == cached.block_id


def test_a_duplicate_hash_keeps_the_first_block_and_only_it_is_findable():
    pool = BlockPool(4)
    first, second, _ = pool.get_new_blocks(3)
    pool.cache_full_block(first, _h(7))
    pool.cache_full_block(second, _h(7))
    assert pool.get_cached_block(_h(7)) is first
    assert pool.drain_events() == ([_h(7)], [])
    pool.free_blocks([second, first])
    pool.get_new_blocks(1)  # the never-used block
    pool.get_new_blocks(1)  # then the duplicate
    assert pool.get_cached_block(_h(7)) is first
    assert pool.drain_events() == ([], [])


def test_a_hash_stored_and_evicted_between_drains_is_reported_only_as_removed():
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, _h(1))
    pool.free_blocks([block])
    pool.get_new_blocks(1)  # evicts it before anyone published it
    assert pool.drain_events() == ([], [_h(1)])


def test_prefix_hit_takes_a_block_out_of_the_middle_of_the_free_queue_in_constant_time():
    def time_middle_removals(num_blocks: int) -> float:
        blocks = [KVBlock(i) for i in range(num_blocks)]
        queue = FreeBlockQueue(blocks)
        middle = blocks[num_blocks // 2 - 500 : num_blocks // 2 + 500]
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for b in middle:
                queue.remove(b)
            best = min(best, time.perf_counter() - start)
            for b in middle:
                queue.append(b)
        assert queue.num_free_blocks == num_blocks
        return best

    small, large = time_middle_removals(2_000), time_middle_removals(200_000)
    # O(n) removal would be about 100x slower on the large queue.
    assert large < 10 * small + 1e-3, f"{large:.5f}s vs {small:.5f}s"

    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, _h(i))
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(_h(2))
    assert hit is not None
    pool.touch([hit])
    assert [b.block_id for b in pool.free_queue] == [0, 1, 3, 4]
    pool.check_integrity({2: 1})


def test_fork_then_divergent_write_copies_the_shared_partial_block_once():
    kv = KVCacheManager(8, BS)
    parent = Request("p", list(range(2 * BS + 2)), SamplingParams(), block_size=BS, model_id="m")
    assert kv.allocate_slots(parent, parent.num_tokens)
    parent.num_computed_tokens = parent.num_tokens
    kv.cache_blocks(parent)
    child = parent.fork("p#1", seed_offset=1)
    kv.fork(parent, child)
    assert kv.block_ids("p") == kv.block_ids("p#1")
    parent.append_output_token(100)
    child.append_output_token(200)
    assert kv.allocate_slots(parent, 1) and kv.allocate_slots(child, 1)
    copies = kv.take_pending_copies()
    p_ids, c_ids = kv.block_ids("p"), kv.block_ids("p#1")
    assert len(copies) == 1 and kv.num_cow_copies == 1
    assert p_ids[:2] == c_ids[:2], "full blocks stay shared"
    assert p_ids[2] != c_ids[2] and copies[0][0] in (p_ids[2], c_ids[2]) and copies[0][1] in (p_ids[2], c_ids[2])
    kv.check_integrity()
    kv.free("p")
    kv.free("p#1")
    assert kv.pool.num_free_blocks == 8


def test_engine_peak_kv_slot_use_counts_blocks_shared_by_n2_choices_once(engine_factory):
    from tests.engine.conftest import prompt_ids

    engine = engine_factory(block_size=16)
    prompt = list(prompt_ids()[12])
    assert len(prompt) > 8 * 16
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2))
    held, slots = engine.peak_kv_tokens_held, engine.peak_kv_slots_allocated
    # Both choices read the prompt's full blocks; they hold those slots once, not twice.
    assert 0.8 * slots < held <= slots, (held, slots)


def test_host_copies_run_in_order_whatever_batches_they_make():
    """``ModelRunner.copy_host`` batches the copies by direction, never writing one place twice in a batch: a
    block saved, its slot loaded elsewhere, then the slot saved over, and a slot saved to twice, each as in
    order. (An 8-bit cache, copied as bytes.)"""
    from types import SimpleNamespace

    import torch

    from common.engine.model_runner import ModelRunner
    from common.kvcache.host_tier import LOAD, HostCopy, copy_batches

    copies = [HostCopy(SAVE, 1, 0), HostCopy(LOAD, 2, 0), HostCopy(SAVE, 3, 0), HostCopy(SAVE, 4, 1),
              HostCopy(SAVE, 5, 1), HostCopy(LOAD, 6, 1), HostCopy(LOAD, 7, 0)]
    assert copy_batches(copies) == [(SAVE, [1], [0]), (LOAD, [2], [0]), (SAVE, [3, 4], [0, 1]), (SAVE, [5], [1]),
                                    (LOAD, [6, 7], [1, 0])]
    assert copy_batches(copies[3:], max_blocks=1) == [(SAVE, [4], [1]), (SAVE, [5], [1]), (LOAD, [6], [1]),
                                                      (LOAD, [7], [0])]
    for dtype in (torch.float32, torch.float8_e4m3fn):
        kv = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1, 1, 1).expand(2, 2, 8, 4, 1, 3).to(dtype)
        runner = SimpleNamespace(tp_leader=None, device=torch.device("cpu"), kv_cache=kv.clone(),
                                 host_cache=torch.zeros(2, 2, 2, 4, 1, 3, dtype=dtype))
        ModelRunner.copy_host(runner, copies)  # type: ignore[arg-type]
        held = [int(runner.kv_cache[0, 0, b, 0, 0, 0].float()) for b in range(8)]
        assert held == [0, 1, 1, 3, 4, 5, 5, 3], dtype
        assert torch.equal(runner.host_cache[0].float(), kv[:, :, 3].float())
        assert torch.equal(runner.host_cache[1].float(), kv[:, :, 5].float())


def test_prefix_events_nobody_drains_are_not_kept_for_ever(monkeypatch: pytest.MonkeyPatch) -> None:
    """An offline engine never drains its prefix events: past the bound they are dropped (the pool's stored and
    evicted hashes, the host tier's dropped ones). Once drained, every event until the next drain is kept."""
    import common.kvcache.block_pool as block_pool

    monkeypatch.setattr(block_pool, "UNDRAINED_EVENTS_MAX", 8)  # the pool's and the host tier's bound
    kv = KVCacheManager(4, BS, num_host_blocks=2)

    def churn(first: int, count: int) -> None:
        for i in range(first, first + count):
            req = Request(f"r{i}", [i] * BS + [0], SamplingParams(), block_size=BS, model_id="m")
            assert kv.allocate_slots(req, req.num_tokens)
            req.num_computed_tokens = req.num_tokens
            kv.cache_blocks(req)
            kv.free(req.request_id)
            kv.take_host_copies()

    churn(0, 40)
    assert kv.host is not None and kv.host.num_saved > 8
    assert len(kv.pool._stored) <= 8 and len(kv.pool._removed) <= 8 and len(kv.host._dropped) <= 8
    kv.drain_events()
    churn(40, 40)
    assert len(kv.host._dropped) > 8
    stored, removed = kv.drain_events()
    assert len(removed) > 8 and stored  # kept for the one who drains
    kv.check_integrity()
