"""Paged decode attention in Triton: one query token per sequence, grouped-query, split along the context.

One program handles one (sequence, KV head, split) and all the query heads that share that KV head,
so each K/V tile is read once per group. When there are too few (sequence, KV head) pairs to fill the
GPU, each sequence's context is cut into ``num_splits`` ranges of whole tiles (flash-decoding): every
range writes an unnormalized partial output with its running max and sum, and a second kernel merges
them. Otherwise a single pass writes the normalized output directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve_kernels.triton_checks import (
    check_block_tables,
    check_heads,
    check_index,
    check_kv_layer,
    check_out,
    check_sinks,
)
from pdserve_kernels.triton_common import (
    FULL_WINDOW,
    attend,
    kv_constexprs,
    launch_fitting,
    launch_options,
    score_args,
    soft_cap_scores,
    tile_scores,
)

LOG2E = 1.4426950408889634
DEFAULT_BLOCK_N = 64
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32
LATENT_HEADS_PER_PROGRAM = 16
CPU_NUM_SMS = 8  # stand-in core count when the interpreter runs the kernels on the CPU


# Arguments that change from step to step (the splits, the block table's width) are not specialised:
# each value Triton tells apart (1, a multiple of 16, other) would build another variant inside a step.
@triton.jit(do_not_specialize=["num_splits", "stride_bt_seq"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, sinks_ptr,
    out_ptr, m_ptr, l_ptr,
    qk_scale, soft_cap, num_splits, window, chunk,
    stride_q_seq, stride_q_head,
    stride_kv_block, stride_kv_tok, stride_kv_head,
    stride_bt_seq,
    stride_o_seq, stride_o_head, stride_o_split,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_TILES: tl.constexpr,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, WIDEN_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr, SINKS: tl.constexpr, LATENT: tl.constexpr,
):
    """Attention of one (sequence, KV head) over its ``split``-th context range, for ``G_PAD`` of the query
    heads that read it (the ``HEAD_TILES``-th part of them: axis 1 counts KV heads times ``HEAD_TILES``).

    ``LATENT``: each token's key and value are one vector, its first ``HEAD_SIZE`` entries in the K slot and
    the rest in the V slot; the queries' and outputs' second halves meet the V slot's (``acc_hi``).

    ``SPLIT`` false: one range, normalized output. True: the unnormalized partial output, its row max
    (in log2 units) and sum, for ``_decode_reduce_kernel``. Only the last ``window`` tokens of the
    context are read, and only those of the query's own ``chunk`` of positions (the wrapper passes a huge
    window and chunk for full attention).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_TILES
    split = tl.program_id(2)

    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    lo = tl.maximum(tl.maximum(ctx_len - window, 0), (tl.maximum(ctx_len, 1) - 1) // chunk * chunk)
    tiles_per_split = tl.cdiv(tl.cdiv(ctx_len - lo, BLOCK_N), num_splits)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx_len)

    offs_g = (tl.program_id(1) % HEAD_TILES) * G_PAD + tl.arange(0, G_PAD)  # within the KV head's group
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_SIZE

    q_ptrs = q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q_hi = q
    if LATENT:
        q_hi = tl.load(q_ptrs + HEAD_SIZE, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if not KV_FP8:  # else K and V are widened to q's dtype as they load
        q = q.to(k_ptr.dtype.element_ty)
        q_hi = q_hi.to(k_ptr.dtype.element_ty)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    if SINKS:  # each head's sink logit (gpt-oss) joins the softmax once: in the first range, as a weight 1 at it
        sink_rows = offs_g < tl.where(split == 0, GROUP, 0)  # a bound: the interpreter mishandles scalar masks
        sink = tl.load(sinks_ptr + heads, mask=sink_rows, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(sink_rows, sink, m_i)
        l_i = tl.where(sink_rows, 1.0, l_i)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    acc_hi = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tok0 in range(start, end, BLOCK_N):
        toks = tok0 + offs_n
        n_mask = toks < end
        block_ids = tl.load(bt_row + toks // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_offs = block_ids * stride_kv_block + (toks % BLOCK_SIZE) * stride_kv_tok + kv_head * stride_kv_head
        kv_mask = n_mask[:, None] & d_mask[None, :]
        v_ptrs = v_ptr + kv_offs[:, None] + offs_d[None, :]
        s, k, v_hi = tile_scores(q, q_hi, k_ptr + kv_offs[:, None] + offs_d[None, :], v_ptrs, kv_mask, LATENT, KV_FP8,
                                 WIDEN_DOT, DOT_PRECISION)
        s = s * qk_scale
        if SOFT_CAP:
            s = soft_cap_scores(s, soft_cap) * 1.4426950408889634  # log2(e), as LOG2E
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite after the first tile.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc, acc_hi = attend(acc, acc_hi, alpha, p, k, v_hi, v_ptrs, kv_mask, LATENT, KV_FP8, WIDEN_DOT, DOT_PRECISION)
        m_i = m_new

    o_base = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # an empty context yields zeros, not NaN
        tl.store(o_base, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=o_mask)
        if LATENT:
            tl.store(o_base + HEAD_SIZE, (acc_hi / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_base + split * stride_o_split, acc, mask=o_mask)
        if LATENT:
            tl.store(o_base + split * stride_o_split + HEAD_SIZE, acc_hi, mask=o_mask)
        ml_offs = (seq * (tl.num_programs(1) // HEAD_TILES * GROUP) + heads) * num_splits + split
        tl.store(m_ptr + ml_offs, m_i, mask=g_mask)
        tl.store(l_ptr + ml_offs, l_i, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_p_seq", "stride_p_head"])
def _decode_reduce_kernel(
    partial_ptr, m_ptr, l_ptr, out_ptr, num_splits,
    stride_p_seq, stride_p_head, stride_p_split,
    stride_o_seq, stride_o_head,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    """Merges the ``num_splits`` partial outputs of one (sequence, query head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_SIZE

    ml_offs = (seq * tl.num_programs(1) + head) * num_splits + offs_s
    m = tl.load(m_ptr + ml_offs, mask=s_mask, other=float("-inf"))
    l_split = tl.load(l_ptr + ml_offs, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: weights 0, output 0
    w = tl.exp2(m - m_max)  # an empty split has m = -inf and weighs 0
    l_sum = tl.sum(w * l_split, axis=0)
    l_sum = tl.where(l_sum > 0.0, l_sum, 1.0)

    p_ptrs = (partial_ptr + seq.to(tl.int64) * stride_p_seq + head * stride_p_head
              + offs_s[:, None] * stride_p_split + offs_d[None, :])
    parts = tl.load(p_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0) / l_sum
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_NUM_SMS


def choose_num_splits(num_seqs: int, programs_per_seq: int, max_context_len: int, sm_count: int) -> int:
    """How many context ranges each sequence is cut into; 1 means the single-pass kernel.

    Split only when (sequence, KV head) programs (``programs_per_seq`` a sequence: its KV heads, or with
    latent attention's head tiles more) cannot fill about two per SM, and never into ranges shorter than
    ``MIN_TOKENS_PER_SPLIT`` tokens of the longest possible context.
    """
    num_programs = num_seqs * programs_per_seq
    target = 2 * sm_count
    if num_programs == 0 or num_programs >= target:
        return 1
    by_occupancy = triton.cdiv(target, num_programs)
    by_length = max_context_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def run_paged_decode(
    query: Tensor,
    kv_layer: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Tensor | None = None,
    latent: bool = False,
    attention_chunk: int | None = None,
) -> Tensor:
    """``paged_decode_attention`` with the split count (``None``: heuristic) and tiling exposed; ``block_n``
    None: ``DEFAULT_BLOCK_N``, or less where the GPU's shared memory cannot hold that tile
    (``launch_fitting``)."""
    check_kv_layer(kv_layer)
    num_heads, num_kv_heads, head_size = check_heads(query, kv_layer, latent)
    num_seqs = query.shape[0]
    block_size = kv_layer.shape[2]
    check_index("context_lens", context_lens, num_seqs, query.device)
    check_block_tables(block_tables, num_seqs, query.device)
    check_sinks(sinks, num_heads, query.device)
    if out is None:
        out = torch.empty_like(query)
    check_out(out, query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = max(16, triton.next_power_of_2(group))
    # Latent attention's many query heads a KV head (128 for DeepSeek-V3) over twice the head: 16 a program, or the
    # tiles overflow a GPU's shared memory (``tests.kernels.gpu_compile``).
    head_tile = min(g_pad, LATENT_HEADS_PER_PROGRAM) if latent else g_pad
    head_tiles = triton.cdiv(group, head_tile)
    if num_splits is None:
        # The table's width bounds every context without reading context_lens on the host.
        max_context_len = min(block_tables.shape[1] * block_size, sliding_window or FULL_WINDOW,
                              attention_chunk or FULL_WINDOW)
        num_splits = choose_num_splits(num_seqs, num_kv_heads * head_tiles, max_context_len, num_sms(query.device))
    assert num_splits >= 1, f"num_splits must be positive, got {num_splits}"
    assert sliding_window is None or sliding_window >= 0, f"sliding_window must be >= 0, got {sliding_window}"
    assert attention_chunk is None or attention_chunk >= 0, f"attention_chunk must be >= 0, got {attention_chunk}"
    window, chunk = sliding_window or FULL_WINDOW, attention_chunk or FULL_WINDOW
    scores = score_args(scale, soft_cap, LOG2E)

    consts = dict(
        GROUP=group, G_PAD=head_tile, HEAD_TILES=head_tiles,
        HEAD_SIZE=head_size, D_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
        **kv_constexprs(kv_layer.dtype, query.dtype, query.device), SINKS=sinks is not None, LATENT=latent,
        **launch_options(num_warps, num_stages),
    )
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    grid = (num_seqs, num_kv_heads * head_tiles, num_splits)

    def fitting(launch: Callable[[int], None], split: bool) -> None:
        key = ("decode", split, query.device, kv_layer.dtype, scores["SOFT_CAP"], *sorted(consts.items()))
        launch_fitting(key, DEFAULT_BLOCK_N, launch, block_n)

    if num_splits == 1:
        fitting(lambda tile: _decode_kernel[grid](
            query, k_cache, v_cache, block_tables, context_lens, query if sinks is None else sinks, out, out, out,
            scores["qk_scale"], scores["soft_cap"], 1, window, chunk, query.stride(0), query.stride(1), *kv_strides,
            block_tables.stride(0), out.stride(0), out.stride(1), 0, SPLIT=False, SOFT_CAP=scores["SOFT_CAP"],
            BLOCK_N=tile, **consts,
        ), split=False)
        return out

    partial = torch.empty(num_seqs, num_heads, num_splits, query.shape[2], dtype=torch.float32, device=query.device)
    m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    l_sum = torch.empty_like(m)
    fitting(lambda tile: _decode_kernel[grid](
        query, k_cache, v_cache, block_tables, context_lens, query if sinks is None else sinks, partial, m, l_sum,
        scores["qk_scale"], scores["soft_cap"], num_splits, window, chunk, query.stride(0), query.stride(1), *kv_strides,
        block_tables.stride(0), partial.stride(0), partial.stride(1), partial.stride(2), SPLIT=True,
        SOFT_CAP=scores["SOFT_CAP"], BLOCK_N=tile, **consts,
    ), split=True)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        partial, m, l_sum, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2), out.stride(0), out.stride(1),
        HEAD_SIZE=query.shape[2], D_PAD=triton.next_power_of_2(query.shape[2]),
        S_PAD=max(MAX_SPLITS, triton.next_power_of_2(num_splits)),  # one variant up to MAX_SPLITS
    )
    return out


def paged_decode_attention(
    query: Tensor,
    kv_layer: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Tensor | None = None,
    latent: bool = False,
    attention_chunk: int | None = None,
) -> Tensor:
    """One query token per sequence; see ``pdserve_kernels.reference.paged_decode_attention``. Cache unmodified."""
    return run_paged_decode(
        query, kv_layer, block_tables, context_lens, scale, out, sliding_window=sliding_window, soft_cap=soft_cap,
        sinks=sinks, latent=latent, attention_chunk=attention_chunk,
    )
