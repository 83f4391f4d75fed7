"""Paged prefill attention in Triton: varlen chunks whose earlier context (and themselves) are in the cache.

Programs are laid out over query tiles without reading lengths on the host: the grid has
``cdiv(num_tokens, BLOCK_Q) + num_seqs`` programs per KV head, sequence ``s`` owns the programs from
``query_start_loc[s] // BLOCK_Q + s`` on, and each program finds its sequence by counting how many
of those starts are at or below its id. A tile holds ``BLOCK_Q`` query tokens times the query heads
of one KV group, so a K/V tile is read once per group. Softmax is online, in float32, causal within
the chunk (the chunk's token ``i`` sits at position ``context_len - q_len + i``). With a sliding
``window`` a query sees only the ``window - 1`` keys before it, and a tile skips keys that no row
of it can see; the wrapper passes a huge window for full attention. An attention ``chunk`` (a huge one for
none) hides the keys of earlier chunks of positions than a query's own, and a tile skips those of every row.
With ``key_limits`` a query sees keys up
to its own limit instead of its own position (an image's tokens that attend to each other both ways), and a
tile reads keys up to its rows' largest limit.
"""

from __future__ import annotations

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
from pdserve_kernels.triton_decode import LATENT_HEADS_PER_PROGRAM

LOG2E = 1.4426950408889634
BLOCK_M = 64  # query rows (tokens x heads of a group) per program
# ... of latent attention's twice-wide rows (DeepSeek-V3's 576 entries, in two tiles of 512 lanes): 32 overflow
# the shared memory of an L40S or RTX 4090 (sm89) even with the narrowest key tile (``tests.kernels.gpu_compile``).
LATENT_BLOCK_M = 16
# Sequences a program reads at a time to find its own (a loop over the step's sequences, so that the
# kernel is built once, not once per power of two of them inside the steps that first need each).
SEQ_CHUNK = 128
DEFAULT_BLOCK_N = 64


