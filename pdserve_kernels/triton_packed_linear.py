"""Products with weights that stay quantized in memory, widened tile by tile as the kernel reads them: packed
integer weights (GPTQ, AWQ, compressed-tensors' W4A16 / W8A16: 2, 4 or 8 bits a value, a zero point and a scale per
group of inputs) and block-wise FP8 weights (e4m3, a scale per block: Qwen's, DeepSeek's, Mistral's FP8 releases).

``int_linear`` computes ``pdserve_kernels.reference.int_linear`` and ``fp8_linear`` ``reference.fp8_linear``, with
one kernel: each program holds a ``BLOCK_M x BLOCK_N`` tile of the output and walks the inputs ``BLOCK_K`` at a
time. For each step it loads the tile's weights and widens them as the checkpoint's dequantization does: an integer
value shifted out of its word, less its group's zero point, times its group's scale in float32, rounded once to the
scales' dtype (the difference is exact, and so is the product of two 16-bit floats in float32); an FP8 value times
its block's scale in float32. Either is then rounded to the activations' dtype (as the widened weight is), and
multiplied as any product, the sums in float32. The output is rounded once, after the bias is added.

A decode step's few rows take a tile of 16 rows, and so few output tiles would leave most of a GPU idle: their
inputs are then split among several programs (``splits_for``), each summing its part in float32, and the parts
are added (then the bias, then one rounding) after. The tile sizes are fixed, not tuned per GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve_kernels.triton_common import dot, dot_constexprs, rounded_to


@triton.jit
def widened_tile(w_ptr, z_ptr, s_ptr, cols, offs_k, group, mask, stride_w, stride_s, dtype: tl.constexpr,
                 FP8: tl.constexpr, MXFP4: tl.constexpr, BITS: tl.constexpr, SCALE_ROWS: tl.constexpr):
    """``[BLOCK_K, BLOCK_N]``: the weight of input ``offs_k`` (in group ``group``) to output ``cols``, in ``dtype``, as
    the checkpoint widens it (see ``_widening_linear_kernel``); ``mask``'s entries 0. ``w_ptr``, ``z_ptr`` and ``s_ptr``
    point at one matrix's values, zero points and scales (rows ``stride_w`` and ``stride_s`` apart). ``MXFP4``: two
    e2m1 values a byte (the low four bits first), times the group's power of two ``2 ** (s - 127)`` (a byte), in
    float32, rounded once (``pdserve_kernels.packed_weights.widen_mxfp4``)."""
    if MXFP4:
        byte = tl.load(w_ptr + cols[None, :] * stride_w + (offs_k // 2)[:, None], mask=mask, other=0).to(tl.int32)
        code = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
        # e2m1 in halves: exponent 0, the mantissa bit (0 or 0.5); else (2 + mantissa) * 2 ** (exponent - 1).
        exponent = (code >> 1) & 3
        halves = tl.where(exponent == 0, code & 1, (2 + (code & 1)) << tl.maximum(exponent - 1, 0))
        value = tl.where(code >= 8, -0.5, 0.5) * halves.to(tl.float32)
        e8m0 = tl.load(s_ptr + cols[None, :] * stride_s + group[:, None], mask=mask, other=127).to(tl.int32)
        # 2 ** (s - 127) from its bits; 2 ** -127, a subnormal, as 2 ** -64 then 2 ** -63 (the first product exact).
        power = tl.where(e8m0 == 0, 2.0**-64, (e8m0 << 23).to(tl.float32, bitcast=True))
        product = value * power
        w = rounded_to(tl.where(e8m0 == 0, product * 2.0**-63, product), dtype)
    elif FP8:
        value = tl.load(w_ptr + cols[None, :] * stride_w + offs_k[:, None], mask=mask, other=0.0)
        scale = tl.load(s_ptr + (cols // SCALE_ROWS)[None, :] * stride_s + group[:, None], mask=mask, other=0.0)
        w = rounded_to(value.to(tl.float32) * scale.to(tl.float32), dtype)
    else:
        PER_WORD: tl.constexpr = 32 // BITS
        words = tl.load(w_ptr + cols[None, :] * stride_w + (offs_k // PER_WORD)[:, None], mask=mask, other=0)
        q = (words >> ((offs_k % PER_WORD) * BITS)[:, None]) & ((1 << BITS) - 1)
        zs = cols[None, :] * stride_s + group[:, None]
        zero = tl.load(z_ptr + zs, mask=mask, other=0).to(tl.int32)
        scale = tl.load(s_ptr + zs, mask=mask, other=0.0)
        w = rounded_to((q - zero).to(tl.float32) * scale.to(tl.float32), scale.dtype)
        if scale.dtype != dtype:  # float16 scales, bfloat16 activations: rounded to the nearest again
            w = rounded_to(w.to(tl.float32), dtype)
    return w


@triton.jit
def _widening_linear_kernel(
    x_ptr, w_ptr, z_ptr, s_ptr, g_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_x, stride_w, stride_s, stride_out, stride_split,
    FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, G_IDX: tl.constexpr, SCALE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WIDEN_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])`` over the inputs ``[split * k_per_split, (split + 1) *
    k_per_split)`` of program axis 2's ``split``: the whole sum rounded to ``out``'s dtype where there is one split,
    else this split's float32 sum at ``out + split * stride_split``. ``w[n, k]``: with ``FP8``, ``w_ptr``'s e4m3 value
    times ``s[n // SCALE_ROWS, k // GROUP]``; else ``(q[n, k] - z[n, g(k)]) * s[n, g(k)]``, ``q`` of ``BITS`` each,
    ``32 / BITS`` to an int32 word of ``w_ptr`` (the lowest bits first), ``g(k)`` ``k // GROUP``, or with ``G_IDX``
    ``g_ptr[k]`` (groups out of order: GPTQ's ``desc_act``)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        wk_mask = k_mask[:, None] & n_mask[None, :]
        if G_IDX:
            group = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
        else:
            group = offs_k // GROUP
        w = widened_tile(w_ptr, z_ptr, s_ptr, cols, offs_k, group, wk_mask, stride_w, stride_s, a.dtype,
                         FP8, False, BITS, SCALE_ROWS)
        acc += dot(a, w, WIDEN_DOT, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + split.to(tl.int64) * stride_split + rows[:, None] * stride_out + offs_n[None, :],
             rounded_to(acc, out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# Programs a launch aims for at least, splitting the inputs among more of them where its output tiles are fewer
# (a decode step's few rows): about two per multiprocessor of an H100 or H200.
_TARGET_PROGRAMS = 256
_BLOCK_N, _BLOCK_K = 64, 32


def splits_for(rows: int, out_features: int, in_features: int, block_m: int) -> int:
    """How many parts a product's inputs are summed in: enough for ``_TARGET_PROGRAMS`` programs, each part at
    least 8 steps of ``_BLOCK_K`` inputs."""
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(out_features, _BLOCK_N)
    return max(1, min(_TARGET_PROGRAMS // tiles, triton.cdiv(in_features, _BLOCK_K) // 8))


def _launch(x: Tensor, out_features: int, in_features: int, weights: Tensor, zeros: Tensor | None, scales: Tensor,
            bias: Tensor | None, splits: int | None, g_idx: Tensor | None = None, **mode: int) -> Tensor:
    """The product of ``x`` with the weights that ``mode`` says how to widen (``_widening_linear_kernel``)."""
    assert x.shape[-1] == in_features, f"{x.shape[-1]} inputs, the weights take {in_features}"
    assert weights.stride(-1) == 1 and scales.stride(-1) == 1 and (zeros is None or zeros.stride() == scales.stride())
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if not num_rows:
        return out.reshape(*x.shape[:-1], out_features)
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    splits = splits or splits_for(num_rows, out_features, in_features, block_m)
    # Each part whole steps of _BLOCK_K inputs, so that no step straddles two parts.
    k_per_split = triton.cdiv(triton.cdiv(in_features, _BLOCK_K), splits) * _BLOCK_K
    splits = triton.cdiv(in_features, k_per_split)
    partial = out if splits == 1 else torch.empty((splits, num_rows, out_features), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, _BLOCK_N), splits)
    _widening_linear_kernel[grid](
        rows, weights, zeros if zeros is not None else scales, scales, g_idx if g_idx is not None else scales,
        bias if bias is not None and splits == 1 else partial, partial,
        num_rows, out_features, in_features, k_per_split,
        rows.stride(0), weights.stride(0), scales.stride(0), partial.stride(-2), partial.stride(0) if splits > 1 else 0,
        HAS_BIAS=bias is not None and splits == 1, G_IDX=g_idx is not None,
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, **dot_constexprs(x.dtype, x.device), **mode,
    )
    if splits > 1:
        total = partial.sum(0)
        if bias is not None:
            total += bias.float()
        out.copy_(total)  # rounded once, to the nearest
    return out.reshape(*x.shape[:-1], out_features)


def int_linear(x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, bits: int,
               bias: Tensor | None = None, g_idx: Tensor | None = None, splits: int | None = None) -> Tensor:
    """``pdserve_kernels.reference.int_linear`` (see the module's docstring); ``splits``: the parts the inputs are
    summed in (``splits_for``'s by default), their float32 sums added, the bias after, then rounded once."""
    out_features, words = qweight.shape
    in_features = words * (32 // bits)
    assert qweight.dtype == torch.int32 and qzeros.shape == scales.shape and scales.shape[0] == out_features
    assert g_idx is not None or in_features % scales.shape[1] == 0, "inputs must be whole groups"
    assert g_idx is None or (g_idx.shape == (in_features,) and g_idx.dtype == torch.int32)
    return _launch(x, out_features, in_features, qweight, qzeros, scales, bias, splits, g_idx,
                   FP8=False, BITS=bits, GROUP=max(1, in_features // scales.shape[1]), SCALE_ROWS=1)


def fp8_linear(x: Tensor, weight: Tensor, scale_inv: Tensor, bias: Tensor | None = None,
               splits: int | None = None) -> Tensor:
    """``pdserve_kernels.reference.fp8_linear`` (see the module's docstring); ``splits`` as ``int_linear``'s."""
    out_features, in_features = weight.shape
    assert weight.dtype == torch.float8_e4m3fn and scale_inv.dim() == 2
    assert out_features % scale_inv.shape[0] == 0 and in_features % scale_inv.shape[1] == 0, "whole blocks"
    return _launch(x, out_features, in_features, weight, None, scale_inv, bias, splits, None,
                   FP8=True, BITS=8, GROUP=in_features // scale_inv.shape[1],
                   SCALE_ROWS=out_features // scale_inv.shape[0])
