"""The seeded rows' draw in one Triton kernel: the exponential race, noise and all, in one pass.

A seeded row samples ``argmax(p / E)`` over its probabilities ``p``, with ``E`` Exp(1) noise that is a
pure function of the draw's key and the token id (``common.engine.seeded_draws.exponentials``: splitmix64
from the key, the uniform's top 53 bits, ``-log1p(-u)`` in float64 rounded to float32). In torch that
is two dozen element-wise operations over ``[rows, vocab]``, most of them on int64 or float64
temporaries of that shape (a quarter of a GiB each at 256 rows of a 128k vocabulary), then the
division and an ``argmax``: each a kernel launch and a pass over memory. Here one program per row
walks the row once: it hashes each token id in registers, divides, and keeps per lane the first
largest score and the first NaN.

The same token as the torch path, bit for bit, but for one case no test can reach: ``-log(1 - u)``
here against ``-log1p(-u)`` there. ``1 - u`` is exact in float64 (``u`` holds 53 bits), so both are
the logarithm of the same number, each within an ulp of float64, and they can round to different
float32 values only when the float64 value lies within an ulp of the midpoint between two float32
values: about once in 2**29 entries, and then it changes the token only if that entry's score was
within a float32 ulp of the row's best. Division is ``div_rn`` (correctly rounded, as torch's), not
Triton's default approximate one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve_kernels.triton_checks import check_index

MAX_BLOCK = 1024  # token ids per step of a row's program


@triton.jit
def _mix64(z):
    """splitmix64's output function on uint64 (the constants as in ``common.engine.seeded_draws``)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _seeded_race_kernel(probs_ptr, stride_row, keys_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    lanes = tl.arange(0, BLOCK)
    # Per lane: the largest score seen (-1 before any: every score is >= 0 or NaN), its first token id,
    # and the first token id whose score was NaN (``vocab``: none).
    best = tl.full([BLOCK], -1.0, dtype=tl.float32)
    best_ids = tl.zeros([BLOCK], dtype=tl.int32)
    nan_ids = tl.full([BLOCK], vocab, dtype=tl.int32)
    row_ptr = probs_ptr + row.to(tl.int64) * stride_row
    for start in range(0, vocab, BLOCK):
        ids = start + lanes
        valid = ids < vocab
        p = tl.load(row_ptr + ids, mask=valid, other=0.0)
        z = _mix64(key + (ids + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        u = (z >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2**-53: a uniform in [0, 1), 53 bits
        noise = (-tl.log(1.0 - u)).to(tl.float32)
        score = tl.math.div_rn(p, noise)
        is_nan = (score != score) & valid
        nan_ids = tl.minimum(nan_ids, tl.where(is_nan, ids, vocab))
        better = (score > best) & valid  # strictly: a lane keeps its first id among equal scores
        best_ids = tl.where(better, ids, best_ids)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    # The lowest id among the lanes holding the row's largest score is the row's first such id.
    first = tl.min(tl.where(best == top, best_ids, vocab), axis=0)
    first_nan = tl.min(nan_ids, axis=0)
    tl.store(out_ptr + row, tl.where(first_nan < vocab, first_nan, first).to(tl.int64))


def seeded_race(probs: Tensor, keys: Tensor) -> Tensor:
    """Per row of ``probs`` (float32 ``[rows, vocab]``, unit stride along the vocabulary), the index of
    ``argmax(probs[i] / exponentials(keys[i], token ids))``: the first largest score, or the first
    NaN where a score is one, as ``argmax`` ranks them. ``keys``: int64 ``[rows]``, the draws' keys
    (``common.engine.seeded_draws.keys_at``). Reads ``probs`` only."""
    unit_stride = probs.dim() == 2 and (probs.shape[1] <= 1 or probs.stride(1) == 1)
    assert unit_stride and probs.dtype == torch.float32, (
        f"probs must be a float32 [rows, vocab] tensor with unit stride along the vocabulary; "
        f"got {probs.dtype} {tuple(probs.shape)}, strides {probs.stride()}"
    )
    num_rows, vocab = probs.shape
    check_index("keys", keys, num_rows, probs.device)
    assert keys.dtype == torch.int64, f"keys must be int64, got {keys.dtype}"
    out = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    if num_rows and vocab:
        block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
        _seeded_race_kernel[(num_rows,)](probs, probs.stride(0), keys, out, vocab, BLOCK=block)
    elif num_rows:
        out.zero_()
    return out
