"""Speculative decoding with n-gram drafts (prompt lookup), verified in the step that decodes.

Before each step the proposer looks, for every running request that decodes (its tokens all computed
but the last), for the longest suffix of its tokens (``prompt_lookup_min`` to ``prompt_lookup_max``
long) that occurred earlier in its prompt or output, and drafts the tokens that followed its latest
occurrence (at most ``num_speculative_tokens``, as ``Request.spec_token_ids``). The scheduler gives the
request one token more per draft token; the forward computes the last token and the drafts at once
and gives logits at each of them; the engine keeps each draft token the model's own choice agrees
with, and the model's token after the last one kept (``LLMEngine._accept``): from 1 to 1 + k tokens
per step.

The engine samples each of those rows as it samples any row, and keeps a draft where the row's token
is the draft: the tokens are then exactly those a step per token samples, for a sampled request as
for a greedy one. A seeded row's draw is a function of its seed, its output position and its
probabilities (``common.engine.seeded_draws``), so a seeded request gives the very tokens it gives
without drafts; an unseeded one draws each position from the same distribution (a draft is kept with
the probability the model gives it, and a position where it is not gets a token drawn from the rest:
speculative sampling for a draft that is one token for sure). So drafts are proposed for any request
whose sampling at a position depends on the output before it only through that position
(``Request.may_draft``: no penalties, bad words or grammar; min_tokens reached). Every other request
decodes a token per step in the same batch.

Nothing here touches a tensor that the device sees: a request's tokens are mirrored in a numpy array
it carries (appended to as it grows), and the lookup is a few vectorized comparisons over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from common.config import SpeculativeConfig
from common.engine.request import Request

# Candidates up to this many are matched in Python (``NgramProposer._lookup_few``), more with numpy.
_FEW = 8


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len
        self.disable_by_batch_size = config.disable_by_batch_size

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` of every running request: drafts where it decodes and may draft, else
        none (for all of them when the batch holds ``disable_by_batch_size`` requests or more)."""
        off = 0 < self.disable_by_batch_size <= len(running)
        for req in running:
            drafts: list[int] = []
            k = 0 if off else self.num_drafts(req)
            if k > 0:
                drafts = self.lookup(_tokens(req), k)
            req.spec_token_ids = drafts

    def num_drafts(self, req: Request) -> int:
        """How many tokens ``req`` may draft this step: 0 unless it decodes and verifying is its sampling;
        no more than its output may still take after the token the step surely gives, nor than its
        positions may hold."""
        if (
            not req.may_draft or req.grammar is not None or req.num_computed_tokens != len(req.all_token_ids) - 1
            or len(req.output_token_ids) < req.sampling_params.min_tokens
        ):
            return 0
        left = min(req.sampling_params.max_tokens - len(req.output_token_ids),
                   self.max_model_len - len(req.all_token_ids))
        return max(0, min(self.k, left - 1))

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``tokens`` between ``min_n`` and ``max_n`` long; [] where none occurred."""
        n = len(tokens)
        if n < self.min_n + 1:
            return []
        # Candidates: earlier positions holding the last token; their match grows backwards.
        ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
        if ends.size == 0:
            return []
        if ends.size <= _FEW:
            return self._lookup_few(tokens, ends.tolist(), k)
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, self.max_n):
            if n - 1 - j < 0:
                break
            back = ends - j
            ok = alive & (back >= 0)
            ok[ok] = tokens[back[ok]] == tokens[n - 1 - j]
            if not ok.any():
                break
            length += ok
            alive = ok
        best = int(length.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(length == best)[-1]])  # the latest of the longest
        return tokens[end + 1 : end + 1 + k].tolist()

    def _lookup_few(self, tokens: np.ndarray, ends: list[int], k: int) -> list[int]:
        """``lookup`` over a few candidates, in Python over the last ``max_n`` tokens: the latest first,
        so the first to match ``max_n`` long is the answer (a dozen numpy calls cost more)."""
        n = len(tokens)
        tail = tokens[max(0, n - self.max_n) :].tolist()[::-1]  # tail[j] is the token j before the last
        best, best_end = 0, -1
        for end in reversed(ends):
            length = 1
            while length < len(tail) and end - length >= 0 and tokens[end - length] == tail[length]:
                length += 1
            if length > best:
                best, best_end = length, end
                if length == self.max_n:
                    break
        if best < self.min_n:
            return []
        return tokens[best_end + 1 : best_end + 1 + k].tolist()


def _tokens(req: Request) -> np.ndarray:
    """``req.all_token_ids`` as an int64 array, kept on the request and appended to as it grows."""
    ids = req.all_token_ids
    n = len(ids)
    buf, have = req.spec_mirror
    if buf is None or have > n or n > len(buf):
        grown = np.empty(max(64, 2 * n), dtype=np.int64)
        if buf is not None and have <= n:
            grown[:have] = buf[:have]
        else:
            have = 0
        buf = grown
    if have < n:
        buf[have:n] = ids[have:n]
    req.spec_mirror = (buf, n)
    return buf[:n]


class _OutputAfter(Sequence[int]):
    """A request's output followed by some drafts, read in place (a step's rows copied no output)."""

    __slots__ = ("_output", "_drafts")

    def __init__(self, output: list[int], drafts: Sequence[int]) -> None:
        self._output, self._drafts = output, drafts

    def __len__(self) -> int:
        return len(self._output) + len(self._drafts)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [*self._output, *self._drafts][index]
        if index < 0:
            index += len(self)
        n = len(self._output)
        return self._output[index] if index < n else self._drafts[index - n]


class DraftRow:
    """Row ``j`` of a decode with drafts, as the sampler reads it: the request as it will stand after its
    first ``j`` drafts, which for the rows of a request that may draft (``Request.may_draft``) is only
    its output's length, the index of its draw (a seeded row's noise is a function of it). Every
    other attribute is the request's."""

    __slots__ = ("_request", "output_token_ids")

    def __init__(self, request: Request, drafts_before: Sequence[int]) -> None:
        self._request = request
        self.output_token_ids = _OutputAfter(request.output_token_ids, drafts_before)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def draft_rows(request: Request, drafts: Sequence[int]) -> list[Request]:
    """The sampler's rows of a decode with ``drafts``: at its last token, then after each draft."""
    rows: list[Any] = [request]
    rows += (DraftRow(request, drafts[:j]) for j in range(1, len(drafts) + 1))
    return rows
