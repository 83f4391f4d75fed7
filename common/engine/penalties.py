"""Repetition, presence and frequency penalties over token ids kept on the device between steps.

A penalty reads every token a request has seen (the repetition penalty: prompt and output) or every
token it has output (presence and frequency). Turning those lists into tensors each step cost time in
proportion to all the tokens of every penalised request, on the host. ``TokenRows`` instead keeps
them in a device tensor, one row per request, written whole once when the request first shows up and
then only its new tail (a token per decode step, in one indexed write for the batch). Past its
tokens a row holds copies of its first token. A step then reads a ``[rows, longest]`` window of it,
and each penalty is a fixed handful of tensor operations whatever the batch holds.

A row is its request's for as long as the request keeps coming back; rows of requests that did not
come back in the current step are reused when rows run out (a request seen again later, after a
preemption say, is written whole again: its tokens are all in the request).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from common.engine.host_tensors import long_tensor, long_tensors
from common.engine.request import FINISHED, Request

# Steps between two releases of the rows of finished requests (``TokenRows.begin_step``).
RELEASE_EVERY = 64


class TokenRows:
    """One request's ``all_token_ids`` or ``output_token_ids`` (``source``) per row of a device tensor."""

    def __init__(self, source: Literal["all_token_ids", "output_token_ids"], device: torch.device | str = "cpu",
                 num_rows: int = 16, num_cols: int = 256) -> None:
        self.source = source
        self.ids = torch.zeros((num_rows, num_cols), dtype=torch.long, device=device)
        self._row_of: dict[int, int] = {}  # id(request) -> row
        self._holders: list[Request | None] = [None] * num_rows
        self._written = [0] * num_rows
        self._last_step = [-1] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._step = 0

    def begin_step(self) -> None:
        """Rows of requests not seen since this call may be reused. Every ``RELEASE_EVERY`` steps the
        rows of finished requests are given up: a row keeps its request (the id it is found by stays
        that request's), which would otherwise keep a finished one's token lists, up to a context's
        worth each, until another request needs its row."""
        self._step += 1
        if self._step % RELEASE_EVERY == 0:
            for row, holder in enumerate(self._holders):
                if holder is not None and holder.status >= FINISHED:
                    self._release(row, holder)

    def view(self, requests: list[Request]) -> tuple[Tensor, Tensor]:
        """``(ids, valid)``, both ``[len(requests), longest]``: row ``i`` holds request ``i``'s tokens, then
        (``valid`` false) copies of its first token, so that a write to every entry of a row writes
        only tokens it holds. Every request must hold at least one token."""
        ids, lens = self._rows(requests)
        return ids, torch.arange(ids.shape[1], device=ids.device) < lens.unsqueeze(1)

    def padded(self, requests: list[Request]) -> Tensor:
        """``view``'s ``ids`` alone: enough for the repetition penalty, whose write of a token's logit is
        the same however often the token appears."""
        return self._rows(requests)[0]

    def _rows(self, requests: list[Request]) -> tuple[Tensor, Tensor]:
        """The requests' rows, ``[len(requests), longest]``, and their lengths (on the device). A row is
        kept padded with its first token past its tokens, so reading it needs no mask."""
        rows: list[int] = []
        lens: list[int] = []
        fill_rows: list[int] = []  # rows taken now: first their whole width holds the first token
        fill_ids: list[int] = []
        long_writes: list[tuple[int, int, list[int]]] = []
        set_rows: list[int] = []
        set_cols: list[int] = []
        set_ids: list[int] = []
        source, row_of, holders, written, last_step, step = (
            self.source, self._row_of, self._holders, self._written, self._last_step, self._step
        )
        num_cols = self.ids.shape[1]
        for req in requests:
            tokens: list[int] = getattr(req, source)
            n = len(tokens)
            row = row_of.get(id(req))  # a held request's id is never another's: the row holds it
            if row is None:
                row = self._take_row(req)
                fill_rows.append(row)
                fill_ids.append(tokens[0])
            if n > num_cols:
                self._grow(len(holders), n)
                num_cols = self.ids.shape[1]
            old = written[row]  # a request's tokens only grow, so its row's first ``old`` hold
            if n == old + 1:  # a decode step's one new token
                set_rows.append(row)
                set_cols.append(old)
                set_ids.append(tokens[old])
                written[row] = n
            elif n > old:
                if n - old > 64:  # a new row, or one far behind: one write of its own
                    long_writes.append((row, old, tokens[old:n]))
                else:
                    set_rows += [row] * (n - old)
                    set_cols += range(old, n)
                    set_ids += tokens[old:n]
                written[row] = n
            last_step[row] = step
            rows.append(row)
            lens.append(n)
        dev = self.ids.device
        # Every index list goes up in one copy.
        fill_rows_t, fill_ids_t, set_rows_t, set_cols_t, set_ids_t, rows_t, lens_t = long_tensors(
            [fill_rows, fill_ids, set_rows, set_cols, set_ids, rows, lens], dev
        )
        # In this order: a taken row's padding, then the tokens over it (the store may have grown
        # since the rows were taken: the padding spans its width now).
        if fill_rows:
            self.ids[fill_rows_t] = fill_ids_t.unsqueeze(1)
        for row, start, tail in long_writes:
            self.ids[row, start : start + len(tail)] = long_tensor(tail, dev)
        if set_ids:
            self.ids[set_rows_t, set_cols_t] = set_ids_t
        return self.ids[:, : max(lens)].index_select(0, rows_t), lens_t

    def _release(self, row: int, holder: Request) -> None:
        del self._row_of[id(holder)]
        self._holders[row] = None
        self._free.append(row)

    def _take_row(self, req: Request) -> int:
        if not self._free:
            for row, holder in enumerate(self._holders):
                if holder is not None and self._last_step[row] != self._step:
                    self._release(row, holder)
        if not self._free:
            self._grow(2 * len(self._holders), 0)
        row = self._free.pop()
        self._row_of[id(req)] = row
        self._holders[row] = req
        self._written[row] = 0
        return row

    def _grow(self, num_rows: int, min_cols: int) -> None:
        old_rows, old_cols = self.ids.shape
        num_cols = old_cols
        while num_cols < min_cols:
            num_cols *= 2
        ids = torch.zeros((num_rows, num_cols), dtype=torch.long, device=self.ids.device)
        ids[:old_rows, :old_cols] = self.ids
        if num_cols > old_cols:  # each held row's padding goes on: its first token
            ids[:old_rows, old_cols:] = self.ids[:, :1]
        self.ids = ids
        extra = num_rows - old_rows
        self._free[:0] = range(num_rows - 1, old_rows - 1, -1)
        self._holders += [None] * extra
        self._written += [0] * extra
        self._last_step += [-1] * extra