# Arguments that change from step to step (the sequences, the block table's width) are not specialised:
# each value Triton tells apart (1, a multiple of 16, other) would build another variant inside a step.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_seq"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr, sinks_ptr, key_limits_ptr, out_ptr,
    num_seqs, qk_scale, soft_cap, window, chunk,
    stride_q_tok, stride_q_head,
    stride_kv_block, stride_kv_tok, stride_kv_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_TILES: tl.constexpr,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SEQ_CHUNK: tl.constexpr, WIDEN_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr, SINKS: tl.constexpr, LATENT: tl.constexpr, KEY_LIMITS: tl.constexpr,
):
    """``LATENT``: as ``triton_decode._decode_kernel``'s (keys and values one vector, split across the slots);
    so are ``G_PAD`` query heads a program of the group's, in ``HEAD_TILES`` parts."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_TILES
    head0 = (tl.program_id(1) % HEAD_TILES) * G_PAD  # the program's first query head within the group

    # The program's sequence: the last whose first tile is at or before it, counted over the sequences
    # ``SEQ_CHUNK`` at a time (one build whatever the step's sequence count).
    below = tl.zeros([SEQ_CHUNK], dtype=tl.int32)
    for seq0 in range(0, num_seqs, SEQ_CHUNK):
        offs_seq = seq0 + tl.arange(0, SEQ_CHUNK)
        seq_mask = offs_seq < num_seqs
        starts = tl.load(query_start_loc_ptr + offs_seq, mask=seq_mask, other=0).to(tl.int32)
        first_tile = starts // BLOCK_Q + offs_seq
        below += ((first_tile <= pid) & seq_mask).to(tl.int32)
    # Clamped for programs below sequence 0's first tile (possible if query_start_loc[0] > 0).
    seq = tl.maximum(tl.sum(below, axis=0) - 1, 0)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    tile_tok0 = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    prefix_len = ctx_len - q_len

    offs_m = tl.arange(0, BLOCK_Q * G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    toks = tile_tok0 + offs_m // G_PAD
    heads = kv_head * GROUP + head0 + offs_m % G_PAD
    tile_valid = (tile_tok0 >= 0) & (tile_tok0 < q_len)
    # Scalar conditions are folded into a bound: the interpreter mishandles scalar & vector masks.
    tok_end = tl.where(tile_valid, q_len, 0)
    row_mask = (toks < tok_end) & (head0 + offs_m % G_PAD < GROUP)
    d_mask = offs_d < HEAD_SIZE
    q_pos = prefix_len + toks
    q_limit = q_pos  # the last key each row sees
    if KEY_LIMITS:
        q_limit = tl.load(key_limits_ptr + q_start + toks, mask=row_mask, other=0).to(tl.int32)

    q_rows = (q_start + toks).to(tl.int64) * stride_q_tok + heads * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_hi = q
    if LATENT:
        q_hi = tl.load(q_ptr + q_rows[:, None] + HEAD_SIZE + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :],
                       other=0.0)
    if not KV_FP8:  # else K and V are widened to q's dtype as they load
        q = q.to(k_ptr.dtype.element_ty)
        q_hi = q_hi.to(k_ptr.dtype.element_ty)

    # Keys past the tile's last query position are masked for every row; a tile past the chunk's
    # end does no work at all.
    kv_end = tl.minimum(ctx_len, prefix_len + tile_tok0 + BLOCK_Q)
    if KEY_LIMITS:  # ... past the largest limit of its rows
        kv_end = tl.minimum(ctx_len, tl.maximum(kv_end, tl.max(tl.where(row_mask, q_limit, 0), axis=0) + 1))
    kv_end = tl.where(tile_valid, kv_end, 0)
    # The tile's first row sees the earliest keys, of the window and of its chunk.
    kv_start = tl.maximum(tl.maximum(prefix_len + tile_tok0 - window + 1, 0), (prefix_len + tile_tok0) // chunk * chunk)

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
    if SINKS:  # each head's sink logit (gpt-oss) joins every row's softmax, as a weight 1 at it
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(row_mask, sink, m_i)
        l_i = tl.where(row_mask, 1.0, l_i)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for kv0 in range(kv_start, kv_end, BLOCK_N):
        k_pos = kv0 + offs_n
        n_mask = k_pos < kv_end
        block_ids = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_offs = block_ids * stride_kv_block + (k_pos % BLOCK_SIZE) * stride_kv_tok + kv_head * stride_kv_head
        kv_mask = n_mask[:, None] & d_mask[None, :]
        v_ptrs = v_ptr + kv_offs[:, None] + offs_d[None, :]
        s, k, v_hi = tile_scores(q, q_hi, k_ptr + kv_offs[:, None] + offs_d[None, :], v_ptrs, kv_mask, LATENT, KV_FP8,
                                 WIDEN_DOT, DOT_PRECISION)
        s = s * qk_scale
        if SOFT_CAP:
            s = soft_cap_scores(s, soft_cap) * 1.4426950408889634  # log2(e), as LOG2E
        visible = n_mask[None, :] & (k_pos[None, :] <= q_limit[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
        visible = visible & (k_pos[None, :] >= (q_pos // chunk * chunk)[:, None])
        s = tl.where(visible, s, float("-inf"))
        # With a window, a row may see nothing in a tile (its max stays -inf): subtract 0 instead,
        # so its weights are 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc, acc_hi = attend(acc, acc_hi, alpha, p, k, v_hi, v_ptrs, kv_mask, LATENT, KV_FP8, WIDEN_DOT, DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o_rows = (q_start + toks).to(tl.int64) * stride_o_tok + heads * stride_o_head
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])
    if LATENT:
        tl.store(out_ptr + o_rows[:, None] + HEAD_SIZE + offs_d[None, :],
                 (acc_hi / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def run_paged_prefill(
    query: Tensor,
    kv_layer: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Tensor | None = None,
    latent: bool = False,
    key_limits: Tensor | None = None,
    attention_chunk: int | None = None,
) -> Tensor:
    """``paged_prefill_attention`` with the tiling exposed; ``block_n`` None: ``DEFAULT_BLOCK_N``, or
    less where the GPU's shared memory cannot hold that tile (``launch_fitting``)."""
    check_kv_layer(kv_layer)
    num_heads, num_kv_heads, head_size = check_heads(query, kv_layer, latent)
    num_seqs = context_lens.shape[0]
    check_index("context_lens", context_lens, None, query.device)
    check_index("query_start_loc", query_start_loc, num_seqs + 1, query.device)
    check_block_tables(block_tables, num_seqs, query.device)
    check_sinks(sinks, num_heads, query.device)
    if key_limits is not None:
        check_index("key_limits", key_limits, query.shape[0], query.device)
    if out is None:
        out = torch.empty_like(query)
    check_out(out, query)
    num_tokens = query.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    assert sliding_window is None or sliding_window >= 0, f"sliding_window must be >= 0, got {sliding_window}"
    assert attention_chunk is None or attention_chunk >= 0, f"attention_chunk must be >= 0, got {attention_chunk}"
    scores = score_args(scale, soft_cap, LOG2E)

    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    if latent:  # as the decode's (``triton_decode.LATENT_HEADS_PER_PROGRAM``)
        g_pad = min(g_pad, LATENT_HEADS_PER_PROGRAM)
    head_tiles = triton.cdiv(group, g_pad)
    block_q = max(1, (LATENT_BLOCK_M if latent else BLOCK_M) // g_pad)
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    grid = (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads * head_tiles)
    consts = dict(
        GROUP=group, G_PAD=g_pad, HEAD_TILES=head_tiles, HEAD_SIZE=head_size, D_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=kv_layer.shape[2], BLOCK_Q=block_q,
        SEQ_CHUNK=SEQ_CHUNK,
        SOFT_CAP=scores["SOFT_CAP"],
        **kv_constexprs(kv_layer.dtype, query.dtype, query.device), SINKS=sinks is not None, LATENT=latent,
        KEY_LIMITS=key_limits is not None, **launch_options(num_warps, num_stages),
    )

    def launch(tile: int) -> None:
        _prefill_kernel[grid](
            query, k_cache, v_cache, block_tables, query_start_loc, context_lens, query if sinks is None else sinks,
            context_lens if key_limits is None else key_limits, out,
            num_seqs, scores["qk_scale"], scores["soft_cap"], sliding_window or FULL_WINDOW, attention_chunk or FULL_WINDOW,
            query.stride(0), query.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            BLOCK_N=tile, **consts,
        )

    launch_fitting(("prefill", query.device, kv_layer.dtype, *sorted(consts.items())), DEFAULT_BLOCK_N, launch, block_n)
    return out


def paged_prefill_attention(
    query: Tensor,
    kv_layer: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Tensor | None = None,
    latent: bool = False,
    key_limits: Tensor | None = None,
    attention_chunk: int | None = None,
) -> Tensor:
    """Varlen causal chunks over paged context; see ``pdserve_kernels.reference.paged_prefill_attention``.

    Single-token chunks run through the same kernel (same result as the reference's decode path).
    Does not modify the cache.
    """
    return run_paged_prefill(
        query, kv_layer, block_tables, query_start_loc, context_lens, scale, out, sliding_window=sliding_window,
        soft_cap=soft_cap, sinks=sinks, latent=latent, key_limits=key_limits, attention_chunk=attention_chunk,
    )
