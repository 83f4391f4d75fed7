"""Repetition, presence and frequency penalties over token ids kept on the device between steps.

A penalty reads every token a request has seen (the repetition penalty: prompt and output) or every
token it has output (presence and frequency), and what it does to a token's logit depends only on
whether the token is there (repetition, presence) and how often (frequency). ``TokenRows`` keeps, in
device tensors with one row per request, each request's distinct tokens in the order they first came
(``ids``) and how many times each came (``counts``). The host keeps the same per row (token to column,
and the counts), so that a decode step's new token is one dictionary lookup on the host and, for the
batch, one indexed write of ids and counts on the device; a request's row is written whole once,
when it first shows up. Past a row's distinct tokens its ids hold copies of its first token and its
counts zeros, so that a step reads a ``[rows, widest]`` window of them without a mask.

Distinct tokens make each penalty a gather, a few operations and a scatter whatever the batch holds,
with no sort to count repeats; and, with the Triton backend (a GPU's), both penalties of a group of
rows one kernel (``pdserve_kernels.triton_penalties``).

A row is its request's for as long as the request keeps coming back; rows of requests that did not
come back in the current step are reused when rows run out (a request seen again later, after a
preemption say, is written whole again: its tokens are all in the request).
"""

from __future__ import annotations

import collections
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from common.engine.host_tensors import long_tensors
from common.engine.request import FINISHED, Request

# Steps between two releases of the rows of finished requests (``TokenRows.begin_step``).
RELEASE_EVERY = 64
# A new row of more tokens than this is counted by ``collections.Counter`` and written as one span.
SPAN_MIN = 64


