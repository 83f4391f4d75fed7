"""Rotary position embedding in Triton (over each head's first ``rotary_dim`` entries, the width of the
cos and sin tables: all of them, or GLM-4.5's half): the queries and keys of a step rotated in one kernel, where
the torch formula (``q * cos + rotate_half(q) * sin``, and the same for ``k``) is ten operations on
every layer of a forward that runs eagerly. ``rope_and_store`` also writes the rotated keys and the
values into the KV cache at their slots, the launch ``store_kv`` would have been, in a CUDA graph's
replay too.

Each product and the sum are rounded to the input's dtype in turn, as torch rounds each operation of
the formula (or, given float32 tables for narrower q and k, ERNIE 4.5's rotation, only the result), and the
kernel is built without fused multiply-adds: the same bits as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve_kernels.reference import FP8_CACHES
from pdserve_kernels.triton_checks import check_index, check_kv_layer
from pdserve_kernels.triton_common import to_cache


@triton.jit
def _rotated(x_ptr, rows, cos, sin, partner, sign, offs_d, mask, ROUND_EACH: tl.constexpr):
    """The heads at ``rows`` of ``x`` rotated, rounded to ``x``'s dtype after each operation (or, without
    ``ROUND_EACH``, once)."""
    x = tl.load(x_ptr + rows + offs_d[None, :], mask=mask, other=0.0)
    rot = tl.load(x_ptr + rows + partner[None, :], mask=mask, other=0.0).to(tl.float32) * sign[None, :]
    a = x.to(tl.float32) * cos[None, :]
    b = rot * sin[None, :]
    if ROUND_EACH:
        a = a.to(x.dtype).to(tl.float32)
        b = b.to(x.dtype).to(tl.float32)
    return (a + b).to(x.dtype)


@triton.jit
def _rotate(x_ptr, o_ptr, tok, stride_x_tok, stride_x_head, stride_o_tok, stride_o_head, cos, sin, partner, sign,
            offs_h, offs_d, mask, ROUND_EACH: tl.constexpr):
    y = _rotated(x_ptr, tok * stride_x_tok + offs_h[:, None] * stride_x_head, cos, sin, partner, sign, offs_d, mask,
                 ROUND_EACH)
    out_rows = tok * stride_o_tok + offs_h[:, None] * stride_o_head
    tl.store(o_ptr + out_rows + offs_d[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tables(cos_ptr, sin_ptr, tok, stride_cs_tok, offs_d, d_mask, ROTARY_DIM: tl.constexpr):
    """A token's cos and sin (float32), and for each lane its ``rotate_half`` partner and sign. Lanes
    past ``ROTARY_DIM`` (a partial RoPE) take cos 1 and sin 0, themselves as partner: they pass as
    they are (``x * 1 + x * 0``)."""
    half: tl.constexpr = ROTARY_DIM // 2
    rotated = d_mask & (offs_d < ROTARY_DIM)
    # rotate_half within the rotated lanes: the first half takes minus the second, the second the first.
    partner = tl.where(offs_d < half, offs_d + half, tl.where(offs_d < ROTARY_DIM, offs_d - half, offs_d))
    partner = tl.where(d_mask, partner, 0)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + tok * stride_cs_tok + offs_d, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_cs_tok + offs_d, mask=rotated, other=0.0).to(tl.float32)
    return cos, sin, partner, sign


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr, slot_mapping_ptr,
                 stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                 stride_cs_tok, stride_qo_tok, stride_qo_head, stride_ko_block, stride_ko_tok, stride_ko_head,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, H_PAD: tl.constexpr,
                 HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 SATURATE: tl.constexpr, ROTARY_DIM: tl.constexpr, ROUND_EACH: tl.constexpr):
    """A token's queries rotated to ``q_out``, and its keys rotated: to ``k_out``, or with ``STORE`` into
    the cache (``k_out`` and ``v_out`` its K and V planes) at the token's slot with its values, as
    ``store_kv`` writes them (nothing for a negative slot)."""
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_SIZE
    cos, sin, partner, sign = _tables(cos_ptr, sin_ptr, tok, stride_cs_tok, offs_d, d_mask, ROTARY_DIM)
    _rotate(q_ptr, q_out_ptr, tok, stride_q_tok, stride_q_head, stride_qo_tok, stride_qo_head, cos, sin, partner,
            sign, offs_h, offs_d, (offs_h[:, None] < NUM_Q_HEADS) & d_mask[None, :], ROUND_EACH)
    if STORE:
        slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
        # A skipped slot masks every head (folded into a bound, as ``store_kv`` does it).
        mask = (offs_h[:, None] < tl.where(slot >= 0, NUM_K_HEADS, 0)) & d_mask[None, :]
        dst = (slot // BLOCK_SIZE) * stride_ko_block + (slot % BLOCK_SIZE) * stride_ko_tok
    else:
        mask = (offs_h[:, None] < NUM_K_HEADS) & d_mask[None, :]
        dst = tok * stride_ko_tok
    dst_offs = dst + offs_h[:, None] * stride_ko_head + offs_d[None, :]
    k = _rotated(k_ptr, tok * stride_k_tok + offs_h[:, None] * stride_k_head, cos, sin, partner, sign, offs_d, mask,
                 ROUND_EACH)
    tl.store(k_out_ptr + dst_offs, to_cache(k, k_out_ptr.dtype.element_ty, SATURATE), mask=mask)
    if STORE:
        v = tl.load(v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
        tl.store(v_out_ptr + dst_offs, to_cache(v, v_out_ptr.dtype.element_ty, SATURATE), mask=mask)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``pdserve_kernels.reference.rope`` in one kernel: ``q`` ``[tokens, heads, head_size]``, ``k``
    ``[tokens, kv_heads, head_size]`` (unit stride along the head), ``cos`` and ``sin``
    ``[tokens, 1, rotary_dim]`` of their dtype (or float32: rounded once)."""
    num_tokens, num_q_heads, head_size = _check(q, k, cos, sin)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if num_tokens:  # without STORE, ``v``, ``v_out`` and the slots are not read: ``k`` stands in for them
        _rope_kernel[(num_tokens,)](
            q, k, k, cos, sin, q_out, k_out, k, k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), 0, 0,
            cos.stride(0), q_out.stride(0), q_out.stride(1), 0, k_out.stride(0), k_out.stride(1),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], H_PAD=triton.next_power_of_2(max(num_q_heads, k.shape[1])),
            HEAD_SIZE=head_size, D_PAD=triton.next_power_of_2(head_size), STORE=False, BLOCK_SIZE=1,
            SATURATE=False, ROTARY_DIM=cos.shape[-1], ROUND_EACH=cos.dtype == q.dtype, enable_fp_fusion=False,
        )
    return q_out, k_out