def apply_repetition_penalty(x: Tensor, rows: Tensor, ids: Tensor, penalty: Tensor) -> None:
    """In place, as transformers: over rows ``rows`` of ``x`` and their tokens ``ids`` (``TokenRows.view``),
    divide a positive logit by the row's ``penalty`` and multiply a negative one. A token held twice is
    read twice and written twice, the same value."""
    r = rows.unsqueeze(1)
    seen = x[r, ids]
    p = penalty.unsqueeze(1)
    x[r, ids] = torch.where(seen > 0, seen / p, seen * p)


def apply_output_penalties(
    x: Tensor, rows: Tensor, ids: Tensor, valid: Tensor, frequency: Tensor, presence: Tensor
) -> None:
    """In place, OpenAI's: subtract ``frequency * count + presence`` from the logit of each token a row
    has output (``ids``, ``valid`` from ``TokenRows.view``), ``count`` its number of occurrences."""
    vocab = x.shape[-1]
    r = rows.unsqueeze(1)
    keys = r * vocab + ids
    # Counted among the valid entries only; a padding entry (a copy of its row's first token) looks up
    # that token's count, so it writes the very value the token's own entries write.
    ordered = torch.where(valid, keys, -1).flatten().sort().values
    counts = torch.searchsorted(ordered, keys, right=True) - torch.searchsorted(ordered, keys)
    x[r, ids] = x[r, ids] - (frequency.unsqueeze(1) * counts.float() + presence.unsqueeze(1))