class TokenRows:
    """The distinct tokens of each request's ``all_token_ids`` or ``output_token_ids`` (``source``), one
    row of device tensors per request: ``ids`` and their ``counts`` (both int64). Only a store of
    ``output_token_ids`` keeps counts on the device (``counted``): the repetition penalty reads none.

    ``ids`` and ``counts`` are the two planes of one tensor, so that a step's new entries of both are
    one indexed write; the index lists of several stores go up in one copy (``update_rows``)."""

    def __init__(self, source: Literal["all_token_ids", "output_token_ids"], device: torch.device | str = "cpu",
                 num_rows: int = 16, num_cols: int = 256) -> None:
        self.source = source
        self.counted = source == "output_token_ids"
        self._planes = 2 if self.counted else 1
        self._entries = torch.zeros((self._planes, num_rows, num_cols), dtype=torch.long, device=device)
        # Empty for a store of all_token_ids: the repetition penalty reads no count.
        self._no_counts = torch.zeros((0, 0), dtype=torch.long, device=device)
        self._row_of: dict[int, int] = {}  # id(request) -> row
        self._holders: list[Request | None] = [None] * num_rows
        self._written = [0] * num_rows  # tokens of the request's source counted into its row (-1: none, no padding)
        self._columns: list[dict[int, int]] = [{} for _ in range(num_rows)]  # per row: token -> column
        self._counts: list[list[int]] = [[] for _ in range(num_rows)]  # per row: occurrences per column
        self._last_step = [-1] * num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._step = 0

    @property
    def ids(self) -> Tensor:
        """``[rows, columns]``: each row's distinct tokens, then copies of its first token."""
        return self._entries[0]

    @property
    def counts(self) -> Tensor:
        """``[rows, columns]`` beside ``ids``: how many times each came (0 in the padding); empty for a
        store of all_token_ids."""
        return self._entries[1] if self.counted else self._no_counts

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
        """``(ids, counts)``, both ``[len(requests), widest]``: row ``i`` holds request ``i``'s distinct
        tokens and their counts, then copies of its first token with count 0 (``counted`` stores only)."""
        assert self.counted, "the counts of a store of all_token_ids are not kept on the device"
        rows, _, width = self.rows(requests)
        return self.ids[:, :width].index_select(0, rows), self.counts[:, :width].index_select(0, rows)

    def padded(self, requests: list[Request]) -> Tensor:
        """``view``'s ``ids`` alone: enough for the repetition penalty, whose write of a token's logit is
        the same however often the token appears."""
        rows, _, width = self.rows(requests)
        return self.ids[:, :width].index_select(0, rows)

    def rows(self, requests: list[Request]) -> tuple[Tensor, Tensor, int]:
        """Brings the requests' rows up to date. Returns their rows of ``ids`` and ``counts`` and their
        numbers of distinct tokens (int64, on the device), and the largest of those numbers. A request
        with no token yet has a row of zeros (token 0, count 0), padded with its first token once it has
        one."""
        return update_rows([(self, requests)])[0]

    def _collect(self, requests: list[Request]) -> _Update:
        """``rows``' host side: the requests' rows taken and counted, and the writes they need."""
        row_list: list[int] = []
        lens: list[int] = []
        fill_rows: list[int] = []  # rows taken now: first their whole width holds the first token
        fill_ids: list[int] = []
        spans: list[tuple[int, list[int], list[int]]] = []
        set_rows: list[int] = []
        set_cols: list[int] = []
        set_ids: list[int] = []
        set_counts: list[int] = []
        source, row_of, written, last_step, step = self.source, self._row_of, self._written, self._last_step, self._step
        for req in requests:
            tokens: list[int] = getattr(req, source)
            n = len(tokens)
            row = row_of.get(id(req))  # a held request's id is never another's: the row holds it
            if row is None:
                row = self._take_row(req)
            old = written[row]  # a request's tokens only grow, so its row counts its first ``old``
            if old < 0 or (not old and n):  # a row taken now (-1), or its first tokens: padding first
                fill_rows.append(row)
                fill_ids.append(tokens[0] if n else 0)
                old = 0
            columns, counts = self._columns[row], self._counts[row]
            if n == old + 1:  # a decode step's one new token
                token = tokens[old]
                col = _count(columns, counts, token)
                set_rows.append(row)
                set_cols.append(col)
                set_ids.append(token)
                set_counts.append(counts[col])
            elif not old and n > SPAN_MIN:  # a new row of many tokens (a prompt): counted in C, one write
                occurrences = collections.Counter(tokens)  # in the order they first came
                columns.update(zip(occurrences, range(len(occurrences)), strict=True))
                counts += occurrences.values()
                spans.append((row, list(occurrences), counts))
            elif n > old:
                changed: dict[int, int] = {}  # column -> token: each column written once, with its last count
                for token in tokens[old:n]:
                    changed[_count(columns, counts, token)] = token
                set_rows += [row] * len(changed)
                set_cols += changed
                set_ids += changed.values()
                set_counts += [counts[col] for col in changed]
            written[row] = n
            last_step[row] = step
            row_list.append(row)
            lens.append(len(counts))
        width = max(lens, default=0)
        if width > self.ids.shape[1]:
            self._grow(len(self._holders), width)
        # Each plane's entries: ids, then (a counted store) counts; a taken row's counts are zeros.
        planes = self._planes
        if planes == 2:
            fill_ids += [0] * len(fill_rows)
            set_rows += set_rows
            set_cols += set_cols
            set_ids += set_counts
        set_planes = [plane for plane in range(planes) for _ in range(len(set_cols) // planes)]
        return _Update([fill_rows, fill_ids, set_planes, set_rows, set_cols, set_ids, row_list, lens], spans, width)

    def _apply(self, update: _Update, tensors: list[Tensor]) -> tuple[Tensor, Tensor, int]:
        """``rows``' device side, from ``update``'s index lists, uploaded (``tensors``)."""
        fill_rows, fill_values, set_planes, set_rows, set_cols, set_values, rows, lens = tensors
        entries, planes = self._entries, self._planes
        # In this order: a taken row's padding, then its tokens over it.
        if fill_rows.numel():
            entries[:, fill_rows] = fill_values.view(planes, -1, 1)
        for row, ids, counts in update.spans:
            (span,) = long_tensors([[*ids, *(counts if planes == 2 else ())]], entries.device)
            entries[:, row, : len(ids)] = span.view(planes, -1)
        if set_values.numel():
            entries[set_planes, set_rows, set_cols] = set_values
        return rows, lens, update.width

    def _release(self, row: int, holder: Request) -> None:
        del self._row_of[id(holder)]
        self._holders[row] = None
        self._columns[row], self._counts[row] = {}, []
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
        self._written[row] = -1  # not even its padding written yet
        self._columns[row], self._counts[row] = {}, []
        return row

    def _grow(self, num_rows: int, min_cols: int) -> None:
        old_rows, old_cols = self.ids.shape
        num_cols = old_cols
        while num_cols < min_cols:
            num_cols *= 2
        entries = torch.zeros((self._planes, num_rows, num_cols), dtype=torch.long, device=self._entries.device)
        entries[:, :old_rows, :old_cols] = self._entries
        if num_cols > old_cols:  # each held row's padding goes on: its first token (its counts stay 0)
            entries[0, :old_rows, old_cols:] = self._entries[0, :, :1]
        self._entries = entries
        extra = num_rows - old_rows
        self._free[:0] = range(num_rows - 1, old_rows - 1, -1)
        self._holders += [None] * extra
        self._written += [0] * extra
        self._columns += [{} for _ in range(extra)]
        self._counts += [[] for _ in range(extra)]
        self._last_step += [-1] * extra


class _Update(NamedTuple):
    """A store's writes for one ``rows`` call: its index lists (``TokenRows._apply`` reads them in this
    order, uploaded), the new rows of many tokens written apart, and the widest row."""

    lists: list[list[int]]
    spans: list[tuple[int, list[int], list[int]]]
    width: int


def update_rows(updates: list[tuple[TokenRows, list[Request]]]) -> list[tuple[Tensor, Tensor, int]]:
    """``TokenRows.rows`` of each ``(store, requests)``, the stores on one device: every store's index
    lists go up in one copy, then each store's new entries are one indexed write (and a taken row's
    padding one more)."""
    if not updates:
        return []
    collected = [store._collect(requests) for store, requests in updates]
    tensors = long_tensors([values for update in collected for values in update.lists], updates[0][0].ids.device)
    results = []
    start = 0
    for (store, _), update in zip(updates, collected, strict=True):
        end = start + len(update.lists)
        results.append(store._apply(update, tensors[start:end]))
        start = end
    return results


def _count(columns: dict[int, int], counts: list[int], token: int) -> int:
    """One more occurrence of ``token`` in a row (``columns``: token to column; ``counts``: per column);
    returns its column, a new one at the end for a token not seen before."""
    col = columns.get(token)
    if col is None:
        col = columns[token] = len(counts)
        counts.append(1)
    else:
        counts[col] += 1
    return col


def apply_repetition_penalty(x: Tensor, rows: Tensor, ids: Tensor, penalty: Tensor) -> None:
    """In place, as transformers: over rows ``rows`` of ``x`` and their tokens ``ids`` (``TokenRows.padded``),
    divide a positive logit by the row's ``penalty`` and multiply a negative one. A token held twice (the
    padding) is read twice and written twice, the same value."""
    r = rows.unsqueeze(1)
    seen = x[r, ids]
    p = penalty.unsqueeze(1)
    x[r, ids] = torch.where(seen > 0, seen / p, seen * p)


def apply_output_penalties(
    x: Tensor, rows: Tensor, ids: Tensor, counts: Tensor, frequency: Tensor, presence: Tensor
) -> None:
    """In place, OpenAI's: subtract ``frequency * count + presence`` from the logit of each token a row
    has output (``ids`` and ``counts`` from ``TokenRows.view``), ``count`` its number of occurrences.

    Added, not written: a padding entry (a copy of its row's first token, count 0) adds a zero to the
    token's logit, which changes nothing whatever the order of the additions."""
    penalty = torch.where(counts > 0, frequency.unsqueeze(1) * counts + presence.unsqueeze(1), 0.0)
    x.index_put_((rows.unsqueeze(1), ids), penalty.neg_(), accumulate=True)