def rope_and_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv_layer: Tensor,
                   slot_mapping: Tensor) -> Tensor:
    """``pdserve_kernels.reference.rope_and_store`` in one kernel: the queries rotated (returned), the
    keys rotated and the values written into ``kv_layer`` at their slots (as ``rope`` then
    ``store_kv``, with the rotated keys never in memory of their own)."""
    num_tokens, num_q_heads, head_size = _check(q, k, cos, sin)
    check_kv_layer(kv_layer)
    _, _, block_size, num_kv_heads, cache_head_size = kv_layer.shape
    for name, t in (("k", k), ("v", v)):
        assert tuple(t.shape) == (num_tokens, num_kv_heads, cache_head_size), (
            f"{name} must be [{num_tokens}, {num_kv_heads}, {cache_head_size}] as the cache; got {tuple(t.shape)}")
        assert t.stride(-1) == 1 and t.device == kv_layer.device, (
            f"{name} must have unit stride along the head and be on the cache's device ({kv_layer.device})")
    check_index("slot_mapping", slot_mapping, num_tokens, kv_layer.device)
    q_out = torch.empty_like(q)
    if num_tokens:
        k_cache, v_cache = kv_layer[0], kv_layer[1]
        _rope_kernel[(num_tokens,)](
            q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), cos.stride(0), q_out.stride(0), q_out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_kv_heads,
            H_PAD=triton.next_power_of_2(max(num_q_heads, num_kv_heads)), HEAD_SIZE=head_size,
            D_PAD=triton.next_power_of_2(head_size), STORE=True, BLOCK_SIZE=block_size,
            SATURATE=kv_layer.dtype in FP8_CACHES, ROTARY_DIM=cos.shape[-1], ROUND_EACH=cos.dtype == q.dtype,
            enable_fp_fusion=False,
        )
    return q_out


def _check(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[int, int, int]:
    """``(tokens, query heads, head_size)`` after checking the rotation's inputs."""
    num_tokens, num_q_heads, head_size = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_size, (
        f"k must be [{num_tokens}, kv_heads, {head_size}]; got {tuple(k.shape)}")
    assert head_size % 2 == 0, f"head_size must be even, got {head_size}"
    rotary_dim = cos.shape[-1]
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_size, (
        f"cos and sin must cover an even number of each head's first entries, up to {head_size}; got {rotary_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        assert t.shape == (num_tokens, 1, rotary_dim) and t.stride(-1) == 1, (
            f"{name} must be [{num_tokens}, 1, {rotary_dim}] with unit stride; got {tuple(t.shape)}")
        assert t.dtype in (q.dtype, torch.float32) and q.dtype == k.dtype, (
            f"q and k must share a dtype, {name} theirs or float32; got {t.dtype}, {q.dtype}, {k.dtype}")
    assert cos.stride(0) == sin.stride(0) and cos.dtype == sin.dtype, "cos and sin must share a layout and a dtype"
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k must have unit stride along the head"
    return num_tokens, num_q_heads, head_size
