"""A mixture of experts' experts in Triton: one grouped matrix product per projection over every expert
a step's tokens chose, where the torch reference loops over the experts hit, one product each.

``moe_experts`` computes ``pdserve_kernels.reference.moe_experts``. Each (token, slot) pair, that is each
token's k chosen experts, is one row of the work:

1. The pairs are grouped by expert and each group padded to a whole number of ``BLOCK_M`` rows
   (``align_pairs``): a table of pair ids in that order, and the expert of each ``BLOCK_M`` rows. This is
   done with device operations only (a sort, a scatter-add, cumulative sums, a search): no count comes
   back to the host, so a CUDA graph can hold it, and its sizes depend on the number of tokens alone.
2. ``_moe_matmul_kernel`` multiplies each tile of rows by its expert's weight: first the tokens by the
   stacked gate/up (``[E, 2I, H]``), then, after ``silu_mul``, each pair's activation by the down
   projection (``[E, H, I]``), its output rounded to the dtype and times the pair's routing weight.
3. ``_moe_sum_kernel`` adds a token's k terms in ascending expert order, each sum rounded, as
   transformers' loop adds them (its slots are sorted by expert before step 1): one launch where torch
   would take k - 1 additions.

Rows past a group's end (padding) are masked; a tile whose rows are all padding beyond the last group
does nothing. The tile sizes are fixed, not tuned per GPU.

Either projection's weights may stay quantized in memory (``pdserve_kernels.packed_weights``: a GPTQ, AWQ,
compressed-tensors, block-wise FP8 or MXFP4 checkpoint's experts): step 2 then widens each tile of the expert's weights as
it reads it, as ``triton_packed_linear`` does a dense projection's, so the product is the one with the weights the
checkpoint widens to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve_kernels.packed_weights import (
    MXFP4_GROUP,
    ExpertWeights,
    Fp8Weights,
    IntWeights,
    Mxfp4Weights,
    expert_count,
)
from pdserve_kernels.reference import gpt_oss_swiglu
from pdserve_kernels.triton_act import silu_mul
from pdserve_kernels.triton_common import dot, dot_constexprs
from pdserve_kernels.triton_packed_linear import widened_tile


@triton.jit
def _moe_matmul_kernel(
    a_ptr, w_ptr, z_ptr, s_ptr, c_ptr, pairs_ptr, block_expert_ptr, weight_ptr, bias_ptr,
    num_pairs, num_experts, N, K,
    stride_a_row, stride_w_expert, stride_w_n, stride_w_k, stride_s_expert, stride_s_n, stride_c_row,
    stride_bias_expert,
    TOP_K: tl.constexpr, A_ROW_IS_PAIR: tl.constexpr, WEIGHTED: tl.constexpr, HAS_BIAS: tl.constexpr,
    PACKED: tl.constexpr, FP8: tl.constexpr, MXFP4: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WIDEN_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``c[pair, n] = sum_k a[row(pair), k] * w[expert, n, k]`` for the pairs of one tile, all of one
    expert; ``row(pair)`` is the pair's token (``pair // TOP_K``) or the pair itself. With ``PACKED``, the
    expert's weights stay quantized (``z_ptr`` and ``s_ptr`` its zero points and scales, with ``FP8`` its blocks'
    scales, with ``MXFP4`` its groups' exponents) and each tile is widened as it is read
    (``triton_packed_linear.widened_tile``), groups of ``GROUP`` inputs (``SCALE_ROWS`` outputs to an FP8 block)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < num_experts:  # else a tile past the last group
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pairs_ptr + offs_m).to(tl.int64)
        valid = pairs < num_pairs
        if A_ROW_IS_PAIR:
            rows = pairs
        else:
            rows = pairs // TOP_K
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_base = w_ptr + expert * stride_w_expert
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * stride_a_row + offs_k[None, :],
                        mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
            b_mask = (offs_n[None, :] < N) & (offs_k[:, None] < K)
            if PACKED:
                s_base = expert * stride_s_expert
                b = widened_tile(w_base, z_ptr + s_base, s_ptr + s_base, offs_n, offs_k, offs_k // GROUP, b_mask,
                                 stride_w_n, stride_s_n, a.dtype, FP8, MXFP4, BITS, SCALE_ROWS)
            else:
                b = tl.load(w_base + offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_k, mask=b_mask,
                            other=0.0)
            acc += dot(a, b, WIDEN_DOT, DOT_PRECISION)
        out = acc.to(c_ptr.dtype.element_ty)  # the product rounded to the dtype, as F.linear's output
        if HAS_BIAS:  # gpt-oss: the expert's bias added, rounded again (as transformers adds it)
            bias = tl.load(bias_ptr + expert * stride_bias_expert + offs_n, mask=offs_n < N, other=0.0)
            out = (out.to(tl.float32) + bias.to(tl.float32)[None, :]).to(c_ptr.dtype.element_ty)
        if WEIGHTED:  # times the pair's routing weight (float32 or the dtype: exact in float32), rounded
            weight = tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) * weight[:, None]).to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + pairs[:, None] * stride_c_row + offs_n[None, :], out,
                 mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def _moe_sum_kernel(terms_ptr, out_ptr, stride_t_token, stride_t_slot, stride_o_token, N,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t] = terms[t, 0] + terms[t, 1] + ...``, in slot order, each sum rounded to the dtype."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    row = terms_ptr + token * stride_t_token + cols
    acc = tl.load(row, mask=mask, other=0.0)
    for slot in tl.static_range(1, TOP_K):
        term = tl.load(row + slot * stride_t_slot, mask=mask, other=0.0)
        acc = (acc.to(tl.float32) + term.to(tl.float32)).to(terms_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_o_token + cols, acc, mask=mask)


def align_pairs(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """The pairs (``token * k + slot``) grouped by expert, each group padded to whole ``block_m`` tiles
    with the id ``T * k`` (no pair), and each tile's expert (``num_experts``: a tile past the last group).
    Sizes depend on ``T``, ``k``, ``num_experts`` and ``block_m`` only; nothing is read back to the host."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=flat.dtype, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    # Where each expert's group starts among the padded tiles, less where it starts among the pairs.
    shift = padded_end - padded - torch.cumsum(counts, 0) + counts
    slots = shift[flat[order]] + torch.arange(num_pairs, device=device)
    # At most one partly filled tile per expert that has pairs.
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pairs[slots] = order.to(torch.int32)
    starts = torch.arange(0, num_blocks * block_m, block_m, device=device, dtype=padded_end.dtype)
    return pairs, torch.searchsorted(padded_end, starts, right=True, out_int32=True)


