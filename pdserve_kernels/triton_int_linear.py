"""A product with packed integer weights (GPTQ, AWQ, compressed-tensors' W4A16 / W8A16) that widens them tile by
tile as it reads them, so the weights stay 2, 4 or 8 bits a value in memory and on the way to the tensor cores.

``int_linear`` computes ``pdserve_kernels.reference.int_linear``: each program holds a ``BLOCK_M x BLOCK_N`` tile
of the output and walks the inputs ``BLOCK_K`` at a time. For each step it loads the tile's words (``32 / BITS``
values each), shifts each value out, takes away its group's zero point and multiplies by its group's scale in
float32, rounded once to the scales' dtype (the widened weight's arithmetic: the difference is exact, and so is
the product of two 16-bit floats in float32), then to the activations' dtype, and multiplies as any product does,
accumulating in float32. The output is rounded once, after the bias is added.

A decode step's few rows take a tile of 16 rows; the weights are read once per column tile. The tile sizes are
fixed, not tuned per GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve_kernels.triton_common import dot, dot_constexprs, rounded_to


@triton.jit
def _int_linear_kernel(
    x_ptr, w_ptr, z_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K, num_groups,
    stride_x, stride_w, stride_zs, stride_out,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WIDEN_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``out[m, n] = sum_k x[m, k] * ((q[n, k] - z[n, g(k)]) * s[n, g(k)]) (+ bias[n])``, ``g(k) = k // GROUP``."""
    PER_WORD: tl.constexpr = 32 // BITS
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        wk_mask = k_mask[:, None] & n_mask[None, :]
        # [BLOCK_K, BLOCK_N]: input k of output n, from its word and its place in the word.
        words = tl.load(w_ptr + cols[None, :] * stride_w + (offs_k // PER_WORD)[:, None], mask=wk_mask, other=0)
        q = (words >> ((offs_k % PER_WORD) * BITS)[:, None]) & ((1 << BITS) - 1)
        group = offs_k // GROUP
        zs = cols[None, :] * stride_zs + group[:, None]
        zero = tl.load(z_ptr + zs, mask=wk_mask, other=0).to(tl.int32)
        scale = tl.load(s_ptr + zs, mask=wk_mask, other=0.0)
        w = rounded_to((q - zero).to(tl.float32) * scale.to(tl.float32), scale.dtype).to(a.dtype)
        acc += dot(a, w, WIDEN_DOT, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], rounded_to(acc, out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def int_linear(x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, bits: int,
               bias: Tensor | None = None) -> Tensor:
    """``pdserve_kernels.reference.int_linear`` in one kernel (see the module's docstring)."""
    out_features, words = qweight.shape
    in_features = words * (32 // bits)
    num_groups = scales.shape[1]
    assert x.shape[-1] == in_features and in_features % num_groups == 0, "inputs must be whole groups"
    assert qzeros.shape == scales.shape and scales.shape[0] == out_features and qweight.dtype == torch.int32
    assert qweight.stride(-1) == 1 and qzeros.stride() == scales.stride() and scales.stride(-1) == 1
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], out_features), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        group = in_features // num_groups
        block_m = 16 if rows.shape[0] <= 16 else 32 if rows.shape[0] <= 32 else 64
        block_n, block_k = 64, 32
        grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(out_features, block_n))
        _int_linear_kernel[grid](
            rows, qweight, qzeros, scales, bias if bias is not None else out, out,
            rows.shape[0], out_features, in_features, num_groups,
            rows.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
            BITS=bits, GROUP=group, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot_constexprs(x.dtype, x.device),
        )
    return out.reshape(*x.shape[:-1], out_features)
