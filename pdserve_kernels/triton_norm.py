"""RMSNorm in Triton: one kernel per call where the torch formula is eight operations (a cast, the
square, the mean, the epsilon, the reciprocal square root, two products and a cast back), each a
launch the host pays for on every layer of a forward that runs eagerly (prefill steps, and
``--enforce-eager``).

The arithmetic is the reference's (``pdserve_kernels.reference.rms_norm``, transformers' own): the
mean of squares in float32, the row scaled by its reciprocal square root, rounded to the input's
dtype, then multiplied by the weight and rounded again (Gemma: scaled by ``1 + weight`` in float32,
rounded once). What can differ is the order in which the squares are summed, and with it the last
bits of the float32 mean: a difference that the rounding to 16 bits seldom lets through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_BLOCK = 4096  # entries of a row a program holds at once; wider rows go in several passes


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x_row, stride_o_row, n_cols, eps,
                     GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_row
    o_row = out_ptr + row * stride_o_row
    offs = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        h = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        squares += h * h
    scale = tl.math.rsqrt(tl.sum(squares, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        h = x.to(tl.float32) * scale
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if GEMMA:
            y = h * (1.0 + w)
        else:
            y = w * h.to(x.dtype).to(tl.float32)  # rounded to the input's dtype first, as transformers
        tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, gemma: bool = False) -> Tensor:
    """``pdserve_kernels.reference.rms_norm`` in one kernel: ``x`` ``[..., n]`` (rows with unit stride),
    ``weight`` ``[n]`` of ``x``'s dtype."""
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), (
        f"weight must be a contiguous [{n}] tensor; got {tuple(weight.shape)}")
    assert weight.dtype == x.dtype, f"weight's dtype {weight.dtype} differs from the input's {x.dtype}"
    assert x.stride(-1) == 1 or n <= 1, f"rows must have unit stride; got strides {x.stride()}"
    rows = x.reshape(-1, n)  # a view for a contiguous input, and for a row slice of one
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] and n:
        block = min(MAX_BLOCK, triton.next_power_of_2(n))
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, eps,
                                           GEMMA=gemma, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)
