"""Token sampling for a whole batch at once: logit bias, allowed tokens, grammars, bad words,
penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

A step is a fixed handful of tensor operations over ``[rows, vocab]`` whatever the batch holds: the
per-row parameters travel as tensors, a row with neutral parameters passes through unchanged, and
Python loops only over rows that need something of their own (a seed, a ban, logprobs to build).
Which rows need what, and the index and parameter tensors that say it, are worked out once per batch
(``_BatchPlan``) and kept while the same requests come in the same order, as they do from one decode
step to the next. The tokens a penalty reads stay on the device from step to step
(``common.engine.penalties``), and every index or parameter list crosses to a tensor through
``common.engine.host_tensors``.

An all-greedy batch without penalties is one argmax over the logits in place; otherwise each row is
copied at most once, into the working tensor that ``logit_bias`` (one scatter-add, first of all),
``allowed_token_ids`` (one masked fill over their rows, its mask built once per batch), structured
output (one masked fill over the rows with a grammar, whose states each fill their row of a token
bitmask), bad words (one scatter of the tokens each row's output so far bans), penalties,
``min_tokens`` bans, temperature and top-k then modify in place. Greedy rows take the argmax of their
penalised logits. A row these bans may leave without any token (allowed tokens, bad words, a grammar
and ``min_tokens`` can contradict each other) is checked for one after them; one left with none
comes back as -2 and its request fails with ``NO_TOKEN_ERROR``, where an argmax or a draw over
nothing would give a token that means nothing. Only the sampled ids and the requested logprobs
cross to the host: one transfer each, or with the Triton kernels (a GPU's path) one transfer for all
(``StepOutputs``).

On the CPU the rows go through in chunks of about ``CPU_CHUNK_BYTES`` of logits: every temporary
then comes from the malloc heap, warm in the cache, where a whole-batch one (50 MB for 256 rows of
49,152 logits, above glibc's largest mmap threshold) would fault in fresh pages each time.

A seeded row draws its token by the exponential race over counter-based noise
(``common.engine.seeded_draws``): the same token for the same seed, output position and
probabilities, whatever shares the batch and wherever the request runs.
Unseeded rows share one batched draw from the sampler's own generator: one uniform per row,
inverted through the row's cumulative distribution (a pass over the row, where the race costs a
logarithm per entry). With the Triton backend (on a GPU) every sampled row races instead, in one
launch of the race's kernel, which derives each seeded row's key from its seed and position, and the
others' from random draw indices the host picks: one kernel where the inverse CDF, the seeded rows'
keys and the indexing between them were about 40 operations, each a launch the host pays for. There
top-k, top-p and min-p are one kernel too (``pdserve_kernels.triton_nucleus``), which finds each row's
k-th largest probability and its nucleus by searching for them instead of sorting the row: the same
entries stay, up to roundings at the cuts. Its probabilities are the whole row's, what top-k keeps
not normalised again: the race draws from them as they are, and top-p's mass is taken relative to
what top-k keeps. The repetition, presence and frequency penalties of a group of rows are one kernel
as well (``pdserve_kernels.triton_penalties``), which reads the penalty stores' rows in place, and so is
the logprob table (``pdserve_kernels.triton_logprobs``). With these kernels the greedy rows go with the
sampled ones, one group, and their argmax replaces their draw (``_ChunkPlan``).

Logprobs are those of the model's raw distribution (before logit bias, grammar, penalties and
temperature), as vLLM reports them by default.
"""

from __future__ import annotations

import functools
import math
import operator
import random
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from common.engine.grammar import apply_token_bitmask
from common.engine.host_tensors import (
    bool_tensor,
    float_tensor,
    int_tensor,
    long_tensor,
    long_tensors,
    to_host,
)
from common.engine.penalties import TokenRows, apply_output_penalties, apply_repetition_penalty, update_rows
from common.engine.request import Request
from common.engine.row_ops import argmax_rows, max_rows, topk_rows
from common.engine.seeded_draws import WHOLE_ROW_RACE_MIN_VOCAB, exponential_race, keys_at, seed_keys
from common.protocol import PositionLogprobs, TokenLogprob
from common.sampling_params import MAX_LOGPROBS
from pdserve_kernels import resolve_backend

NO_TOKEN_ERROR = (
    "no token may be sampled: allowed_token_ids, bad_words, the structured output and min_tokens together "
    "leave none"
)

