"""Token sampling for a whole batch at once: logit bias, grammars, penalties, temperature,
top-k/top-p/min-p, seeds, logprobs.

A step is a fixed handful of tensor operations over ``[rows, vocab]`` whatever the batch holds: the
per-row parameters travel as tensors, a row with neutral parameters passes through unchanged, and
Python loops only over rows that need something of their own (a seed, a ban, logprobs to build). The
tokens a penalty reads stay on the device from step to step (``common.engine.penalties``), and every
index or parameter list crosses to a tensor through ``common.engine.host_tensors``.

An all-greedy batch without penalties is one argmax over the logits in place; otherwise each row is
copied at most once, into the working tensor that ``logit_bias`` (one scatter-add, first of all),
structured output (one masked fill over the rows with a grammar, whose states each fill their row of
a token bitmask), penalties, ``min_tokens`` bans, temperature and top-k then modify in place. Greedy
rows take the argmax of their penalised logits. Only the sampled ids and the requested logprobs
cross to the host, one transfer each.

On the CPU the rows go through in chunks of about ``CPU_CHUNK_BYTES`` of logits: every temporary
then comes from the malloc heap, warm in the cache, where a whole-batch one (50 MB for 256 rows of
49,152 logits, above glibc's largest mmap threshold) would fault in fresh pages each time.

Draw contract: a sampled row of a request with a seed draws its token by the exponential race,
``argmax(probs / E)`` with ``E ~ Exp(1)``, where the ``E`` of vocabulary entry ``t`` for the request's
``i``-th output token is a fixed function of (seed, ``i``, ``t``) (``exponentials``: splitmix64 over a
key made from the seed and ``i``, the entry's uniform at stream position ``t``). It is counter-based:
a token depends on nothing but the seed, the output position and the row's probabilities, whatever
else shares the batch, whatever ran before on whichever instance. So a request continued elsewhere
(a migration, a decode after its prefill, a recompute after preemption) draws the same tokens with
no generator state to carry or replay, and the noise can be computed where it is needed: on a GPU
for the whole row in one batched kernel, on the CPU only over the entries of positive probability.
Unseeded rows share one batched draw from the sampler's own generator: one uniform per row,
inverted through the row's cumulative distribution (a pass over the row, where the race costs a
logarithm per entry).

Logprobs are those of the model's raw distribution (before logit bias, grammar, penalties and
temperature), as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from common.engine.grammar import apply_token_bitmask
from common.engine.host_tensors import float_tensor, long_tensor
from common.engine.penalties import TokenRows, apply_output_penalties, apply_repetition_penalty
from common.engine.request import Request
from common.protocol import PositionLogprobs, TokenLogprob

CPU_CHUNK_BYTES = 8 << 20
# On the CPU top-p first sorts only this many of a row's largest probabilities, then 16 times as
# many, while they hold less than the mass (a top-p 0.9 nucleus of the default model is mostly a few
# tokens to a few hundred, now and then over a thousand at temperature 1).
TOP_P_WINDOW = 256


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.seed = seed
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}
        # Token bitmask rows for grammars, reused step after step (xgrammar fills it on the CPU).
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        # The tokens penalties read, per request, kept where the logits are (``common.engine.penalties``).
        self._penalty_tokens: dict[tuple[torch.device, str], TokenRows] = {}

    def __call__(self, logits: Tensor, requests: list[Request]) -> SampleResult:
        """Sample one token per row of ``logits`` ``[len(requests), vocab]``; ``logits`` is not mutated.

        Advances the generator of every seeded request whose row is sampled (not greedy) by one draw.
        """
        num_rows, vocab = len(requests), logits.shape[-1]
        if num_rows == 0:
            return SampleResult([], [])
        for token_rows in self._penalty_tokens.values():
            token_rows.begin_step()
        x = logits.float()
        if all(r.plain_greedy and r.grammar is None for r in requests) or not any(
            self._has_work(r) for r in requests
        ):  # all greedy, nothing else: one argmax
            return SampleResult(x.argmax(dim=-1).tolist(), [None] * num_rows)
        k_max = max((r.sampling_params.logprobs or 0 for r in requests), default=0)
        chunk = num_rows
        if x.device.type == "cpu":
            chunk = max(1, CPU_CHUNK_BYTES // (4 * vocab))
        results = [
            self._sample_rows(x[start : start + chunk], requests[start : start + chunk], x is not logits, k_max)
            for start in range(0, num_rows, chunk)
        ]
        token_ids = results[0][0] if len(results) == 1 else torch.cat([t for t, _ in results])
        tokens: list[int] = token_ids.tolist()
        tables = [table for _, table in results if table is not None]
        logprobs: list[PositionLogprobs | None] = [None] * num_rows
        if tables:
            # One transfer: float64 holds every float32 value and every token id exactly.
            lines: list[list[float]] = torch.cat(tables).tolist()
            rows = [row for row, r in enumerate(requests) if r.sampling_params.logprobs is not None]
            for row, line in zip(rows, lines, strict=True):
                k = int(requests[row].sampling_params.logprobs or 0)
                top = [TokenLogprob(int(line[1 + k_max + j]), line[1 + j]) for j in range(k)]
                logprobs[row] = PositionLogprobs(tokens[row], line[0], top)
        return SampleResult(tokens, logprobs)

    def _has_work(self, req: Request) -> bool:
        """More than an argmax of the raw row: a draw, logprobs, a penalty or a ban."""
        p = req.sampling_params
        return (
            not p.greedy or p.logprobs is not None or p.repetition_penalty != 1.0
            or bool(p.logit_bias) or req.grammar is not None
            or bool((p.presence_penalty or p.frequency_penalty) and req.output_token_ids)
            or req.num_output_tokens < p.min_tokens
        )

    def _sample_rows(
        self, logits: Tensor, requests: list[Request], owned: bool, k_max: int
    ) -> tuple[Tensor, Tensor | None]:
        """Token ids for ``requests`` from their float32 rows ``logits`` (written only if ``owned``), and
        for the rows that asked for logprobs ``[token logprob, k_max top values, k_max top ids]`` in float64."""
        lp_rows = [row for row, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        raw = torch.log_softmax(_rows(logits, lp_rows), dim=-1) if lp_rows else None
        constrained = self._constrained(logits, requests, owned)
        owned, logits = owned or constrained is not logits, constrained
        greedy = [row for row, r in enumerate(requests) if r.sampling_params.greedy]
        sampled = [row for row, r in enumerate(requests) if not r.sampling_params.greedy]
        token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        for rows, draw in ((greedy, False), (sampled, True)):
            if not rows:
                continue
            reqs = [requests[r] for r in rows]
            x = _rows(logits, rows)  # each row is copied at most once: here, or for a penalty
            x_owned = owned or x is not logits
            y = self._penalized(x, reqs, x_owned)
            ids = self._draw(y, reqs, owned=x_owned or y is not x) if draw else y.argmax(dim=-1)
            _write_rows(token_ids, rows, ids)
        if raw is None:
            return token_ids, None
        parts = [raw.gather(1, _rows(token_ids.unsqueeze(1), lp_rows))]
        if k_max:
            top = raw.topk(k_max, dim=-1)
            parts += [top.values, top.indices]
        return token_ids, torch.cat([p.double() for p in parts], dim=1)

    def _constrained(self, logits: Tensor, requests: list[Request], owned: bool) -> Tensor:
        """``logits`` plus every row's ``logit_bias`` (one scatter-add), then with every token its
        grammar does not allow next at -inf (one masked fill over the grammar rows); written in place
        if ``owned``, else a copy when any applies."""
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        grammar_rows: list[int] = []
        for row, req in enumerate(requests):
            bias = req.sampling_params.logit_bias
            if bias:
                bias_rows += [row] * len(bias)
                bias_ids += bias.keys()
                bias_values += bias.values()
            if req.grammar is not None:
                grammar_rows.append(row)
        if not (bias_rows or grammar_rows):
            return logits
        x = logits if owned else logits.clone()
        dev = x.device
        if bias_rows:
            x.index_put_(
                (long_tensor(bias_rows, dev), long_tensor(bias_ids, dev)),
                float_tensor(bias_values, dev).to(x.dtype), accumulate=True,
            )
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

    def _penalized(self, logits: Tensor, requests: list[Request], owned: bool) -> Tensor:
        """``logits`` with min_tokens bans and penalties; written in place if ``owned``, else a copy
        when any applies."""
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        rep_rows: list[int] = []
        out_rows: list[int] = []
        for row, req in enumerate(requests):
            p = req.sampling_params
            # A grammar decides alone when its output may end: banning its stop token could leave no token.
            if req.num_output_tokens < p.min_tokens and req.grammar is None:
                banned = [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)]
                ban_rows += [row] * len(banned)
                ban_ids += banned
            if p.repetition_penalty != 1.0:
                rep_rows.append(row)
            if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
                out_rows.append(row)
        if not (ban_ids or rep_rows or out_rows):
            return logits
        x = logits if owned else logits.clone()
        dev = x.device
        if ban_ids:
            x[long_tensor(ban_rows, dev), long_tensor(ban_ids, dev)] = float("-inf")
        if rep_rows:
            reqs = [requests[r] for r in rep_rows]
            ids, _ = self._token_rows(dev, "all_token_ids").view(reqs)
            penalty = float_tensor([r.sampling_params.repetition_penalty for r in reqs], dev)
            apply_repetition_penalty(x, long_tensor(rep_rows, dev), ids, penalty)
        if out_rows:
            reqs = [requests[r] for r in out_rows]
            ids, valid = self._token_rows(dev, "output_token_ids").view(reqs)
            frequency = float_tensor([r.sampling_params.frequency_penalty for r in reqs], dev)
            presence = float_tensor([r.sampling_params.presence_penalty for r in reqs], dev)
            apply_output_penalties(x, long_tensor(out_rows, dev), ids, valid, frequency, presence)
        return x

    def _token_rows(self, device: torch.device, source: Literal["all_token_ids", "output_token_ids"]) -> TokenRows:
        """The sampler's store of every request's ``source`` tokens on ``device``."""
        key = (device, source)
        rows = self._penalty_tokens.get(key)
        if rows is None:
            rows = self._penalty_tokens[key] = TokenRows(source, device)
            rows.begin_step()
        return rows

    def _draw(self, logits: Tensor, requests: list[Request], owned: bool) -> Tensor:
        """One draw per row, every row sampled (the exponential race for a seeded row, the inverse CDF
        for the others); writes into ``logits`` only if ``owned``."""
        params = [r.sampling_params for r in requests]
        num_rows, vocab = logits.shape
        dev = logits.device
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):
            scale = float_tensor(temperatures, dev).unsqueeze(1)
            logits = logits.div_(scale) if owned else logits / scale
            owned = True
        top_k_rows = [row for row, p in enumerate(params) if 0 < p.top_k < vocab]
        if top_k_rows:
            ks = [params[r].top_k for r in top_k_rows]
            kth = _rows(logits, top_k_rows).topk(max(ks), dim=-1).values
            kth = kth.gather(1, long_tensor(ks, dev).unsqueeze(1) - 1)
            if len(top_k_rows) < num_rows:  # rows without top-k compare against -inf: nothing masked
                kth = logits.new_full((num_rows, 1), float("-inf")).index_copy_(
                    0, long_tensor(top_k_rows, dev), kth
                )
            below = logits < kth
            logits = logits.masked_fill_(below, float("-inf")) if owned else logits.masked_fill(below, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_p_rows = [row for row, p in enumerate(params) if p.top_p < 1.0]
        if top_p_rows:
            sub = _rows(probs, top_p_rows)
            top_p = float_tensor([params[r].top_p for r in top_p_rows], dev)
            # A branch on the data costs nothing on the CPU; on a GPU it would be a sync, and sorting is cheap.
            apply_top_p(sub, top_p.unsqueeze(1), TOP_P_WINDOW if dev.type == "cpu" else vocab)
            _write_rows(probs, top_p_rows, sub)
        min_p_rows = [row for row, p in enumerate(params) if p.min_p > 0.0]
        if min_p_rows:
            sub = _rows(probs, min_p_rows)
            min_p = float_tensor([params[r].min_p for r in min_p_rows], dev)
            sub.masked_fill_(sub < min_p.unsqueeze(1) * sub.amax(dim=-1, keepdim=True), 0.0)
            _write_rows(probs, min_p_rows, sub)
        seeded = [row for row, r in enumerate(requests) if r.draw_seed is not None]
        unseeded = [row for row, r in enumerate(requests) if r.draw_seed is None]
        token_ids = torch.empty(num_rows, dtype=torch.long, device=dev)
        if seeded:
            keys = draw_keys([requests[r].draw_seed or 0 for r in seeded],
                             [len(requests[r].output_token_ids) for r in seeded], dev)
            _write_rows(token_ids, seeded, _race(probs, seeded, keys))
        if unseeded:
            _write_rows(token_ids, unseeded, _inverse_cdf(_rows(probs, unseeded), self._generator(dev)))
        return token_ids

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device=device)
            self._device_generators[device].manual_seed(self.seed)
        return self._device_generators[device]


def apply_top_p(probs: Tensor, top_p: Tensor, window: int) -> None:
    """In place, zero all but each row's smallest set of most likely tokens whose mass reaches its
    ``top_p`` (``[rows, 1]``); the most likely token always stays.

    Only the ``window`` largest entries of a row are sorted when their mass already reaches ``top_p``
    (then every entry past them is dropped, exactly as a full sort would find); other rows try a window
    16 times as large, up to the whole vocabulary. Deciding which rows those are reads the data, so
    pass ``window >= vocab`` on a GPU.
    """
    vocab = probs.shape[-1]
    window = min(window, vocab)
    values, order = probs.topk(window, dim=-1) if window < vocab else probs.sort(dim=-1, descending=True)
    cum = values.cumsum(dim=-1)
    short: list[int] = (cum[:, -1] < top_p[:, 0]).nonzero().flatten().tolist() if window < vocab else []
    if short:  # the window holds less than top_p: these rows try a larger one
        full = probs[short]
        apply_top_p(full, top_p[short], 16 * window)
    values.masked_fill_(cum - values >= top_p, 0.0)
    probs.zero_().scatter_(1, order, values)
    if short:
        probs[short] = full


# splitmix64 (Steele, Lea and Flood, 2014) in int64 tensor arithmetic: multiplications wrap modulo
# 2**64 and a right shift is made logical by masking the bits the sign extended into.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64's output function on an int64 tensor."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX_1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX_2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def draw_keys(seeds: list[int], draw_indices: list[int], device: torch.device | str = "cpu") -> Tensor:
    """int64 ``[rows]``: per row, the key of draw ``draw_indices[i]`` (the output position) of a request
    seeded ``seeds[i]`` (any Python int; taken modulo 2**64)."""
    signed = [(s & 0xFFFFFFFFFFFFFFFF) - ((s >> 63 & 1) << 64) for s in seeds]
    seed_t = long_tensor(signed, device)
    index_t = long_tensor(draw_indices, device)
    return _mix64(_mix64(seed_t) + index_t * _GOLDEN)


def exponentials(keys: Tensor, token_ids: Tensor) -> Tensor:
    """Exp(1) noise (float32) for entries ``token_ids`` of draws ``keys`` (int64, broadcast together):
    the uniform at position ``t`` of the splitmix64 stream from the key, to 53 bits, as
    ``float32(-log1p(-u))`` (the formula of the CPU's ``exponential_``)."""
    z = _mix64(keys + (token_ids + 1) * _GOLDEN)
    u = ((z >> 11) & ((1 << 53) - 1)).double().mul_(2.0**-53)
    return torch.log1p(u.neg_()).neg_().float()


def _race(probs: Tensor, rows: list[int], keys: Tensor) -> Tensor:
    """For each of ``rows`` of ``probs``, ``argmax(probs[row] / E)`` with ``E`` its draw's noise
    (``exponentials`` of ``keys[i]``); ties go to the lowest token id, as ``argmax``'s.

    On a GPU the noise is computed for whole rows in one batch, with no sync. On the CPU the
    logarithms are most of a draw's cost and a token of probability zero cannot win, so they are
    taken only over the entries of positive probability (top-k, top-p and min-p leave a few hundred
    tokens, or fewer), for all the rows at once.
    """
    sub = _rows(probs, rows)
    num_rows, vocab = sub.shape
    if probs.device.type != "cpu":
        noise = exponentials(keys.unsqueeze(1), torch.arange(vocab, device=probs.device).unsqueeze(0))
        return (sub / noise).argmax(dim=-1)
    r, t = sub.nonzero(as_tuple=True)  # row-major: each row's entries ascend
    score = sub[r, t] / exponentials(keys[r], t)
    best = torch.zeros(num_rows).scatter_reduce_(0, r, score, "amax")
    wins = score == best[r]
    token_ids = torch.full((num_rows,), vocab, dtype=torch.long).scatter_reduce_(0, r[wins], t[wins], "amin")
    if bool((token_ids == vocab).any()):  # a row with no positive entry (NaNs): what argmax makes of it
        token_ids = torch.where(token_ids == vocab, sub.argmax(dim=-1), token_ids)
    return token_ids


def _inverse_cdf(probs: Tensor, generator: torch.Generator) -> Tensor:
    """Per row, one uniform draw inverted through the cumulative distribution. The sums are float64, so
    every token keeps its probability to about 1e-16, and a zero-probability token is never drawn."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator)
    # u < 1, but u * total may round up to total; keep the target strictly below it.
    target = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _rows(t: Tensor, rows: list[int]) -> Tensor:
    """``t[rows]``; ``t`` itself, no copy, when the rows are all of them in order."""
    if len(rows) == t.shape[0]:
        return t
    return t.index_select(0, long_tensor(rows, t.device))


def _write_rows(t: Tensor, rows: list[int], values: Tensor) -> None:
    """``t[rows] = values``; nothing to do when ``values`` is ``t`` itself (``_rows`` of every row)."""
    if values is t:
        return
    if len(rows) == t.shape[0]:
        t.copy_(values)
    else:
        t.index_copy_(0, long_tensor(rows, t.device), values)
