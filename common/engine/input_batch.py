"""The runner's input state kept between steps: one row per request in a preallocated block table.

A request keeps its row from step to step, and the row is written only when its table changes: the
new tail when it grew a block, the whole row when it is new or its table was rewritten (the KV cache
manager hands out another list then, see ``KVCacheManager.block_ids_view``). Each step then costs a
few attribute reads per scheduled request and a fixed handful of tensor operations: positions,
context lengths, the slot mapping (gathered from the table) and the rows to sample; nothing walks
the blocks a request holds. Rows of requests that stopped running are reclaimed when rows run out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from common.engine.host_tensors import bool_tensor, int_tensor, long_tensor
from common.engine.request import Request, RequestStatus
from common.engine.scheduler import ScheduledRequest


@dataclass
class BatchInputs:
    """One step's inputs, on the CPU; ``sample_idx`` indexes the flattened tokens."""

    input_ids: Tensor  # [num_tokens] int64
    positions: Tensor  # [num_tokens] int64
    slot_mapping: Tensor  # [num_tokens] int64
    block_tables: Tensor  # [num_seqs, max_num_blocks] int32
    query_start_loc: Tensor  # [num_seqs + 1] int32
    context_lens: Tensor  # [num_seqs] int32
    max_query_len: int
    sample_idx: Tensor  # [num_completing] int64


