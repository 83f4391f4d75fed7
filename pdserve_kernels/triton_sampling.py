"""The seeded rows' draw in one Triton kernel: the exponential race, noise and all, in one pass.

A seeded row samples ``argmax(p / E)`` over its probabilities ``p``, with ``E`` Exp(1) noise that is a
pure function of the draw's key and the token id (``common.engine.seeded_draws.exponentials``: splitmix64
from the key, the uniform's top 53 bits, ``-log1p(-u)`` in float64 rounded to float32). In torch that
is two dozen element-wise operations over ``[rows, vocab]``, most of them on int64 or float64
temporaries of that shape (a quarter of a GiB each at 256 rows of a 128k vocabulary), then the
division and an ``argmax``: each a kernel launch and a pass over memory. Here one program per row
(per range of a row, when the rows are too few to fill the GPU; a second small kernel then picks
among the ranges) walks it once: it hashes each token id in registers, divides, and keeps per lane
the first largest score and the first NaN.

The same token as the torch path, bit for bit, but for one case no test can reach: ``-log(1 - u)``
here against ``-log1p(-u)`` there. ``1 - u`` is exact in float64 (``u`` holds 53 bits), so both are
the logarithm of the same number, each within an ulp of float64, and they can round to different
float32 values only when the float64 value lies within an ulp of the midpoint between two float32
values: about once in 2**29 entries, and then it changes the token only if that entry's score was
within a float32 ulp of the row's best. Division is ``div_rn`` (correctly rounded, as torch's), not
Triton's default approximate one. Where ``u`` is 0, once in 2**53 entries, the logarithm is 0 and the
noise is float32's smallest normal number in both (``NOISE_MIN``): an entry of probability 0 scores 0
and cannot win, as in the CPU's race over positive entries alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve_kernels.triton_checks import check_index
from pdserve_kernels.triton_decode import num_sms

MAX_BLOCK = 1024  # token ids per step of a program
MAX_SPLITS = 64  # ranges a row may be cut into (``choose_num_splits``)


@triton.jit
def _mix64(z):
    """splitmix64's output function on uint64 (the constants as in ``common.engine.seeded_draws``)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _seeded_race_kernel(probs_ptr, stride_row, keys_ptr, pos_ptr, out_ptr, part_best_ptr, part_ids_ptr,
                        part_nans_ptr, vocab, span, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                        HAS_POS: tl.constexpr):
    """The race over ids ``[split * span, (split + 1) * span)`` of one row. ``SPLIT`` false: the whole
    row, its token written to ``out``; true: the range's largest score, its first id and its first NaN
    id, for ``_race_reduce_kernel``. ``HAS_POS``: ``keys`` are seeds' keys, and the draw's key is that of
    the row's position (``keys_at``)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * span
    hi = tl.minimum(lo + span, vocab)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    if HAS_POS:
        key = _mix64(key + tl.load(pos_ptr + row).to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)
    lanes = tl.arange(0, BLOCK)
    # Per lane: the largest score seen (-inf before any), its first token id (0 while none beats -inf,
    # as ``argmax`` of a row of -inf gives), and the first token id whose score was NaN (``vocab``: none).
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_ids = tl.zeros([BLOCK], dtype=tl.int32)
    nan_ids = tl.full([BLOCK], vocab, dtype=tl.int32)
    row_ptr = probs_ptr + row.to(tl.int64) * stride_row
    for start in range(lo, hi, BLOCK):
        ids = start + lanes
        valid = ids < hi
        p = tl.load(row_ptr + ids, mask=valid, other=0.0)
        z = _mix64(key + (ids + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        u = (z >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2**-53: a uniform in [0, 1), 53 bits
        # At least float32's smallest normal, as ``exponentials``' noise: at u = 0 the logarithm is 0.
        noise = tl.maximum((-tl.log(1.0 - u)).to(tl.float32), 1.1754943508222875e-38)
        score = tl.math.div_rn(p, noise)
        is_nan = (score != score) & valid
        nan_ids = tl.minimum(nan_ids, tl.where(is_nan, ids, vocab))
        better = (score > best) & valid  # strictly: a lane keeps its first id among equal scores
        best_ids = tl.where(better, ids, best_ids)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    # The lowest id among the lanes holding the range's largest score is the range's first such id.
    first = tl.min(tl.where(best == top, best_ids, vocab), axis=0)
    first_nan = tl.min(nan_ids, axis=0)
    if SPLIT:
        part = row * tl.num_programs(1) + split
        tl.store(part_best_ptr + part, top)
        tl.store(part_ids_ptr + part, first)
        tl.store(part_nans_ptr + part, first_nan)
    else:
        tl.store(out_ptr + row, tl.where(first_nan < vocab, first_nan, first).to(tl.int64))


# One build whatever the ranges per row: ``num_splits`` varies with the seeded rows a step has, and each
# new value (or power of two above it, as a constexpr) would compile another variant inside a step.
@triton.jit(do_not_specialize=["num_splits"])
def _race_reduce_kernel(out_ptr, part_best_ptr, part_ids_ptr, part_nans_ptr, vocab, num_splits,
                        SPLITS_PAD: tl.constexpr):
    """One row's token from its ranges' results: the first NaN id if any, else the first id of the
    largest score (ranges come in id order, so among equal scores the lowest id is the first)."""
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS_PAD)
    mask = offs < num_splits
    base = row * num_splits
    best = tl.load(part_best_ptr + base + offs, mask=mask, other=float("-inf"))
    ids = tl.load(part_ids_ptr + base + offs, mask=mask, other=vocab)
    nans = tl.load(part_nans_ptr + base + offs, mask=mask, other=vocab)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, ids, vocab), axis=0)
    first_nan = tl.min(nans, axis=0)
    tl.store(out_ptr + row, tl.where(first_nan < vocab, first_nan, first).to(tl.int64))


def choose_num_splits(num_rows: int, vocab: int, block: int, sm_count: int) -> int:
    """Ranges each row is cut into: enough programs for about two per SM when the rows alone are too
    few (a small batch: one program per row would leave most of the GPU idle over a 128k-entry row),
    never ranges shorter than a block, never more than ``MAX_SPLITS``."""
    if num_rows == 0 or num_rows >= 2 * sm_count:
        return 1
    return max(1, min(triton.cdiv(2 * sm_count, num_rows), triton.cdiv(vocab, block), MAX_SPLITS))


def seeded_race(probs: Tensor, keys: Tensor, num_splits: int | None = None, positions: Tensor | None = None,
                out: Tensor | None = None) -> Tensor:
    """Per row of ``probs`` (float32 ``[rows, vocab]``, unit stride along the vocabulary), the index of
    ``argmax(probs[i] / exponentials(keys[i], token ids))``: the first largest score, or the first
    NaN where a score is one, as ``argmax`` ranks them. ``keys``: int64 ``[rows]``, the draws' keys
    (``common.engine.seeded_draws.keys_at``); with ``positions`` (int64 ``[rows]``), the seeds' keys
    (``seed_keys``), and each draw's key is ``keys_at(keys, positions)``, derived in the kernel. Reads
    ``probs`` only. ``num_splits``: ranges per row (default: ``choose_num_splits``); with more than one,
    a second kernel picks among the ranges. ``out``: int64 ``[rows]`` (contiguous) to write the indices
    into, returned; by default a new tensor."""
    unit_stride = probs.dim() == 2 and (probs.shape[1] <= 1 or probs.stride(1) == 1)
    assert unit_stride and probs.dtype == torch.float32, (
        f"probs must be a float32 [rows, vocab] tensor with unit stride along the vocabulary; "
        f"got {probs.dtype} {tuple(probs.shape)}, strides {probs.stride()}"
    )
    num_rows, vocab = probs.shape
    check_index("keys", keys, num_rows, probs.device)
    assert keys.dtype == torch.int64, f"keys must be int64, got {keys.dtype}"
    if positions is not None:
        check_index("positions", positions, num_rows, probs.device)
        assert positions.dtype == torch.int64, f"positions must be int64, got {positions.dtype}"
    pos = keys if positions is None else positions  # read only with positions
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    assert out.shape == (num_rows,) and out.dtype == torch.int64 and out.is_contiguous(), (out.shape, out.dtype)
    if not num_rows:
        return out
    if not vocab:
        return out.zero_()
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, vocab, block, num_sms(probs.device))
    span = triton.cdiv(triton.cdiv(vocab, max(1, min(num_splits, MAX_SPLITS))), block) * block  # whole blocks
    num_splits = triton.cdiv(vocab, span)  # no empty range
    if num_splits == 1:
        _seeded_race_kernel[(num_rows, 1)](probs, probs.stride(0), keys, pos, out, out, out, out, vocab, span,
                                           BLOCK=block, SPLIT=False, HAS_POS=positions is not None)
        return out
    best = torch.empty(num_rows, num_splits, dtype=torch.float32, device=probs.device)
    ids = torch.empty(num_rows, num_splits, dtype=torch.int32, device=probs.device)
    nans = torch.empty_like(ids)
    _seeded_race_kernel[(num_rows, num_splits)](probs, probs.stride(0), keys, pos, out, best, ids, nans, vocab,
                                                span, BLOCK=block, SPLIT=True, HAS_POS=positions is not None)
    _race_reduce_kernel[(num_rows,)](out, best, ids, nans, vocab, num_splits, SPLITS_PAD=MAX_SPLITS)
    return out


def noise_probes(noise: Tensor) -> list[tuple[Tensor, int]]:
    """For checking ``seeded_race`` (the tests, ``pdserve bench gpu``): rows of "probabilities" made of
    the reference noise ``E`` (``[rows, vocab]``), each with the token it must draw iff the kernel's
    noise is ``E`` bit for bit. p = E: every score is exactly 1, so an entry whose noise came out
    smaller scores above 1 and wins: anything but the first id means a difference. p = -E catches a
    larger noise the same way (-1 is then the largest score: a probe, not a probability). The first id
    would hide its own difference there, so two more rows have it a float32 ulp short of a tie (it
    loses to id 1 unless its noise differs in the direction that probe catches)."""
    low, high = torch.tensor(float("-inf")), torch.tensor(float("inf"))
    first_low, first_high = noise.clone(), -noise
    first_low[:, 0] = torch.nextafter(noise[:, 0], low)
    first_high[:, 0] = -torch.nextafter(noise[:, 0], high)
    return [(noise.clone(), 0), (-noise, 0), (first_low, 1), (first_high, 1)]
