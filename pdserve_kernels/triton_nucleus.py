"""Top-k, top-p and min-p in one Triton kernel, without sorting a row.

The torch path keeps a row's nucleus by sorting the whole row (49,152 to 128k entries), summing it
cumulatively and scattering the kept values back, with the index copies around it about fifteen
launches. On an H200 the mixed step's sampling took 3.2-5.8 ms nearly whatever the batch (16 to 512
rows), which points at the segmented sort (not timed apart; ``pdserve bench gpu`` times both now).
Here one program per row finds the nucleus by searching for its smallest value, then zeroes the rest
in place.

Which entries stay is ``sampler.apply_top_p``'s rule: in descending order, an entry stays while the
mass before it is under the row's ``top_p`` (the largest always stays). With ``G(v)`` the mass of the
entries larger than ``v``, the smallest value kept is the smallest value ``L`` in the row with
``G(L) < top_p``, every larger entry stays and every smaller one goes. ``G`` only falls as ``v`` grows,
and non-negative float32 values order as their bit patterns do, so the search runs over the integers
between 0 and the row's largest entry's bits: each pass over the row sums the mass above ``PIVOTS``
evenly spaced values at once (float32 per lane, float64 across lanes) and keeps the one
interval between them where ``G`` crosses ``top_p``, a seventeenth of the last, until it is one
value wide (about eight passes). Of the entries equal to ``L``, the ``i``-th in id order stays while
``G(L) + i * L`` is under ``top_p``, as many as a sort would keep (which ones among equal values a sort
keeps is its own order's choice). Min-p zeroes the entries under ``min_p`` times the row's largest
in the same last pass (the largest entry, which top-p keeps, is unchanged by it).

With ``top_k`` (the sampler's Triton path) the same program first finds the row's k-th largest value
by a search of the same kind over counts (the largest value with at least k entries at or above it,
about eight passes), and every entry under it goes, as top-k over the logits drops the entries under
the k-th largest logit (where two logits' probabilities round to the same value at the k-th place,
both stay). Top-p then takes its mass relative to what top-k keeps, ``top_p`` times their sum, as the
torch path's sort over the renormalised probabilities does, and the row is not normalised again: the
race draws from it as it is.

The masses are summed in another order than a sort's cumulative sum, so at a boundary the two can
round differently: the nucleus then differs by the entries whose mass lies within a rounding of
``top_p``, as it would between two sorting implementations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_BLOCK = 1024  # entries of a row per step of a program
PIVOTS = 16  # values whose mass a pass sums (the search narrows 17-fold a pass)


@triton.jit
def _search(row_ptr, vocab, lo, hi, threshold, COUNT: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """Narrows ``(lo, hi)``, the bits of two non-negative float32 values, to adjacent ones: ``hi`` the
    smallest whose score is under ``threshold`` (float64), ``lo`` below it. The score of a value ``v``
    falls as ``v`` grows: with ``COUNT`` the number of the row's entries at or above ``v``, else the mass
    of those above it. Each pass over the row scores ``PIVOTS`` evenly spaced values at once (float32
    per lane, exact for counts, float64 across lanes) and keeps the interval between two of them where
    the score crosses ``threshold``: a seventeenth of the last."""
    lanes = tl.arange(0, BLOCK)
    steps = tl.arange(1, PIVOTS + 1).to(tl.int64)
    while hi - lo > 1:
        spaced = lo.to(tl.int64) + ((hi - lo).to(tl.int64) * steps) // (PIVOTS + 1)
        pivots = tl.minimum(tl.maximum(spaced.to(tl.int32), lo + 1), hi - 1)
        values = pivots.to(tl.float32, bitcast=True)
        # Per lane and pivot, summed across lanes once a pass: the steps are element-wise.
        lane_score = tl.zeros([BLOCK, PIVOTS], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            p = tl.load(row_ptr + start + lanes, mask=start + lanes < vocab, other=0.0)
            if COUNT:
                lane_score += tl.where(p[:, None] >= values[None, :], 1.0, 0.0)
            else:
                lane_score += tl.where(p[:, None] > values[None, :], p[:, None], 0.0)
        under = tl.sum(lane_score.to(tl.float64), axis=0) < threshold  # a suffix of the pivots, which ascend
        hi = tl.minimum(hi, tl.min(tl.where(under, pivots, hi), axis=0))
        lo = tl.maximum(lo, tl.max(tl.where(under, lo, pivots), axis=0))
    return lo, hi


@triton.jit
def _nucleus_kernel(probs_ptr, stride_row, top_p_ptr, min_p_ptr, top_k_ptr, vocab,
                    HAS_TOP_K: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    row = tl.program_id(0)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    top_k = tl.zeros([], dtype=tl.int32)
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + row)
    thin_k = (top_k > 0) & (top_k < vocab)
    if (top_p < 1.0) | (min_p > 0.0) | thin_k:
        row_ptr = probs_ptr + row.to(tl.int64) * stride_row
        lanes = tl.arange(0, BLOCK)
        top = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            p = tl.load(row_ptr + start + lanes, mask=start + lanes < vocab, other=0.0)
            top = tl.maximum(top, p)
        largest = tl.max(top, axis=0)
        kth = largest * 0.0  # entries below it go (top-k); with no top-k, none
        target = top_p.to(tl.float64)  # the mass top-p keeps: of the row, or of what top-k keeps
        if thin_k:
            # The k-th largest value: the largest with at least k entries at or above it. Its bits lie in
            # [lo, hi): at least k entries are >= lo's value, fewer than k are >= hi's.
            lo_k, _ = _search(row_ptr, vocab, tl.full([], 0, dtype=tl.int32), largest.to(tl.int32, bitcast=True) + 1,
                              top_k.to(tl.float64), True, BLOCK, PIVOTS)
            kth = lo_k.to(tl.float32, bitcast=True)
            lane_kept = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, vocab, BLOCK):
                p = tl.load(row_ptr + start + lanes, mask=start + lanes < vocab, other=0.0)
                lane_kept += tl.where(p >= kth, p, 0.0)
            target = target * tl.sum(lane_kept.to(tl.float64), axis=0)
        cut = kth  # entries below it go
        allowed = vocab + 1  # of the entries equal to ``cut``, how many stay (in id order)
        if top_p < 1.0:
            # The answer's bits lie in (lo, hi]: G(hi) < target, and lo is below the k-th value (or -1)
            # or G(lo) >= target.
            _, hi = _search(row_ptr, vocab, kth.to(tl.int32, bitcast=True) - 1, largest.to(tl.int32, bitcast=True),
                            target, False, BLOCK, PIVOTS)
            cut = hi.to(tl.float32, bitcast=True)
            lane_above = tl.zeros([BLOCK], dtype=tl.float32)
            lane_ties = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, vocab, BLOCK):
                p = tl.load(row_ptr + start + lanes, mask=start + lanes < vocab, other=0.0)
                lane_above += tl.where(p > cut, p, 0.0)
                lane_ties += (p == cut).to(tl.int32)
            mass_above = tl.sum(lane_above.to(tl.float64), axis=0)
            ties = tl.sum(lane_ties, axis=0)
            # The i-th entry equal to ``cut`` stays while mass_above + i * cut < target; at least one does.
            room = tl.math.ceil((target - mass_above) / tl.maximum(cut.to(tl.float64), 1e-300))
            allowed = tl.minimum(tl.maximum(room, 1.0), ties.to(tl.float64)).to(tl.int32)
        floor = min_p * largest  # min-p's bound, rounded as the torch path's product
        seen = tl.zeros([], dtype=tl.int32)  # entries equal to ``cut`` before this block
        for start in range(0, vocab, BLOCK):
            ids = start + lanes
            valid = ids < vocab
            p = tl.load(row_ptr + ids, mask=valid, other=0.0)
            tie = (p == cut) & valid
            rank = seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            seen += tl.sum(tie.to(tl.int32), axis=0)
            drop = (p < cut) | (tie & (rank >= allowed)) | (p < floor)
            tl.store(row_ptr + ids, tl.zeros([BLOCK], dtype=tl.float32), mask=valid & drop)


def nucleus_filter(probs: Tensor, top_p: Tensor, min_p: Tensor, top_k: Tensor | None = None) -> None:
    """In place, per row of ``probs`` (float32 ``[rows, vocab]``, unit stride along the vocabulary, each
    row a distribution's probabilities, non-negative): zero every entry under the row's ``top_k``-th
    largest (int32 ``[rows]``; 0, or the vocabulary or more, for none), then every entry outside the
    top-p nucleus of what stays (``top_p``: float32 ``[rows]``; 1 keeps the row), then every entry under
    ``min_p`` times the row's largest (float32 ``[rows]``; 0 for none). A row with none is not read."""
    unit_stride = probs.dim() == 2 and (probs.shape[1] <= 1 or probs.stride(1) == 1)
    assert unit_stride and probs.dtype == torch.float32, (
        f"probs must be a float32 [rows, vocab] tensor with unit stride along the vocabulary; "
        f"got {probs.dtype} {tuple(probs.shape)}, strides {probs.stride()}"
    )
    num_rows, vocab = probs.shape
    params = [("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32)]
    if top_k is not None:
        params.append(("top_k", top_k, torch.int32))
    for name, values, dtype in params:
        assert values.shape == (num_rows,) and values.dtype == dtype and values.is_contiguous(), (
            f"{name} must be a contiguous {dtype} [{num_rows}] tensor; got {values.dtype} {tuple(values.shape)}"
        )
        assert values.device == probs.device, f"{name} is on {values.device}, probs on {probs.device}"
    if not num_rows or not vocab:
        return
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
    _nucleus_kernel[(num_rows,)](probs, probs.stride(0), top_p, min_p, top_p if top_k is None else top_k, vocab,
                                 HAS_TOP_K=top_k is not None, BLOCK=block, PIVOTS=PIVOTS,
                                 num_warps=8 if block >= 512 else 4)
