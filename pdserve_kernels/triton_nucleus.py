"""Top-p and min-p in one Triton kernel, without sorting a row.

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
def _nucleus_kernel(probs_ptr, stride_row, top_p_ptr, min_p_ptr, vocab,
                    BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    row = tl.program_id(0)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    if (top_p < 1.0) | (min_p > 0.0):
        row_ptr = probs_ptr + row.to(tl.int64) * stride_row
        lanes = tl.arange(0, BLOCK)
        top = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            p = tl.load(row_ptr + start + lanes, mask=start + lanes < vocab, other=0.0)
            top = tl.maximum(top, p)
        largest = tl.max(top, axis=0)
        cut = largest * 0.0  # entries below it go; with no top-p, none
        allowed = vocab + 1  # of the entries equal to ``cut``, how many stay (in id order)
        if top_p < 1.0:
            # The answer's bits lie in (lo, hi]: G(hi) < top_p, and lo = -1 or G(lo) >= top_p.
            lo = tl.full([], -1, dtype=tl.int32)
            hi = largest.to(tl.int32, bitcast=True)
            steps = tl.arange(1, PIVOTS + 1).to(tl.int64)
            while hi - lo > 1:
                spaced = lo.to(tl.int64) + ((hi - lo).to(tl.int64) * steps) // (PIVOTS + 1)
                pivots = tl.minimum(tl.maximum(spaced.to(tl.int32), lo + 1), hi - 1)
                values = pivots.to(tl.float32, bitcast=True)
                # Per lane and pivot, summed across lanes once a pass: the steps are element-wise.
                lane_mass = tl.zeros([BLOCK, PIVOTS], dtype=tl.float32)
                for start in range(0, vocab, BLOCK):
                    p = tl.load(row_ptr + start + lanes, mask=start + lanes < vocab, other=0.0)
                    lane_mass += tl.where(p[:, None] > values[None, :], p[:, None], 0.0)
                mass = tl.sum(lane_mass.to(tl.float64), axis=0)
                under = mass < top_p  # a suffix of the pivots, which ascend
                hi = tl.minimum(hi, tl.min(tl.where(under, pivots, hi), axis=0))
                lo = tl.maximum(lo, tl.max(tl.where(under, lo, pivots), axis=0))
            cut = hi.to(tl.float32, bitcast=True)
            lane_above = tl.zeros([BLOCK], dtype=tl.float32)
            lane_ties = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, vocab, BLOCK):
                p = tl.load(row_ptr + start + lanes, mask=start + lanes < vocab, other=0.0)
                lane_above += tl.where(p > cut, p, 0.0)
                lane_ties += (p == cut).to(tl.int32)
            mass_above = tl.sum(lane_above.to(tl.float64), axis=0)
            ties = tl.sum(lane_ties, axis=0)
            # The i-th entry equal to ``cut`` stays while mass_above + i * cut < top_p; at least one does.
            room = tl.math.ceil((top_p.to(tl.float64) - mass_above) / tl.maximum(cut.to(tl.float64), 1e-300))
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


def nucleus_filter(probs: Tensor, top_p: Tensor, min_p: Tensor) -> None:
    """In place, per row of ``probs`` (float32 ``[rows, vocab]``, unit stride along the vocabulary, each
    row a distribution's probabilities, non-negative): zero every entry outside the row's top-p nucleus
    (``top_p``: float32 ``[rows]``; 1 keeps the row) and every entry under ``min_p`` times the row's
    largest (float32 ``[rows]``; 0 for none). A row with neither is not read."""
    unit_stride = probs.dim() == 2 and (probs.shape[1] <= 1 or probs.stride(1) == 1)
    assert unit_stride and probs.dtype == torch.float32, (
        f"probs must be a float32 [rows, vocab] tensor with unit stride along the vocabulary; "
        f"got {probs.dtype} {tuple(probs.shape)}, strides {probs.stride()}"
    )
    num_rows, vocab = probs.shape
    for name, values in (("top_p", top_p), ("min_p", min_p)):
        assert values.shape == (num_rows,) and values.dtype == torch.float32 and values.is_contiguous(), (
            f"{name} must be a contiguous float32 [{num_rows}] tensor; got {values.dtype} {tuple(values.shape)}"
        )
        assert values.device == probs.device, f"{name} is on {values.device}, probs on {probs.device}"
    if not num_rows or not vocab:
        return
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
    _nucleus_kernel[(num_rows,)](probs, probs.stride(0), top_p, min_p, vocab, BLOCK=block, PIVOTS=PIVOTS,
                                 num_warps=8 if block >= 512 else 4)