CPU_CHUNK_BYTES = 8 << 20
# On the CPU top-p first sorts only this many of a row's largest probabilities, with their indices;
# a row whose nucleus may be larger goes on with its whole row's values (``apply_top_p``). A top-p 0.9
# nucleus of the default model is mostly a few tokens to a few hundred, now and then over a thousand
# at temperature 1.
TOP_P_WINDOW = 256


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class StepOutputs:
    """A step's sampled ids (int64), row maxima (float32) and logprob table (``table_dtype``
    ``[table_rows, table_width]``) as views of one device buffer, in that order, each at an offset its
    dtype aligns with: the operations that produce them write into the views (``out=``), and the three
    cross to the host in one copy into one pinned buffer (``to_host``), where three copies of their own
    each took a pinned allocation too. The sampler's path with the Triton kernels (a GPU's) uses it."""

    def __init__(self, num_rows: int, device: torch.device, table_rows: int = 0, table_width: int = 0,
                 table_dtype: torch.dtype = torch.float32) -> None:
        ids_end = 8 * num_rows
        max_end = ids_end + 4 * num_rows
        table_start = -(-max_end // 8) * 8  # a float64 table starts at a multiple of 8
        self._layout = (ids_end, max_end, table_start, table_rows, table_width, table_dtype)
        size = table_start + table_rows * table_width * table_dtype.itemsize
        self._raw = torch.empty(size, dtype=torch.uint8, device=device)
        self.ids, self.row_max, self.table = self._views(self._raw)

    def _views(self, raw: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        ids_end, max_end, table_start, table_rows, table_width, table_dtype = self._layout
        table = raw[table_start:].view(table_dtype).view(table_rows, table_width) if table_rows else None
        return raw[:ids_end].view(torch.int64), raw[ids_end:max_end].view(torch.float32), table

    def to_host(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The three, on the host (``host_tensors.to_host``: started without waiting), from one copy."""
        return self._views(to_host(self._raw))


class SampledTokens:
    """One step's sampled ids (and logprob table) where they were sampled, on their way to the host.

    ``token_ids`` stays on the device: async scheduling reads the next step's input ids from it there.
    On a GPU the copies to pinned host memory start at once, without waiting; ``result`` waits for them
    (the host's one sync per step) and builds the per-row lists. With ``outputs``, the ids, table and row
    maxima are its views, and cross in its one copy.
    """

    def __init__(
        self, token_ids: Tensor, table: Tensor | None = None,
        logprob_rows: list[tuple[int, int]] | None = None, k_max: int = 0, row_max: Tensor | None = None,
        outputs: StepOutputs | None = None, empty_rows: tuple[list[int], Tensor] | None = None,
    ) -> None:
        """``empty_rows``: the rows that may have been left without a token, and for each whether it was
        (``Sampler._check_left``); those come back as -2."""
        self.token_ids = token_ids
        self._logprob_rows = logprob_rows or []
        self._k_max = k_max
        self._event: torch.cuda.Event | None = None
        # Each row's largest raw logit goes to the host with the ids: a row whose maximum is NaN or +inf
        # comes back as -1 (``result``), while on the device it keeps a valid id, which a next step in
        # flight may read as an input it never samples from.
        self._ids: Tensor
        self._row_max: Tensor | None
        self._table: Tensor | None
        self._empty_rows = None if empty_rows is None else (empty_rows[0], to_host(empty_rows[1]))
        if outputs is not None:
            self._ids, self._row_max, self._table = outputs.to_host()
        else:
            self._ids = to_host(token_ids)
            self._table = None if table is None else to_host(table)
            self._row_max = None if row_max is None else to_host(row_max)
        if token_ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    @property
    def event(self) -> torch.cuda.Event | None:
        """On a GPU, the event recorded once the step's sampling (and so its forward, with its KV
        writes) was queued; None on the CPU."""
        return self._event

    def result(self) -> SampleResult:
        """The ids (-1 for a row whose raw logits held a NaN or +inf, -2 for one its bans left without a
        token) and the logprobs asked for."""
        if self._event is not None:
            self._event.synchronize()
        tokens: list[int] = self._ids.tolist()
        if self._row_max is not None:
            maxima: list[float] = self._row_max.tolist()
            if not all(map(math.isfinite, maxima)):
                tokens = [token if math.isfinite(m) else -1 for token, m in zip(tokens, maxima, strict=True)]
        if self._empty_rows is not None:
            rows, empty = self._empty_rows
            for row, none_left in zip(rows, empty.tolist(), strict=True):
                if none_left:  # its maximum, after the bans, was -inf: not the model's fault
                    tokens[row] = -2
        logprobs: list[PositionLogprobs | None] = [None] * len(tokens)
        if self._table is not None:
            k_max = self._k_max
            lines: list[list[float]] = self._table.tolist()
            for (row, k), line in zip(self._logprob_rows, lines, strict=True):
                top = [TokenLogprob(int(line[1 + k_max + j]), line[1 + j]) for j in range(k)]
                logprobs[row] = PositionLogprobs(tokens[row], line[0], top)
        return SampleResult(tokens, logprobs)


class _Race(NamedTuple):
    """Seeded rows of a group that draw together: their index in the group (None: every row), their
    requests, their seeds' keys, and whether the CPU should compute their noise for whole rows."""

    rows: Tensor | None
    requests: list[Request]
    seed_keys: Tensor
    whole_rows: bool


class _Group:
    """The greedy, or the sampled, rows of a chunk (with the Triton kernels, all of its rows, greedy
    among sampled: ``with_greedy``), and what their steps share while the chunk holds the same requests
    in the same order: row indices and parameter tensors, built once."""

    def __init__(
        self, rows: list[int], chunk: list[Request], draw: bool, eos_token_ids: set[int], vocab: int,
        device: torch.device, with_greedy: bool = False,
    ) -> None:
        self.index = _index(rows, len(chunk), device)
        reqs = self.requests = [chunk[r] for r in rows]
        params = [r.sampling_params for r in reqs]
        # Which rows take their argmax among rows that draw (their draw's result is then replaced).
        self.greedy_rows = bool_tensor([p.greedy for p in params], device) if with_greedy else None
        # min_tokens bans, for the rows that may need them (whether they still do is the step's to say).
        # A grammar decides alone when its output may end: banning its stop token could leave no token.
        self.bans = [
            (i, [*p.stop_token_ids, *([] if p.ignore_eos else eos_token_ids)])
            for i, (r, p) in enumerate(zip(reqs, params, strict=True)) if p.min_tokens > 0 and r.grammar is None
        ]
        # Rows whose bans may leave no token (``Sampler._check_left``): their rows here, and in the chunk.
        restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None or p.bad_words_token_ids]
        self.restricted = (long_tensor(restricted, device), [rows[i] for i in restricted]) if restricted else None
        rep = self.rep_list = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        self.rep_rows = long_tensor(rep, device) if rep else None  # None: no row has one
        self.rep_requests = [reqs[i] for i in rep]
        self.rep_penalty = float_tensor([params[i].repetition_penalty for i in rep], device)
        self.out_rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        self.out_all = self._output_penalties(self.out_rows, device)
        self.draw = draw
        self.vocab, self.device = vocab, device
        if not draw:
            return
        # A greedy row among them draws as if at temperature 1 with no thinning; its draw is not kept.
        temperatures = [1.0 if p.greedy else p.temperature for p in params]
        self.scale = float_tensor(temperatures, device).unsqueeze(1) if any(t != 1.0 for t in temperatures) else None
        self.top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab and not p.greedy]
        self.top_p = [i for i, p in enumerate(params) if p.top_p < 1.0 and not p.greedy]
        self.min_p = [i for i, p in enumerate(params) if p.min_p > 0.0 and not p.greedy]
        self.unseeded = [i for i, r in enumerate(reqs) if r.draw_seed is None]

    # The draws' index, parameter and key tensors are built on first use: the torch path's and the
    # Triton kernels' (``Sampler._race_all``, ``nucleus_params``) are each built only where they run.
    @functools.cached_property
    def top_k_rows(self) -> tuple[Tensor | None, int, Tensor]:
        """The rows with a top-k (``_index``), the largest k, and each row's k - 1, ``[rows, 1]``."""
        ks = [self.requests[i].sampling_params.top_k for i in self.top_k]
        return (_index(self.top_k, len(self.requests), self.device), max(ks, default=0),
                long_tensor([k - 1 for k in ks], self.device).unsqueeze(1))

    @functools.cached_property
    def top_p_rows(self) -> tuple[Tensor | None, Tensor]:
        """The rows with a top-p (``_index``) and their values, ``[rows, 1]``."""
        return (_index(self.top_p, len(self.requests), self.device),
                float_tensor([self.requests[i].sampling_params.top_p for i in self.top_p], self.device).unsqueeze(1))

    @functools.cached_property
    def min_p_rows(self) -> tuple[Tensor | None, Tensor]:
        """The rows with a min-p (``_index``) and their values, ``[rows, 1]``."""
        return (_index(self.min_p, len(self.requests), self.device),
                float_tensor([self.requests[i].sampling_params.min_p for i in self.min_p], self.device).unsqueeze(1))

    @functools.cached_property
    def races(self) -> list[_Race]:
        """The seeded rows' races (``exponential_race``). On the CPU, over a vocabulary's rows, the rows
        that no top-k, top-p or min-p thins out race apart, over their whole rows at once."""
        reqs, params, vocab, device = self.requests, [r.sampling_params for r in self.requests], self.vocab, self.device
        seeded = [i for i, r in enumerate(reqs) if r.draw_seed is not None]
        thins = [0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
        thinned = [i for i in seeded if thins[i]]
        whole = [i for i in seeded if not thins[i]]
        split = device.type == "cpu" and vocab >= WHOLE_ROW_RACE_MIN_VOCAB
        parts = [(whole, True), (thinned, False)] if split else [(seeded, not thinned)]
        return [_Race(_index(part, len(reqs), device), [reqs[i] for i in part],
                      seed_keys([reqs[i].draw_seed or 0 for i in part], device), whole_rows)
                for part, whole_rows in parts if part]

    @functools.cached_property
    def nucleus_params(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """Every row's top-p (1: none), min-p (0: none) and top-k (0: none; None where no row has one),
        for ``triton_nucleus.nucleus_filter``."""
        top_p, min_p, top_k = [1.0] * len(self.requests), [0.0] * len(self.requests), [0] * len(self.requests)
        for i in self.top_p:
            top_p[i] = self.requests[i].sampling_params.top_p
        for i in self.min_p:
            min_p[i] = self.requests[i].sampling_params.min_p
        for i in self.top_k:
            top_k[i] = self.requests[i].sampling_params.top_k
        return (float_tensor(top_p, self.device), float_tensor(min_p, self.device),
                int_tensor(top_k, self.device) if self.top_k else None)

    @functools.cached_property
    def penalty_programs(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """For ``triton_penalties.apply_penalties``: the rows with a penalty, and for each its place among
        the repetition penalty's rows and among the presence and frequency penalties' (-1: none; None
        where no row has that penalty)."""
        rep = {row: k for k, row in enumerate(self.rep_list)}
        out = {row: k for k, row in enumerate(self.out_rows)}
        rows = sorted(rep.keys() | out.keys())
        return (long_tensor(rows, self.device),
                int_tensor([rep.get(row, -1) for row in rows], self.device) if rep else None,
                int_tensor([out.get(row, -1) for row in rows], self.device) if out else None)

    @functools.cached_property
    def unseeded_index(self) -> Tensor | None:
        return _index(self.unseeded, len(self.requests), self.device)

    @functools.cached_property
    def race_seed_keys(self) -> Tensor:
        """For one race over every row (``Sampler._race_all``): each row's seed key (that of 0 for an
        unseeded row, whose draw index is a fresh random number each step)."""
        return seed_keys([r.draw_seed or 0 for r in self.requests], self.device)

    def _output_penalties(self, rows: list[int], device: torch.device) -> tuple[Tensor, list[Request], Tensor, Tensor]:
        params = [self.requests[i].sampling_params for i in rows]
        return (
            long_tensor(rows, device), [self.requests[i] for i in rows],
            float_tensor([p.frequency_penalty for p in params], device),
            float_tensor([p.presence_penalty for p in params], device),
        )

    def output_penalties(self, device: torch.device) -> tuple[Tensor, list[Request], Tensor, Tensor] | None:
        """The presence and frequency penalties' rows that have output a token by now."""
        if not self.out_rows:
            return None
        rows = [i for i in self.out_rows if self.requests[i].output_token_ids]
        if len(rows) == len(self.out_rows):
            return self.out_all
        return self._output_penalties(rows, device) if rows else None


class _ChunkPlan:
    """A chunk's rows, sorted out once for as long as the chunk holds the same requests. ``fused``: the
    Triton kernels sample (a GPU's path); then the greedy rows go with the sampled ones, one group, and
    take their argmax beside the draw. Splitting the rows into two groups launched more (a copy of each
    group's rows, the penalties' kernel and the stores' writes once per group, two writes back); the
    draw over the greedy rows costs the device about three passes over them (temperature, softmax,
    race: the nucleus kernel leaves a row without top-k, top-p or min-p at once)."""

    def __init__(
        self, requests: list[Request], eos_token_ids: set[int], vocab: int, device: torch.device, fused: bool
    ) -> None:
        self.lp_rows = [row for row, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        self.lp_index = _index(self.lp_rows, len(requests), device)
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for row, req in enumerate(requests):
            bias = req.sampling_params.logit_bias
            if bias:
                bias_rows += [row] * len(bias)
                bias_ids += bias.keys()
                bias_values += bias.values()
        self.bias = (
            (long_tensor(bias_rows, device), long_tensor(bias_ids, device), float_tensor(bias_values, device))
            if bias_rows else None
        )
        self.grammar_rows = [row for row, r in enumerate(requests) if r.grammar is not None]
        self.allowed = _allowed_mask(requests, vocab, device)
        self.bad_word_rows = [row for row, r in enumerate(requests) if r.sampling_params.bad_words_token_ids]
        greedy = [row for row, r in enumerate(requests) if r.sampling_params.greedy]
        sampled = [row for row, r in enumerate(requests) if not r.sampling_params.greedy]
        self.fused = fused
        if fused and greedy and sampled:
            self.groups = [_Group(list(range(len(requests))), requests, True, eos_token_ids, vocab, device, True)]
            return
        self.groups = [
            _Group(rows, requests, draw, eos_token_ids, vocab, device)
            for rows, draw in ((greedy, False), (sampled, True)) if rows
        ]


class _BatchPlan:
    """What the sampler makes of a batch's requests that lasts while the same requests come in the same
    order, step after step (a request's sampling parameters, and whether it has a grammar, are fixed
    from its first step): the decode steps of a steady batch skip the Python passes over every row
    and the building of every index and parameter tensor."""

    def __init__(
        self, requests: list[Request], eos_token_ids: set[int], vocab: int, device: torch.device, chunk: int,
        fused: bool = False,
    ) -> None:
        self.requests = list(requests)
        self.vocab, self.device, self.chunk, self.fused = vocab, device, chunk, fused
        self.plain = all(r.plain_greedy and r.grammar is None for r in requests)
        self.static_work = any(_has_static_work(r) for r in requests)
        self.min_tokens_requests = [r for r in requests if r.sampling_params.min_tokens > 0]
        self.penalty_requests = [
            r for r in requests if r.sampling_params.presence_penalty or r.sampling_params.frequency_penalty
        ]
        self.k_max = max((r.sampling_params.logprobs or 0 for r in requests), default=0)
        self.logprob_rows = [
            (row, int(r.sampling_params.logprobs or 0)) for row, r in enumerate(requests)
            if r.sampling_params.logprobs is not None
        ]
        self._eos_token_ids = eos_token_ids
        self._chunks: list[_ChunkPlan] | None = None

    @functools.cached_property
    def logprob_index(self) -> Tensor:
        """The rows that asked for logprobs, for ``triton_logprobs.logprob_table``."""
        return long_tensor([row for row, _ in self.logprob_rows], self.device)

    def fits(self, requests: list[Request], vocab: int, device: torch.device, chunk: int) -> bool:
        return (
            vocab == self.vocab and device == self.device and chunk == self.chunk
            and len(requests) == len(self.requests) and all(map(operator.is_, requests, self.requests))
        )

    def has_work(self) -> bool:
        """More than an argmax of the raw rows: a draw, logprobs, a penalty or a ban."""
        return (
            self.static_work
            or any(r.num_output_tokens < r.sampling_params.min_tokens for r in self.min_tokens_requests)
            or any(r.output_token_ids for r in self.penalty_requests)
        )

    def chunks(self) -> list[_ChunkPlan]:
        if self._chunks is None:
            self._chunks = [
                _ChunkPlan(self.requests[start : start + self.chunk], self._eos_token_ids, self.vocab, self.device,
                           self.fused)
                for start in range(0, len(self.requests), self.chunk)
            ]
        return self._chunks


def _has_static_work(req: Request) -> bool:
    p = req.sampling_params
    return (
        not p.greedy or p.logprobs is not None or p.repetition_penalty != 1.0
        or bool(p.logit_bias) or req.grammar is not None or p.allowed_token_ids is not None
        or bool(p.bad_words_token_ids)
    )


def _allowed_mask(requests: list[Request], vocab: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """The rows with ``allowed_token_ids`` and, for each, which tokens it may not sample (``True``)."""
    rows = [row for row, r in enumerate(requests) if r.sampling_params.allowed_token_ids is not None]
    if not rows:
        return None
    banned = torch.ones(len(rows), vocab, dtype=torch.bool)
    for i, row in enumerate(rows):
        allowed = [t for t in requests[row].sampling_params.allowed_token_ids or () if t < vocab]
        banned[i, torch.tensor(allowed, dtype=torch.long)] = False
    return long_tensor(rows, device), banned.to(device)


def bad_word_bans(req: Request) -> list[int]:
    """The tokens ``req``'s bad words ban next: each word's last token where the output so far ends
    with the rest of it (vLLM's rule: the output only, not the prompt)."""
    out = req.output_token_ids
    bans = []
    for word in req.sampling_params.bad_words_token_ids:
        k = len(word) - 1
        if k == 0 or (len(out) >= k and out[-k:] == word[:-1]):
            bans.append(word[-1])
    return bans


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0, kernel_backend: str | None = None) -> None:
        """``kernel_backend``: as the model runner's (``pdserve_kernels.resolve_backend``); with Triton (a
        GPU's path) the penalties, top-k / top-p / min-p, every row's draw and the logprob table are
        kernels (``pdserve_kernels.triton_penalties``, ``triton_nucleus``, ``triton_sampling``,
        ``triton_logprobs``), over one group of every row, and the step's outputs cross in one copy."""
        self.eos_token_ids = eos_token_ids
        self.seed = seed
        self.kernel_backend = kernel_backend
        self._race_kernels: dict[torch.device, bool] = {}  # per device: whether the race is the kernel
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self._host_random = random.Random(seed)  # the unseeded rows' draw indices with the race's kernel
        self._device_generators: dict[torch.device, torch.Generator] = {}
        # Token bitmask rows for grammars, reused step after step (xgrammar fills it on the CPU).
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        # The tokens penalties read, per request, kept where the logits are (``common.engine.penalties``).
        self._penalty_tokens: dict[tuple[torch.device, str], TokenRows] = {}
        self._plan: _BatchPlan | None = None  # the last batch's
        # This step's rows that may have no token left (in the batch), and whether each has none.
        self._empty_parts: list[tuple[list[int], Tensor]] = []
        self._chunk_start = 0  # where the chunk ``_sample_rows`` works on starts in the batch

    def __call__(self, logits: Tensor, requests: list[Request]) -> SampleResult:
        """Sample one token per row of ``logits`` ``[len(requests), vocab]`` and wait for them on the host."""
        return self.sample(logits, requests).result()

    def sample(self, logits: Tensor, requests: list[Request]) -> SampledTokens:
        """One token per row of ``logits`` ``[len(requests), vocab]``, left where the logits are (with
        the requested logprobs); ``logits`` is not mutated. Reads each request's parameters, grammar
        state and output so far: every token before this one must be known."""
        num_rows, vocab = len(requests), logits.shape[-1]
        if num_rows == 0:
            return SampledTokens(torch.empty(0, dtype=torch.long, device=logits.device))
        for token_rows in self._penalty_tokens.values():
            token_rows.begin_step()
        x = logits.float()
        chunk = num_rows
        if x.device.type == "cpu":
            chunk = max(1, CPU_CHUNK_BYTES // (4 * vocab))
        plan = self._plan
        if plan is None or not plan.fits(requests, vocab, x.device, chunk):
            plan = self._plan = _BatchPlan(requests, self.eos_token_ids, vocab, x.device, chunk,
                                           self._race_kernel(x.device))
        fused = plan.fused
        if plan.plain or not plan.has_work():  # all greedy, nothing else: one argmax
            if fused:  # into one buffer, one copy to the host
                outputs = StepOutputs(num_rows, x.device)
                max_rows(x, out=(outputs.row_max, outputs.ids))
                return SampledTokens(outputs.ids, outputs=outputs)
            row_max, token_ids = max_rows(x)
            return SampledTokens(token_ids, row_max=row_max)
        k_max = plan.k_max
        self._empty_parts = []
        if fused:  # every chunk's ids and maxima, then the table, written into one buffer
            outputs = StepOutputs(num_rows, x.device, len(plan.logprob_rows), 1 + 2 * k_max, _table_dtype(vocab))
            for start, chunk_plan in zip(range(0, num_rows, chunk), plan.chunks(), strict=True):
                end = start + chunk
                self._chunk_start = start
                self._sample_rows(x[start:end], requests[start:end], chunk_plan, x is not logits, k_max,
                                  (outputs.row_max[start:end], outputs.ids[start:end]))
            if outputs.table is not None:  # by topk and one kernel, from the logits as they came
                # Triton, imported only where it runs.
                from pdserve_kernels.triton_logprobs import logprob_table

                raw = logits if logits.stride(-1) == 1 else logits.contiguous()
                logprob_table(raw, plan.logprob_index, outputs.ids, k_max, outputs.table.dtype, out=outputs.table)
            return SampledTokens(outputs.ids, None, plan.logprob_rows, k_max, outputs=outputs,
                                 empty_rows=self._empty_rows())
        results = []
        for start, chunk_plan in zip(range(0, num_rows, chunk), plan.chunks(), strict=True):
            self._chunk_start = start
            results.append(self._sample_rows(x[start : start + chunk], requests[start : start + chunk], chunk_plan,
                                             x is not logits, k_max))
        token_ids = results[0][0] if len(results) == 1 else torch.cat([t for t, _, _ in results])
        row_max = results[0][2] if len(results) == 1 else torch.cat([m for _, _, m in results])
        tables = [table for _, table, _ in results if table is not None]
        # One transfer each (see ``_sample_rows`` for why the table's floats hold the ids exactly).
        table = (tables[0] if len(tables) == 1 else torch.cat(tables)) if tables else None
        return SampledTokens(token_ids, table, plan.logprob_rows, k_max, row_max, empty_rows=self._empty_rows())

    def _check_left(self, y: Tensor, group: _Group) -> None:
        """Note, for the group's rows whose bans may leave no token, whether they did (every logit
        -inf, after every ban): one reduction over those rows, read on the host with the ids."""
        if group.restricted is None:
            return
        index, chunk_rows = group.restricted
        # Every logit -inf: a NaN (broken logits, reported as such) is not one.
        none_left = torch.isneginf(y.index_select(0, index)).all(dim=-1)
        self._empty_parts.append(([self._chunk_start + row for row in chunk_rows], none_left))

    def _empty_rows(self) -> tuple[list[int], Tensor] | None:
        parts = self._empty_parts
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return [row for rows, _ in parts for row in rows], torch.cat([t for _, t in parts])

    def _sample_rows(
        self, logits: Tensor, requests: list[Request], plan: _ChunkPlan, owned: bool, k_max: int,
        out: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Token ids for ``requests`` from their float32 rows ``logits`` (written only if ``owned``); for
        the rows that asked for logprobs ``[token logprob, k_max top values, k_max top ids]``, in float32
        where every token id is below 2**24 (float32 holds each of them exactly, as it holds the
        logprobs), else in float64; and each row's largest raw logit (NaN if it holds one). With the
        Triton kernels (``plan.fused``) the maxima and ids go into ``out`` (``StepOutputs``' views), and
        no table: ``sample`` builds it."""
        # The raw rows' logprobs, before anything writes into them (with the Triton kernels, ``sample``
        # builds the table instead).
        raw = torch.log_softmax(_take(logits, plan.lp_index), dim=-1) if plan.lp_rows and not plan.fused else None
        constrained = self._constrained(logits, requests, plan, owned)
        owned, logits = owned or constrained is not logits, constrained
        if plan.fused:
            assert out is not None
            self._sample_group(logits, plan.groups[0], owned, out)
            row_max, token_ids = out
        else:
            # A NaN or +inf logit anywhere in a row: the model's output for it is broken (one operation over
            # the raw rows, before anything writes into them; the host reads it with the ids).
            row_max = logits.amax(dim=-1)
            token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
            for group in plan.groups:
                x = _take(logits, group.index)  # each row is copied at most once: here, or for a penalty
                x_owned = owned or x is not logits
                y = self._penalized(x, group, x_owned)
                self._check_left(y, group)
                ids = self._draw(y, group, owned=x_owned or y is not x) if group.draw else argmax_rows(y)
                _put(token_ids, group.index, ids)
        if raw is None:
            return token_ids, None, row_max
        parts = [raw.gather(1, _take(token_ids.unsqueeze(1), plan.lp_index))]
        if k_max:
            parts += list(topk_rows(raw, k_max))
        dtype = _table_dtype(logits.shape[-1])
        return token_ids, torch.cat([p.to(dtype) for p in parts], dim=1), row_max

    def _sample_group(self, logits: Tensor, group: _Group, owned: bool, out: tuple[Tensor, Tensor]) -> None:
        """``_sample_rows``' row maxima and ids with the Triton kernels, whose chunk is one group of every
        row (``_ChunkPlan``), written into ``out``. The maxima are taken over the penalised rows, with
        the greedy rows' argmax where there are some (one operation): a penalty keeps a finite logit
        finite, and a NaN or +inf one as it is."""
        row_max, ids = out
        y = self._penalized(logits, group, owned)
        self._check_left(y, group)
        owned = owned or y is not logits
        if not group.draw:
            max_rows(y, out=out)
        elif group.greedy_rows is None:
            torch.amax(y, dim=-1, out=row_max)
            self._draw(y, group, owned, out=ids)
        else:
            _, argmax = max_rows(y, out=(row_max, torch.empty_like(ids)))  # before the draw writes into ``y``
            torch.where(group.greedy_rows, argmax, self._draw(y, group, owned), out=ids)

    def _constrained(self, logits: Tensor, requests: list[Request], plan: _ChunkPlan, owned: bool) -> Tensor:
        """``logits`` plus every row's ``logit_bias`` (one scatter-add), then with every token outside
        its ``allowed_token_ids``, every token its grammar does not allow next (one masked fill over
        each's rows) and every token its bad words ban next at -inf; written in place if ``owned``,
        else a copy when any applies."""
        grammar_rows = plan.grammar_rows
        if plan.bias is None and not grammar_rows and plan.allowed is None and not plan.bad_word_rows:
            return logits
        x = logits if owned else logits.clone()
        if plan.bias is not None:
            bias_rows, bias_ids, bias_values = plan.bias
            x.index_put_((bias_rows, bias_ids), bias_values.to(x.dtype), accumulate=True)
        if plan.allowed is not None:
            allowed_rows, banned = plan.allowed
            x.index_copy_(0, allowed_rows, x.index_select(0, allowed_rows).masked_fill_(banned, float("-inf")))
        if plan.bad_word_rows:  # one scatter of what each row's output so far bans
            ban_rows: list[int] = []
            ban_ids: list[int] = []
            for row in plan.bad_word_rows:
                bans = bad_word_bans(requests[row])
                ban_rows += [row] * len(bans)
                ban_ids += bans
            if ban_ids:
                x.index_put_(tuple(long_tensors([ban_rows, ban_ids], x.device)), x.new_full((), float("-inf")))
        if grammar_rows:
            words = -(-x.shape[-1] // 32)
            if self._bitmask.shape[0] < len(requests) or self._bitmask.shape[1] != words:
                self._bitmask = torch.empty(max(len(requests), 2 * self._bitmask.shape[0]), words, dtype=torch.int32)
            bitmask = self._bitmask[: len(requests)]
            for row in grammar_rows:  # the one per-row step: the grammar's own bitmask row
                grammar = requests[row].grammar
                assert grammar is not None
                grammar.fill_bitmask(bitmask, row)
            apply_token_bitmask(x, bitmask, grammar_rows)
        return x

    def _penalized(self, logits: Tensor, group: _Group, owned: bool) -> Tensor:
        """``logits`` with min_tokens bans and penalties; written in place if ``owned``, else a copy
        when any applies."""
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for row, banned in group.bans:
            req = group.requests[row]
            if req.num_output_tokens < req.sampling_params.min_tokens:
                ban_rows += [row] * len(banned)
                ban_ids += banned
        requests = group.requests
        has_output = any(requests[i].output_token_ids for i in group.out_rows)  # a presence or frequency penalty
        if not (ban_ids or group.rep_rows is not None or has_output):
            return logits
        x = logits if owned else logits.clone()
        dev = x.device
        if ban_ids:
            # The value as a tensor where ``x`` is: a Python float would go up from the host, a blocking copy.
            x.index_put_(tuple(long_tensors([ban_rows, ban_ids], dev)), x.new_full((), float("-inf")))
        if self._race_kernel(dev):  # Triton: both penalties of every row in one kernel
            if group.rep_rows is not None or group.out_rows:
                self._penalties_kernel(x, group)
            return x
        output_penalties = group.output_penalties(dev) if has_output else None
        if group.rep_rows is not None:
            ids = self._token_rows(dev, "all_token_ids").padded(group.rep_requests)
            apply_repetition_penalty(x, group.rep_rows, ids, group.rep_penalty)
        if output_penalties is not None:
            rows, reqs, frequency, presence = output_penalties
            ids, counts = self._token_rows(dev, "output_token_ids").view(reqs)
            apply_output_penalties(x, rows, ids, counts, frequency, presence)
        return x

    def _penalties_kernel(self, x: Tensor, group: _Group) -> None:
        """``_penalized``'s penalties with the Triton backend: one launch for the group's rows, over every
        row with a presence or frequency penalty (one that has output nothing yet reads no token)."""
        from pdserve_kernels.triton_penalties import apply_penalties  # Triton, imported only where it runs

        rows, rep_k, out_k = group.penalty_programs
        all_tokens = self._token_rows(x.device, "all_token_ids")
        output_tokens = self._token_rows(x.device, "output_token_ids")
        updates = [(all_tokens, group.rep_requests)] if rep_k is not None else []
        if out_k is not None:
            updates.append((output_tokens, group.out_all[1]))
        updated = iter(update_rows(updates))  # both stores' index lists in one copy
        rep = out = None
        if rep_k is not None:
            slots, lens, _ = next(updated)
            rep = (rep_k, all_tokens.ids, slots, lens, group.rep_penalty)
        if out_k is not None:
            slots, lens, _ = next(updated)
            _, _, frequency, presence = group.out_all
            out = (out_k, output_tokens.ids, output_tokens.counts, slots, lens, frequency, presence)
        apply_penalties(x, rows, rep, out)

    def _token_rows(self, device: torch.device, source: Literal["all_token_ids", "output_token_ids"]) -> TokenRows:
        """The sampler's store of every request's ``source`` tokens on ``device``."""
        key = (device, source)
        rows = self._penalty_tokens.get(key)
        if rows is None:
            rows = self._penalty_tokens[key] = TokenRows(source, device)
            rows.begin_step()
        return rows

    def _draw(self, logits: Tensor, group: _Group, owned: bool, out: Tensor | None = None) -> Tensor:
        """One draw per row, every row sampled (the exponential race for a seeded row, the inverse CDF
        for the others); writes into ``logits`` only if ``owned``, and the ids into ``out`` if given."""
        num_rows = logits.shape[0]
        dev = logits.device
        if group.scale is not None:
            logits = logits.div_(group.scale) if owned else logits / group.scale
            owned = True
        if self._race_kernel(dev):  # top-k, top-p and min-p in one kernel, then every row's race in another
            probs = torch.softmax(logits, dim=-1)
            if group.top_k or group.top_p or group.min_p:  # Triton, imported only where it runs
                from pdserve_kernels.triton_nucleus import nucleus_filter

                nucleus_filter(probs, *group.nucleus_params)
            return self._race_all(probs, group, out)
        if group.top_k:
            index, k_max, positions = group.top_k_rows
            kth = topk_rows(_take(logits, index), k_max)[0].gather(1, positions)
            if index is not None:  # rows without top-k compare against -inf: nothing masked
                kth = logits.new_full((num_rows, 1), float("-inf")).index_copy_(0, index, kth)
            below = logits < kth
            logits = logits.masked_fill_(below, float("-inf")) if owned else logits.masked_fill(below, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if group.top_p:
            index, top_p = group.top_p_rows
            sub = _take(probs, index)
            apply_top_p(sub, top_p, TOP_P_WINDOW)
            _put(probs, index, sub)
        if group.min_p:
            index, min_p = group.min_p_rows
            sub = _take(probs, index)
            sub.masked_fill_(sub < min_p * sub.amax(dim=-1, keepdim=True), 0.0)
            _put(probs, index, sub)
        token_ids = torch.empty(num_rows, dtype=torch.long, device=dev)
        for race in group.races:
            positions = long_tensor([len(r.output_token_ids) for r in race.requests], dev)
            keys = keys_at(race.seed_keys, positions)
            # ``exponential_race`` writes into its rows: their own copy, or ``probs`` itself when every row is
            # in this race (then no other row reads it after).
            ids = exponential_race(_take(probs, race.rows), keys, race.whole_rows)
            _put(token_ids, race.rows, ids)
        if group.unseeded:
            _put(token_ids, group.unseeded_index,
                 _inverse_cdf(_take(probs, group.unseeded_index), self._generator(dev)))
        return token_ids if out is None else out.copy_(token_ids)

    def _race_all(self, probs: Tensor, group: _Group, out: Tensor | None = None) -> Tensor:
        """Every row's draw in one launch of the race's kernel (``triton_sampling.seeded_race``), with its
        draw's key derived in the kernel (``keys_at`` of a seed key and a draw index): a seeded row's from
        its seed and position; an unseeded row's from seed 0 and an index of 62 random bits, drawn on
        the host once a step for the group (its rows take consecutive ones: splitmix64's keys of
        consecutive indices are its stream, independent for the race). The exponential race samples a
        row's distribution exactly whatever its key, as the inverse CDF does on the CPU; here it is one
        kernel, where the inverse CDF, the seeded rows' keys and the indexing between them were about 40
        operations, each a launch, and the unseeded keys need no generator on the device."""
        from pdserve_kernels.triton_sampling import seeded_race  # Triton, imported only where it runs

        base = self._host_random.getrandbits(62)
        positions = long_tensor([base + i if r.draw_seed is None else len(r.output_token_ids)
                                 for i, r in enumerate(group.requests)], probs.device)
        return seeded_race(probs, group.race_seed_keys, positions=positions, out=out)

    def warm_up(self, device: torch.device, vocab: int) -> None:
        """Compile now what draws would compile (the race's kernel, where it runs: whole rows, and rows in
        ranges with the kernel that picks among them; the top-k / top-p / min-p kernel; the penalties'),
        so that a kernel that cannot build stops the engine at start, not a request in the middle of
        serving."""
        if self._race_kernel(device):
            from pdserve_kernels.triton_nucleus import nucleus_filter
            from pdserve_kernels.triton_sampling import seeded_race

            keys, positions = seed_keys([0], device), long_tensor([0], device)
            for num_splits in (1, None):  # a single row is cut into ranges by default
                seeded_race(torch.zeros(1, vocab, device=device), keys, num_splits, positions=positions)
            for top_k in (None, int_tensor([1], device)):  # each variant the kernel compiles to
                nucleus_filter(torch.full((1, vocab), 1 / vocab, device=device), float_tensor([0.5], device),
                               float_tensor([0.1], device), top_k)
            from pdserve_kernels.triton_penalties import apply_penalties

            zero, one = long_tensor([0], device), float_tensor([1.0], device)
            k, store = int_tensor([0], device), torch.zeros((1, 1), dtype=torch.long, device=device)
            rep, out = (k, store, zero, zero, one), (k, store, store, zero, zero, one, one)
            for penalties in ((rep, None), (None, out), (rep, out)):  # each variant the kernel compiles to
                apply_penalties(torch.zeros(1, vocab, device=device), zero, *penalties)
            from pdserve_kernels.triton_logprobs import logprob_table

            for alternatives in (0, MAX_LOGPROBS):  # each variant the kernel compiles to (up to 16, and more)
                logprob_table(torch.zeros(1, vocab, device=device), zero, zero, alternatives, _table_dtype(vocab))

    def _race_kernel(self, device: torch.device) -> bool:
        fused = self._race_kernels.get(device)
        if fused is None:
            fused = self._race_kernels[device] = resolve_backend(device, self.kernel_backend) == "triton"
        return fused

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device=device)
            self._device_generators[device].manual_seed(self.seed)
        return self._device_generators[device]


def apply_top_p(probs: Tensor, top_p: Tensor, window: int) -> None:
    """In place, zero all but each row's smallest set of most likely tokens whose mass reaches its
    ``top_p`` (``[rows, 1]``); the most likely token always stays. Where tokens tie at the cutoff, which
    of them stay is unspecified (as the order of ties in a sort is).

    A row keeps the prefix of its entries in descending order whose mass before each is under ``top_p``.
    Only the ``window`` largest entries of a row are sorted when the last of them is dropped (then every
    entry past them is too, exactly as a full sort would find: the mass before an entry, as rounded,
    only grows along the row); other rows go on through ``_top_p_by_values``. Deciding which rows
    those are reads the data, which costs nothing on the CPU and would be a sync on a GPU, where
    sorting is cheap: there each row is sorted whole, whatever ``window``.
    """
    vocab = probs.shape[-1]
    window = min(window, vocab) if probs.device.type == "cpu" else vocab
    values, order = topk_rows(probs, window) if window < vocab else probs.sort(dim=-1, descending=True)
    cum = values.cumsum(dim=-1)
    drop = cum - values >= top_p
    short: list[int] = (~drop[:, -1]).nonzero().flatten().tolist() if window < vocab else []
    if short:  # the window's last entry stays: the nucleus may hold more
        full = probs[short]
        _top_p_by_values(full, top_p[short], 16 * window)
    values.masked_fill_(drop, 0.0)
    probs.zero_().scatter_(1, order, values)
    if short:
        probs[short] = full


def _top_p_by_values(probs: Tensor, top_p: Tensor, window: int) -> None:
    """``apply_top_p`` on the CPU for rows of large nuclei: the same tokens stay as after a full sort.

    The rows' values alone are sorted, by numpy: vectorised, a few ns per entry, where the CPU's
    ``sort`` and ``topk`` with indices take 20 to 40 (a 49,152-entry row: about 0.2 ms against 2 to 4.5;
    numpy's ``partition`` would slow tenfold over the many equal zeros that top-k or min-p leave). The
    mass is summed over each row's ``window`` largest, then 16 times as many while the last of them
    stays. The last value kept is a threshold: every entry above it stays, and of the entries equal
    to it as many as the prefix holds.
    """
    vocab = probs.shape[1]
    ascending = np.sort(probs.detach().numpy(), axis=1)
    last = probs.new_empty((len(probs), 1))
    count = torch.empty((len(probs), 1), dtype=torch.long)
    ties = torch.empty(len(probs), dtype=torch.bool)
    rows = torch.arange(len(probs))  # the rows to cut still
    while len(rows):
        window = min(window, vocab)
        # Their ``window`` largest values in descending order: the end of each sorted row, reversed.
        stop = vocab - window - 1 if window < vocab else None
        desc = torch.from_numpy(np.ascontiguousarray(ascending[rows.numpy(), :stop:-1]))
        last[rows], count[rows], ties[rows] = _nucleus_cut(desc, top_p[rows], partial=window < vocab)
        rows = rows[count[rows, 0] == -1]
        window *= 16
    probs.masked_fill_(probs < last, 0.0)
    # Ties at the cutoff: entries equal to the last value kept that the prefix does not hold (those
    # past the window too). Rare in real logits; a pass over those rows alone.
    for row in ties.nonzero()[:, 0].tolist():
        row_probs = probs[row]
        above = int((row_probs > last[row]).sum())
        row_probs[(row_probs == last[row]).nonzero()[int(count[row]) - above :, 0]] = 0.0


def _nucleus_cut(desc: Tensor, top_p: Tensor, partial: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of values in descending order (a row's largest if ``partial``, else all of them), by
    ``apply_top_p``'s rule (an entry stays while the mass before it is under ``top_p``; the first always
    stays): the last value the nucleus keeps and how many it keeps (``[rows, 1]``; -1 where it keeps
    every one of a row's largest, so that more may stay), and whether entries equal to that value may be
    more than it keeps (``[rows]``). What stays is a prefix: the mass before an entry, as rounded, only
    grows along the row."""
    width = desc.shape[1]
    cum = desc.cumsum(dim=1)
    # The entries that stay: the mass before each is under ``top_p``, the first whatever it is.
    count = torch.searchsorted(cum.sub_(desc), top_p).clamp_(1, width)
    last = desc.gather(1, count - 1)
    # Sorted, so the entries equal to ``last`` are one stretch: more of them than stay if the next one is.
    ties = (count < width) & (desc.gather(1, count.clamp(max=width - 1)) == last) & (last > 0)
    if partial:  # every entry of the window stays: the next may too (the prefix is exact)
        count.masked_fill_(count == width, -1)
    return last, count, ties[:, 0]


def _inverse_cdf(probs: Tensor, generator: torch.Generator) -> Tensor:
    """Per row, one uniform draw inverted through the cumulative distribution. The sums are float64, so
    every token keeps its probability to about 1e-16, and a zero-probability token is never drawn."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator)
    # u < 1, but u * total may round up to total; keep the target strictly below it.
    target = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    # A NaN row (broken logits, flagged as such) finds no place but past its end: kept in the vocabulary.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _table_dtype(vocab: int) -> torch.dtype:
    """The logprob table's: float32 where it holds every token id exactly, else float64."""
    return torch.float32 if vocab <= 1 << 24 else torch.float64


def _index(rows: list[int], num_rows: int, device: torch.device) -> Tensor | None:
    """The index tensor of ``rows`` (ascending) among ``num_rows``; None when they are all of them."""
    return None if len(rows) == num_rows else long_tensor(rows, device)


def _take(t: Tensor, index: Tensor | None) -> Tensor:
    """``t[index]``; ``t`` itself, no copy, for ``index`` None (every row, in order)."""
    return t if index is None else t.index_select(0, index)


def _put(t: Tensor, index: Tensor | None, values: Tensor) -> None:
    """``t[index] = values``; nothing to do when ``values`` is ``t`` itself (``_take`` of every row)."""
    if values is t:
        return
    if index is None:
        t.copy_(values)
    else:
        t.index_copy_(0, index, values)
