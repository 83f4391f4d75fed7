"""Pure-torch reference kernels: the CPU path and the ground truth for the Triton kernels.

Layouts (shared with kernels/triton_*.py; a Triton kernel must accept exactly these):

- ``kv_cache``: one tensor for the whole model, ``[num_layers, 2, num_blocks, block_size,
  num_kv_heads, head_size]``; index 0 of dim 1 is K, 1 is V. A layer's view ``kv_cache[i]`` is
  ``kv_layer``: ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
- ``slot_mapping[t] = block_id * block_size + offset``; a negative slot means "do not store".
- ``block_tables``: ``[num_seqs, max_num_blocks]`` int32, unused entries may hold anything.
- Varlen queries are flattened: ``query[query_start_loc[s]:query_start_loc[s + 1]]`` belongs to
  sequence ``s``; ``context_lens[s]`` counts all its tokens whose KV is in the cache *including*
  this chunk's (stored before attention runs), so the chunk sits at positions
  ``context_lens[s] - q_len .. context_lens[s] - 1`` and attends causally.
"""

from __future__ import annotations

import torch
from torch import Tensor


def store_kv(key: Tensor, value: Tensor, kv_layer: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into their slots, in place."""
    block_size = kv_layer.shape[2]
    slot_mapping = slot_mapping.long()
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat = kv_layer.view(2, -1, *kv_layer.shape[3:]) if kv_layer.is_contiguous() else None
    if flat is not None:
        flat[0].index_copy_(0, slot_mapping, key.to(kv_layer.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(kv_layer.dtype))
        return
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_layer[0, block_ids, offsets] = key.to(kv_layer.dtype)
    kv_layer[1, block_ids, offsets] = value.to(kv_layer.dtype)


def _gather_context(kv_layer: Tensor, block_table: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """K and V of one sequence's first ``num_tokens`` tokens: ``[num_tokens, num_kv_heads, head_size]``."""
    block_size = kv_layer.shape[2]
    num_blocks = (num_tokens + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    k = kv_layer[0, ids].reshape(-1, *kv_layer.shape[3:])[:num_tokens]
    v = kv_layer[1, ids].reshape(-1, *kv_layer.shape[3:])[:num_tokens]
    return k, v


def paged_decode_attention(
    query: Tensor,
    kv_layer: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """One query token per sequence: ``query`` ``[num_seqs, num_heads, head_size]``.

    Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    Returns (or fills ``out``) ``[num_seqs, num_heads, head_size]``; does not modify the cache.
    """
    num_seqs, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_layer.shape
    group = num_heads // num_kv_heads
    lens = context_lens.long()
    max_len = int(lens.max()) if num_seqs else 0
    num_blocks = (max_len + block_size - 1) // block_size
    ids = block_tables[:, :num_blocks].long().clamp(0, kv_layer.shape[1] - 1)
    # [num_seqs, num_blocks * block_size, num_kv_heads, head_size]
    k = kv_layer[0, ids].reshape(num_seqs, -1, num_kv_heads, head_size)[:, :max_len]
    v = kv_layer[1, ids].reshape(num_seqs, -1, num_kv_heads, head_size)[:, :max_len]
    q = query.view(num_seqs, num_kv_heads, group, head_size).to(k.dtype)
    # scores: [num_seqs, num_kv_heads, group, max_len]
    scores = torch.einsum("skgd,stkd->skgt", q, k).float() * scale
    mask = torch.arange(max_len, device=query.device)[None, :] >= lens[:, None]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    result = torch.einsum("skgt,stkd->skgd", probs, v).reshape(num_seqs, num_heads, head_size)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def paged_prefill_attention(
    query: Tensor,
    kv_layer: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """Varlen attention for chunks whose earlier context (and the chunk itself) is in the cache.

    ``query`` ``[num_tokens, num_heads, head_size]``; causal within each chunk. Sequences whose
    chunk is a single token take the batched decode path. Does not modify the cache.
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    result = out if out is not None else torch.empty_like(query)
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    single = [i for i, n in enumerate(q_lens) if n == 1]
    if single:
        idx = torch.tensor(single, device=query.device)
        tok = torch.tensor([starts[i] for i in single], device=query.device)
        result[tok] = paged_decode_attention(
            query[tok], kv_layer, block_tables[idx], context_lens[idx], scale
        ).to(result.dtype)
    for s, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        ctx = lens[s]
        k, v = _gather_context(kv_layer, block_tables[s], ctx)
        q = query[starts[s] : starts[s + 1]]
        # [num_kv_heads, group, q_len, head_size] x [num_kv_heads, ctx, head_size]
        qh = q.view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3).to(k.dtype)
        kh = k.permute(1, 0, 2)
        vh = v.permute(1, 0, 2)
        scores = torch.matmul(qh, kh.transpose(-1, -2)[:, None]).float() * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        k_pos = torch.arange(ctx, device=query.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vh.dtype)
        o = torch.matmul(probs, vh[:, None])  # [num_kv_heads, group, q_len, head_size]
        result[starts[s] : starts[s + 1]] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size)
    return result


def gather_blocks(kv_cache: Tensor, block_ids: Tensor, out: Tensor | None = None) -> Tensor:
    """Pack blocks into a contiguous ``[num_layers, 2, len(block_ids), block_size, heads, head_size]``.

    ``kv_cache`` may be a slice of layers (``kv_cache[l0:l1]``) for per-layer-group transfers.
    """
    ids = block_ids.to(device=kv_cache.device, dtype=torch.long)
    if out is None:
        return kv_cache.index_select(2, ids)
    torch.index_select(kv_cache, 2, ids, out=out)
    return out


def scatter_blocks(kv_cache: Tensor, block_ids: Tensor, src: Tensor) -> None:
    """Unpack ``src`` (as made by ``gather_blocks``) into ``block_ids`` of ``kv_cache``, in place."""
    ids = block_ids.to(device=kv_cache.device, dtype=torch.long)
    kv_cache.index_copy_(2, ids, src.to(device=kv_cache.device, dtype=kv_cache.dtype))


def copy_blocks(kv_cache: Tensor, src_block_ids: Tensor, dst_block_ids: Tensor) -> None:
    """Copy whole blocks (all layers, K and V) from ``src`` to ``dst`` ids, in place (copy-on-write)."""
    src = src_block_ids.to(device=kv_cache.device, dtype=torch.long)
    dst = dst_block_ids.to(device=kv_cache.device, dtype=torch.long)
    kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))
