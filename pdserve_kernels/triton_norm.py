"""RMSNorm in Triton: one kernel per call where the torch formula is eight operations (a cast, the
square, the mean, the epsilon, the reciprocal square root, two products and a cast back), each a
launch the host pays for on every layer of a forward that runs eagerly (prefill steps, and
``--enforce-eager``). ``add_rms_norm`` adds a block's output to the residual stream in the same
kernel (the sum rounded to the dtype, as torch's addition rounds it, then normalized), one launch
where there were two, in a CUDA graph's replay too.

The arithmetic is the reference's (``pdserve_kernels.reference.rms_norm``, transformers' own): the
mean of squares in float32, the row scaled by its reciprocal square root, rounded to the input's
dtype, then multiplied by the weight and rounded again (Gemma: scaled by ``1 + weight`` in float32,
rounded once; OLMo: by the weight in float32, rounded once). Cohere's LayerNorm (``NORM_LAYER``) first
centres the row on its mean (one more pass over it) and meets the weight in float32, rounded once;
torch's LayerNorm (StarCoder2's) is that form with a bias, added in float32 before the rounding. What
can differ is the order in which the squares (and the entries, for the mean) are summed, and with it the
last bits of the float32 mean: a difference that the rounding to 16 bits seldom lets through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve_kernels.reference import NORM_GEMMA, NORM_LAYER, NORM_LLAMA, NORM_OLMO

assert (NORM_LLAMA, NORM_GEMMA, NORM_OLMO, NORM_LAYER) == (0, 1, 2, 3), "the kernel's FORM branches name these values"

MAX_BLOCK = 4096  # entries of a row a program holds at once; wider rows go in several passes


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, stride_x_row, stride_r_row, stride_o_row,
                     stride_s_row, n_cols, w_rows, eps, FORM: tl.constexpr, ADD: tl.constexpr, BIAS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """With ``ADD``, the row normalized is ``x + r`` (rounded to the dtype), written to ``sum`` first;
    the second pass reads it back from there (the same lanes the first pass wrote it with). The weight
    has ``w_rows`` rows, row ``i`` of ``x`` met with row ``i % w_rows`` (a weight per head: Cohere's q/k norms).
    With ``BIAS`` (the LayerNorm form only) the bias is added in float32 before the one rounding."""
    row = tl.program_id(0).to(tl.int64)
    w_row = w_ptr + (row % w_rows) * n_cols
    x_row = x_ptr + row * stride_x_row
    o_row = out_ptr + row * stride_o_row
    offs = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], dtype=tl.float32)  # the entries' squares; for NORM_LAYER, the entries
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        if ADD:
            r = tl.load(r_ptr + row * stride_r_row + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * stride_s_row + cols, x, mask=mask)
        h = x.to(tl.float32)
        squares += h if FORM == 3 else h * h
    if ADD:
        tl.debug_barrier()
        x_row = sum_ptr + row * stride_s_row
    mean = 0.0
    if FORM == 3:  # NORM_LAYER: the mean, then the centred squares in a pass of their own
        mean = tl.sum(squares, axis=0) / n_cols
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            mask = cols < n_cols
            h = tl.where(mask, tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
            squares += h * h
    scale = tl.math.rsqrt(tl.sum(squares, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) - mean) * scale
        w = tl.load(w_row + cols, mask=mask, other=0.0).to(tl.float32)
        if FORM == 1:  # NORM_GEMMA
            y = h * (1.0 + w)
        elif FORM == 2 or FORM == 3:  # NORM_OLMO, NORM_LAYER
            y = w * h
            if BIAS:
                y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            y = w * h.to(x.dtype).to(tl.float32)  # rounded to the input's dtype first, as transformers
        tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, form: int = NORM_LLAMA, bias: Tensor | None = None) -> Tensor:
    """``pdserve_kernels.reference.rms_norm`` in one kernel: ``x`` ``[..., n]`` (rows with unit stride),
    ``weight`` ``[n]`` of ``x``'s dtype, or ``[heads, n]`` for ``x`` ``[..., heads, n]`` (one per head);
    ``bias`` ``[n]`` (the LayerNorm form)."""
    rows, out = _rows_and_out(x, weight, form, bias)
    if rows.shape[0] and rows.shape[1]:
        block = min(MAX_BLOCK, triton.next_power_of_2(rows.shape[1]))
        # ``r`` and ``sum`` are not read without ``ADD``, nor ``b`` without ``BIAS``: the input stands in.
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, rows if bias is None else bias, out, rows,
                                           rows.stride(0), 0, out.stride(0), 0, rows.shape[1],
                                           weight.numel() // rows.shape[1], eps, FORM=form, ADD=False,
                                           BIAS=bias is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, form: int = NORM_LLAMA,
                 bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``pdserve_kernels.reference.add_rms_norm`` in one kernel: ``(rms_norm(x + residual), x + residual)``,
    ``x`` and ``residual`` of one shape and dtype (rows with unit stride)."""
    assert residual.shape == x.shape and residual.dtype == x.dtype, (
        f"residual {residual.dtype} {tuple(residual.shape)} differs from x {x.dtype} {tuple(x.shape)}")
    rows, out = _rows_and_out(x, weight, form, bias)
    res_rows = residual.reshape(rows.shape)
    assert res_rows.stride(-1) == 1 or rows.shape[1] <= 1, f"residual rows must have unit stride; got {residual.stride()}"
    summed = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] and rows.shape[1]:
        block = min(MAX_BLOCK, triton.next_power_of_2(rows.shape[1]))
        _rms_norm_kernel[(rows.shape[0],)](rows, res_rows, weight, rows if bias is None else bias, out, summed,
                                           rows.stride(0), res_rows.stride(0), out.stride(0), summed.stride(0),
                                           rows.shape[1], weight.numel() // rows.shape[1], eps, FORM=form, ADD=True,
                                           BIAS=bias is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape), summed.view(x.shape)


def _rows_and_out(x: Tensor, weight: Tensor, form: int, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``x``'s rows (``[rows, n]``, a view where it can be) and an output of their shape, after checking."""
    n = x.shape[-1]
    assert bias is None or (form == NORM_LAYER and bias.shape == (n,) and bias.dtype == x.dtype
                            and bias.is_contiguous()), "a bias is the LayerNorm form's, contiguous, [n], of x's dtype"
    assert (weight.shape == (n,) or (weight.dim() == 2 and tuple(weight.shape) == tuple(x.shape[-2:]))) and (
        weight.is_contiguous()), f"weight must be a contiguous [{n}] or [heads, {n}] tensor; got {tuple(weight.shape)}"
    assert weight.dtype == x.dtype, f"weight's dtype {weight.dtype} differs from the input's {x.dtype}"
    assert x.stride(-1) == 1 or n <= 1, f"rows must have unit stride; got strides {x.stride()}"
    rows = x.reshape(-1, n)  # a view for a contiguous input, and for a row slice of one
    return rows, torch.empty(rows.shape, dtype=x.dtype, device=x.device)