# The kernel's constants for weights as they are (a packed form's override some).
_PLAIN = {"PACKED": False, "FP8": False, "MXFP4": False, "BITS": 8, "GROUP": 1, "SCALE_ROWS": 1}


def _operands(w: ExpertWeights) -> tuple[Tensor, Tensor | None, Tensor | None, int, int, dict[str, int]]:
    """The tensors ``_moe_matmul_kernel`` reads for stacked weights (values, zero points, scales), their outputs and
    inputs per expert, and how to widen them."""
    if isinstance(w, IntWeights):
        k = w.qweight.shape[2] * 32 // w.bits
        assert w.qweight.dtype == torch.int32 and w.qzeros.shape == w.scales.shape and k % w.scales.shape[2] == 0
        assert w.qzeros.stride() == w.scales.stride(), "zero points and scales must share their layout"
        mode = {"PACKED": True, "BITS": w.bits, "GROUP": k // w.scales.shape[2]}
        return w.qweight, w.qzeros, w.scales, w.qweight.shape[1], k, {**_PLAIN, **mode}
    if isinstance(w, Fp8Weights):
        _, n, k = w.weight.shape
        grid = w.scale_inv.shape[1:]
        assert w.weight.dtype == torch.float8_e4m3fn and n % grid[0] == 0 and k % grid[1] == 0, "whole blocks"
        mode = {"PACKED": True, "FP8": True, "GROUP": k // grid[1], "SCALE_ROWS": n // grid[0]}
        return w.weight, None, w.scale_inv, n, k, {**_PLAIN, **mode}
    if isinstance(w, Mxfp4Weights):
        _, n, half = w.blocks.shape
        assert w.blocks.dtype == w.scales.dtype == torch.uint8 and w.scales.shape == (w.blocks.shape[0], n, half // 16)
        return w.blocks, None, w.scales, n, 2 * half, {**_PLAIN, "PACKED": True, "MXFP4": True, "BITS": 4,
                                                       "GROUP": MXFP4_GROUP}
    return w, None, None, w.shape[1], w.shape[2], _PLAIN


def _matmul(a: Tensor, w: ExpertWeights, pairs: Tensor, block_expert: Tensor, num_pairs: int, top_k: int,
            weights: Tensor | None, block_m: int, bias: Tensor | None = None) -> Tensor:
    values, zeros, scales, n, k, mode = _operands(w)
    assert values.stride(-1) == 1 and (scales is None or scales.stride(-1) == 1), "rows must have unit stride"
    c = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    scale_strides = (scales.stride(0), scales.stride(1)) if scales is not None else (0, 0)
    _moe_matmul_kernel[grid](
        a, values, zeros if zeros is not None else c, scales if scales is not None else c, c, pairs, block_expert,
        weights if weights is not None else c, bias if bias is not None else c,
        num_pairs, values.shape[0], n, k,
        a.stride(0), values.stride(0), values.stride(1), values.stride(2), *scale_strides, c.stride(0),
        bias.stride(0) if bias is not None else 0,
        TOP_K=top_k, A_ROW_IS_PAIR=weights is not None, WEIGHTED=weights is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot_constexprs(a.dtype, a.device), **mode,
    )
    return c


def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: ExpertWeights, w2: ExpertWeights,
                b13: Tensor | None = None, b2: Tensor | None = None,
                swiglu: tuple[float, float] | None = None) -> Tensor:
    """``pdserve_kernels.reference.moe_experts`` as two grouped products (see the module's docstring);
    gpt-oss's biases added in the products' epilogues, its activation (``swiglu``) in torch's operations."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    assert x.stride(-1) == 1, "rows must have unit stride"
    # Each token's slots in ascending expert order, so that its terms are added in transformers' order.
    topk_ids, perm = torch.sort(topk_ids, dim=1)
    weights = topk_weights.gather(1, perm).reshape(-1).contiguous()
    num_pairs = num_tokens * top_k
    block_m = 16 if num_pairs <= 1024 else 64  # decode steps: fewer padded rows per expert
    pairs, block_expert = align_pairs(topk_ids, expert_count(w13), block_m)
    gate_up = _matmul(x, w13, pairs, block_expert, num_pairs, top_k, None, block_m, b13)
    act = silu_mul(gate_up) if swiglu is None else gpt_oss_swiglu(gate_up, *swiglu)
    terms = _matmul(act, w2, pairs, block_expert, num_pairs, top_k, weights, block_m, b2)
    terms = terms.view(num_tokens, top_k, -1)
    hidden = terms.shape[2]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        terms, out, terms.stride(0), terms.stride(1), out.stride(0), hidden, TOP_K=top_k, BLOCK=block)
    return out
