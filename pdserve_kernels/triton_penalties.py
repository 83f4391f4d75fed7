"""The repetition, presence and frequency penalties of a group of rows in one Triton kernel.

The penalties read each request's distinct tokens (and, for frequency, their counts) from the
sampler's stores (``common.engine.penalties.TokenRows``), where torch took a dozen and more operations
(gathers, the arithmetic, scatters, and the windows of the stores), each a launch the host pays for.
One program per penalised row:

* the repetition penalty over the row's distinct prompt and output tokens: a positive logit divided
  by the penalty, another multiplied (transformers' rule);
* then, over the distinct tokens it has output, ``frequency * count + presence`` subtracted.

The arithmetic is the reference's (``common.engine.penalties``), rounding for rounding: the division
is correctly rounded (``div_rn``), and nothing is fused into a multiply-add. Each token is distinct
within its row, so a program's reads and writes of a logit never overlap but across the two passes,
between which its threads synchronise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 256  # tokens of a row a program reads at once; more go in several passes


@triton.jit
def _penalties_kernel(x_ptr, stride_x, rows_ptr, rep_k_ptr, out_k_ptr,
                      rep_ids_ptr, stride_rep, rep_slots_ptr, rep_lens_ptr, rep_penalty_ptr,
                      out_ids_ptr, out_counts_ptr, stride_out, out_slots_ptr, out_lens_ptr, frequency_ptr,
                      presence_ptr, HAS_REP: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    x_row = x_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    if HAS_REP:
        k = tl.load(rep_k_ptr + i)
        if k >= 0:
            n = tl.load(rep_lens_ptr + k)
            penalty = tl.load(rep_penalty_ptr + k)
            ids_row = rep_ids_ptr + tl.load(rep_slots_ptr + k).to(tl.int64) * stride_rep
            for start in range(0, n, BLOCK):
                cols = start + offs
                mask = cols < n
                token = tl.load(ids_row + cols, mask=mask, other=0)
                v = tl.load(x_row + token, mask=mask, other=0.0)
                v = tl.where(v > 0, tl.math.div_rn(v, penalty), v * penalty)
                tl.store(x_row + token, v, mask=mask)
    if HAS_REP and HAS_OUT:
        tl.debug_barrier()  # the repetition penalty's writes, seen by every thread of the program
    if HAS_OUT:
        k = tl.load(out_k_ptr + i)
        if k >= 0:
            n = tl.load(out_lens_ptr + k)
            frequency = tl.load(frequency_ptr + k)
            presence = tl.load(presence_ptr + k)
            slot = tl.load(out_slots_ptr + k).to(tl.int64)
            ids_row = out_ids_ptr + slot * stride_out
            counts_row = out_counts_ptr + slot * stride_out
            for start in range(0, n, BLOCK):
                cols = start + offs
                mask = cols < n
                token = tl.load(ids_row + cols, mask=mask, other=0)
                count = tl.load(counts_row + cols, mask=mask, other=0).to(tl.float32)
                v = tl.load(x_row + token, mask=mask, other=0.0)
                tl.store(x_row + token, v - (frequency * count + presence), mask=mask)


def apply_penalties(
    x: Tensor, rows: Tensor, rep: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None,
    out: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor] | None,
) -> None:
    """In place over float32 ``x`` ``[num_rows, vocab]``: program ``i`` penalises row ``rows[i]``.

    ``rep``: ``(k, ids, slots, lens, penalty)``: program ``i``'s repetition penalty is entry ``k[i]`` of
    ``slots`` (its row of the store ``ids``), ``lens`` (its number of distinct tokens) and ``penalty``;
    none where ``k[i]`` is -1. ``out``: ``(k, ids, counts, slots, lens, frequency, presence)``, the same
    for presence and frequency. The ``k`` are int32 ``[len(rows)]``, the stores' rows unit-strided."""
    num_programs = rows.shape[0]
    if not num_programs or (rep is None and out is None):
        return
    assert x.dtype == torch.float32 and x.stride(-1) == 1, (x.dtype, x.stride())
    # A penalty the group does not have: its arguments stand in by tensors at hand, never read.
    rep_k, rep_ids, rep_slots, rep_lens, penalty = rep if rep is not None else (rows, rows, rows, rows, x)
    out_k, out_ids, out_counts, out_slots, out_lens, frequency, presence = out if out is not None else (
        rows, rows, rows, rows, rows, x, x)
    assert out_ids.stride() == out_counts.stride() and rep_ids.stride(-1) == 1 and out_ids.stride(-1) == 1
    _penalties_kernel[(num_programs,)](
        x, x.stride(0), rows, rep_k, out_k,
        rep_ids, rep_ids.stride(0) if rep_ids.dim() == 2 else 0, rep_slots, rep_lens, penalty,
        out_ids, out_counts, out_ids.stride(0) if out_ids.dim() == 2 else 0, out_slots, out_lens, frequency, presence,
        HAS_REP=rep is not None, HAS_OUT=out is not None, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False,
    )
