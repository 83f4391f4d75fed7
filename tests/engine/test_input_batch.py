"""``InputBatch``: the persistent input state gives, step after step, exactly the tensors a fresh build
from the scheduler's output gives, while requests join, leave, grow blocks, get tables rewritten and
the rows run out."""

from __future__ import annotations

import random

import torch

from common.engine.input_batch import BatchInputs, InputBatch
from common.engine.request import Request, RequestStatus
from common.engine.scheduler import ScheduledRequest
from common.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _fresh(scheduled: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
    """The inputs built from scratch, one token at a time (what the runner did before ``InputBatch``)."""
    bs = BLOCK_SIZE
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    sample_idx: list[int] = []
    for s in scheduled:
        start = s.request.num_computed_tokens
        end = start + s.num_new_tokens
        input_ids += s.request.all_token_ids[start:end]
        positions += range(start, end)
        slots += [s.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
        query_start.append(query_start[-1] + s.num_new_tokens)
        context_lens.append(end)
        if s.completes:
            sample_idx.append(query_start[-1] - 1)
    return {
        "input_ids": torch.tensor(input_ids), "positions": torch.tensor(positions),
        "slot_mapping": torch.tensor(slots), "query_start_loc": torch.tensor(query_start, dtype=torch.int32),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32), "sample_idx": torch.tensor(sample_idx),
    }


def _check(got: BatchInputs, scheduled: list[ScheduledRequest]) -> None:
    want = _fresh(scheduled)
    for name, tensor in want.items():
        assert torch.equal(getattr(got, name).long(), tensor.long()), name
    assert got.max_query_len == max(s.num_new_tokens for s in scheduled)
    for row, s in enumerate(scheduled):
        ids = s.block_ids
        assert got.block_tables[row, : len(ids)].tolist() == ids
        assert got.block_tables.shape[1] == max(len(x.block_ids) for x in scheduled)


def test_inputs_equal_a_fresh_build_while_requests_join_grow_leave_and_get_tables_rewritten() -> None:
    rng = random.Random(0)
    batch = InputBatch(max_num_reqs=3, max_num_blocks_per_req=2, block_size=BLOCK_SIZE)  # both grow
    live: dict[str, tuple[Request, list[int]]] = {}
    next_block = 0
    num_added = 0
    num_rewrites = 0
    for _ in range(300):
        # Join: a prompt of 1..20 tokens, sometimes under an id used before.
        while len(live) < 8 and rng.random() < 0.5:
            rid = f"r{rng.randrange(num_added + 1)}" if rng.random() < 0.2 else f"r{num_added}"
            num_added += 1
            if rid in live:
                continue
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
            req = Request(rid, prompt, SamplingParams(), block_size=BLOCK_SIZE, model_id="m")
            req.status = RequestStatus.RUNNING
            live[rid] = (req, [])
        scheduled = []
        for rid, (req, ids) in list(live.items()):
            if rng.random() < 0.15:  # not scheduled this step (budget spent)
                continue
            left = req.num_tokens - req.num_computed_tokens
            num_new = left if left == 1 else rng.randint(1, left)  # a chunk or the whole rest
            while len(ids) * BLOCK_SIZE < req.num_computed_tokens + num_new:
                ids.append(next_block)  # grows in place
                next_block += 1
            if ids and rng.random() < 0.05:  # copy-on-write: the manager hands out another list
                ids = [*ids[:-1], next_block]
                next_block += 1
                live[rid] = (req, ids)
                num_rewrites += 1
            scheduled.append(ScheduledRequest.of(req, num_new, ids))
        if not scheduled:
            continue
        rng.shuffle(scheduled)
        _check(batch.prepare(scheduled), scheduled)
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.completes:
                s.request.append_output_token(rng.randrange(1000))
        # Leave: finished, or preempted (its next table is another list, from scratch).
        for rid, (req, _ids) in list(live.items()):
            if rng.random() < 0.08 or req.num_tokens > 60:
                req.status = RequestStatus.FINISHED_STOPPED
                del live[rid]
            elif rng.random() < 0.03:
                req.num_computed_tokens = 0
                live[rid] = (req, [])
    assert num_rewrites > 5 and num_added > 30
    assert batch.num_rows_in_use <= batch.block_table.shape[0]


def test_a_decode_step_writes_only_the_rows_that_grew_a_block() -> None:
    batch = InputBatch(max_num_reqs=4, max_num_blocks_per_req=8, block_size=BLOCK_SIZE)
    reqs = []
    tables = []
    for i in range(4):  # prompts of 1..4 tokens in one block each
        req = Request(f"r{i}", list(range(1, 2 + i)), SamplingParams(), block_size=BLOCK_SIZE, model_id="m")
        req.status = RequestStatus.RUNNING
        reqs.append(req)
        tables.append([10 * i])
    scheduled = [ScheduledRequest.of(r, r.num_tokens, t) for r, t in zip(reqs, tables, strict=True)]
    batch.prepare(scheduled)
    for r in reqs:
        r.num_computed_tokens = r.num_tokens
        r.append_output_token(7)
    tables[3].append(31)  # r3's next token (position 4) starts its second block
    before = batch.block_table.clone()
    got = batch.prepare([ScheduledRequest.of(r, 1, t) for r, t in zip(reqs, tables, strict=True)])
    changed = (batch.block_table != before).nonzero().tolist()
    assert changed == [[batch._row_of["r3"], 1]]
    assert got.slot_mapping.tolist() == [10 * i * BLOCK_SIZE + 1 + i for i in range(3)] + [31 * BLOCK_SIZE]
    assert got.positions.tolist() == [1, 2, 3, 4] and got.context_lens.tolist() == [2, 3, 4, 5]