class InputBatch:
    """Rows of a block table that outlive a step. ``prepare`` is the only mutator; it reads the scheduled
    requests and their block id lists and never changes them."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_table = torch.zeros((max(max_num_reqs, 1), max(max_num_blocks_per_req, 1)), dtype=torch.int32)
        num_rows = self.block_table.shape[0]
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._row_of: dict[str, int] = {}
        # Per row: its request, the block id list it was last written from, how many entries of it.
        self._requests: list[Request | None] = [None] * num_rows
        self._tables: list[list[int] | None] = [None] * num_rows
        self._num_written = [0] * num_rows

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> BatchInputs:
        """Tensors for one forward over ``scheduled`` (not empty); updates rows whose table changed."""
        rows: list[int] = []
        starts: list[int] = []
        num_new: list[int] = []
        completes: list[bool] = []
        input_ids: list[int] = []
        # Table entries to write, as (row, column, block id), gathered into one indexed write.
        set_rows: list[int] = []
        set_cols: list[int] = []
        set_ids: list[int] = []
        max_query_len = max_num_blocks = 0
        spec_rows: list[tuple[int, int]] = []  # (sequence, drafts) of the decodes with drafts
        row_of, tables, num_written, holders = self._row_of, self._tables, self._num_written, self._requests
        for s in scheduled:
            req = s.request
            row = row_of.get(req.request_id)
            if row is None or holders[row] is not req:
                row = self._take_row(req, scheduled)
            ids = s.block_ids
            num_ids = len(ids)
            if tables[row] is not ids:  # new, or rewritten: the whole row
                old = num_written[row]
                set_rows += [row] * max(num_ids, old)
                set_cols += range(max(num_ids, old))
                set_ids += ids
                set_ids += [0] * (old - num_ids)
                tables[row] = ids
                num_written[row] = num_ids
            elif num_ids > num_written[row]:  # grew: the new tail only
                old = num_written[row]
                set_rows += [row] * (num_ids - old)
                set_cols += range(old, num_ids)
                set_ids += ids[old:]
                num_written[row] = num_ids
            start = req.num_computed_tokens
            n = s.num_new_tokens
            rows.append(row)
            starts.append(start)
            num_new.append(n)
            if n == 1:
                input_ids.append(req.all_token_ids[start])
            elif s.spec_token_ids:  # a decode with drafts: the last token, then the drafts
                input_ids.append(req.all_token_ids[start])
                input_ids += s.spec_token_ids
                spec_rows.append((len(rows) - 1, len(s.spec_token_ids)))
            else:
                input_ids += req.all_token_ids[start : start + n]
            completes.append(s.completes)
            if n > max_query_len:
                max_query_len = n
            if num_ids > max_num_blocks:
                max_num_blocks = num_ids
        if max_num_blocks > self.block_table.shape[1]:
            self._grow(self.block_table.shape[0], max_num_blocks)
        if set_ids:
            self.block_table[long_tensor(set_rows), long_tensor(set_cols)] = int_tensor(set_ids)

        num_seqs = len(rows)
        start_t = long_tensor(starts)
        block_tables = self.block_table[long_tensor(rows), :max_num_blocks]
        bs = self.block_size
        if max_query_len == 1 and len(input_ids) == num_seqs:  # decode only: one token per sequence
            positions = start_t
            context_lens = start_t + 1
            query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
            sample_idx = torch.arange(num_seqs)
            slot_blocks = block_tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1)
        else:
            num_new_t = long_tensor(num_new)
            ends = num_new_t.cumsum(0)
            num_tokens = int(ends[-1])
            # Per token, repeated from its sequence's values (no gather over the tokens): a token's
            # position is its index in the step plus its sequence's start less where its chunk begins.
            positions = torch.arange(num_tokens).add_(
                (start_t - ends + num_new_t).repeat_interleave(num_new_t, output_size=num_tokens)
            )
            context_lens = start_t + num_new_t
            query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
            query_start_loc[1:] = ends
            sample_idx = ends - 1
            # Each token's block: its table row's start in the flattened tables plus its block there.
            width = block_tables.shape[1]
            table_index = torch.arange(0, num_seqs * width, width).repeat_interleave(num_new_t, output_size=num_tokens)
            table_index += torch.div(positions, bs, rounding_mode="floor")
            slot_blocks = block_tables.reshape(-1).index_select(0, table_index)
        if spec_rows:  # a decode with drafts samples at its last token and at each draft
            sample_idx = _with_drafts(sample_idx, completes, spec_rows)
        elif not all(completes):
            sample_idx = sample_idx[bool_tensor(completes)]
        return BatchInputs(
            input_ids=long_tensor(input_ids),
            positions=positions,
            slot_mapping=slot_blocks.long() * bs + positions % bs,
            block_tables=block_tables,
            query_start_loc=query_start_loc,
            context_lens=context_lens.int(),
            max_query_len=max_query_len,
            sample_idx=sample_idx,
        )

    def _take_row(self, req: Request, scheduled: Sequence[ScheduledRequest]) -> int:
        stale = self._row_of.pop(req.request_id, None)  # the id of an earlier request, reused
        if stale is not None:
            self._requests[stale] = None
            self._free_rows.append(stale)
        if not self._free_rows:
            self._reclaim({id(s.request) for s in scheduled})
        if not self._free_rows:
            self._grow(2 * self.block_table.shape[0], self.block_table.shape[1])
        row = self._free_rows.pop()
        self._row_of[req.request_id] = row
        self._requests[row] = req
        self._tables[row] = None  # written whole below
        return row

    def _reclaim(self, scheduled: set[int]) -> None:
        """Free the rows of requests that are not running and not in this step (``scheduled``: their
        ``id``s): finished, preempted (a recompute gets a new table) or handed to a transfer."""
        for request_id, row in list(self._row_of.items()):
            req = self._requests[row]
            if req is None or (req.status != RequestStatus.RUNNING and id(req) not in scheduled):
                del self._row_of[request_id]
                self._requests[row] = None
                self._free_rows.append(row)

    def _grow(self, num_rows: int, num_cols: int) -> None:
        old_rows, old_cols = self.block_table.shape
        table = torch.zeros((num_rows, max(num_cols, old_cols)), dtype=torch.int32)
        table[:old_rows, :old_cols] = self.block_table
        self.block_table = table
        extra = num_rows - old_rows
        self._free_rows[:0] = range(num_rows - 1, old_rows - 1, -1)
        self._requests += [None] * extra
        self._tables += [None] * extra
        self._num_written += [0] * extra


def _with_drafts(ends: Tensor, completes: list[bool], spec_rows: list[tuple[int, int]]) -> Tensor:
    """The tokens to sample at, in order: each completing sequence's last token (``ends``), and for a
    decode with ``k`` drafts its last ``1 + k`` tokens."""
    last: list[int] = ends.tolist()
    drafts = dict(spec_rows)
    index: list[int] = []
    for seq, (end, done) in enumerate(zip(last, completes, strict=True)):
        if done:
            k = drafts.get(seq, 0)
            index += range(end - k, end + 1)
    return long_tensor(index)
