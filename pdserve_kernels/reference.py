"""Pure-torch reference kernels: the CPU path and the ground truth for the Triton kernels.

Layouts (shared with pdserve_kernels/triton_*.py; a Triton kernel must accept exactly these):

- ``kv_cache``: one tensor for the whole model, ``[num_layers, 2, num_blocks, block_size,
  num_kv_heads, head_size]``; index 0 of dim 1 is K, 1 is V. A layer's view ``kv_cache[i]`` is
  ``kv_layer``: ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
- ``slot_mapping[t] = block_id * block_size + offset``; a negative slot means "do not store".
- ``block_tables``: ``[num_seqs, max_num_blocks]`` int32, unused entries may hold anything.
- Varlen queries are flattened: ``query[query_start_loc[s]:query_start_loc[s + 1]]`` belongs to
  sequence ``s``; ``context_lens[s]`` counts all its tokens whose KV is in the cache *including*
  this chunk's (stored before attention runs), so the chunk sits at positions
  ``context_lens[s] - q_len .. context_lens[s] - 1`` and attends causally.
- ``sliding_window``: ``None`` (or 0) for full attention; ``w`` lets the query at position ``p`` see
  keys ``p - w + 1 .. p`` only (itself and the ``w - 1`` before it), as transformers' sliding masks do.
- ``attention_chunk``: ``None`` (or 0), or ``c`` to cut positions into chunks of ``c`` (``0 .. c - 1``,
  ``c .. 2c - 1``, ...) and let the query at position ``p`` see keys of its own chunk only, from
  ``(p // c) * c`` on (Llama 4's chunked local attention, transformers' chunked causal mask).
- ``key_limits`` (prefill only): ``None``, or per query token the position of the last key it sees, its own or
  a later one within its chunk (an image's tokens that attend to each other both ways, Gemma 3's: each sees
  up to the image's last token); a window still counts back from the query's own position.
- ``soft_cap``: ``None`` (or 0), or ``c`` to turn each scaled score ``s`` into ``c * tanh(s / c)``
  before the mask and softmax (Gemma 2's attention logit soft-capping).
- ``latent``: the cache holds one vector per token and KV head split in halves, its first half in the K
  slot and its second in the V slot; the vector is both the key and the value (Multi-head Latent Attention's
  latent, ``common.model.mla``), so queries and outputs are ``2 * head_size`` wide.
- The cache's dtype is the model's, or ``float8_e4m3fn`` (``--kv-cache-dtype fp8``) or ``float8_e5m2``
  (``fp8_e5m2``): K and V are then stored rounded to 8 bits, saturated at the format's largest finite value
  (+-448 in e4m3, which has no infinity; +-57344 in e5m2: never NaN or infinite), with a scale of 1, and read
  back into the queries' dtype, in which attention runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pdserve_kernels.packed_weights import (  # the packed forms' widenings, this backend's and the kernels' reference
    ExpertWeights,
    expert_count,
    expert_weight,
    unpack_int_weight,
    widen_fp8,
)

# RMSNorm's forms, as each family's transformers code meets the normalized row with its weight
# (the ``form`` of ``rms_norm``; a Triton kernel's constant too):
NORM_LLAMA = 0  # the row rounded to the dtype, then times the weight (Llama and most families)
NORM_GEMMA = 1  # times ``1 + weight`` in float32, rounded once (Gemma 2 and 3)
NORM_OLMO = 2  # times the weight in float32, rounded once (OLMo 2 and 3)
# A LayerNorm without bias: the row's mean subtracted, the variance that of the centred row, then times the
# weight in float32, rounded once (Cohere's ``CohereLayerNorm``).
NORM_LAYER = 3

# The 8-bit caches' dtypes (``--kv-cache-dtype fp8`` or ``fp8_e4m3``, and ``fp8_e5m2``).
FP8_CACHES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: Tensor, cache_dtype: torch.dtype) -> Tensor:
    """``x`` as the cache stores it: in its dtype, saturated first where that is 8-bit (at 448 in e4m3, 57344 in
    e5m2: a larger K or V entry is stored as the largest finite value, never NaN or infinite)."""
    if x.dtype == cache_dtype:
        return x
    if cache_dtype in FP8_CACHES:
        largest = float(torch.finfo(cache_dtype).max)
        x = x.clamp(-largest, largest)
    return x.to(cache_dtype)


def cache_bytes(t: Tensor) -> Tensor:
    """An 8-bit cache (or a piece of one) as bytes, for the copies torch does not implement for float8 on
    the CPU (``index_copy_``, ``index_fill_``); any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype in FP8_CACHES else t


def rms_norm(x: Tensor, weight: Tensor, eps: float, form: int = NORM_LLAMA, bias: Tensor | None = None) -> Tensor:
    """Each row of ``x`` over its last dimension, as transformers normalizes it: the mean of squares in
    float32, the row scaled by its reciprocal square root, then met with ``weight`` in ``form`` (or, in
    ``NORM_LAYER``, centred on its mean first, and ``bias`` added in float32 where there is one: torch's
    LayerNorm, StarCoder2's)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    if form == NORM_LAYER:
        h = h - h.mean(-1, keepdim=True)
        y = weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
        return (y if bias is None else y + bias.float()).to(dtype)
    assert bias is None, "only the LayerNorm form has a bias"
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if form == NORM_GEMMA:
        return (h * (1.0 + weight.float())).to(dtype)
    if form == NORM_OLMO:
        return (weight * h).to(dtype)
    return weight * h.to(dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, form: int = NORM_LLAMA,
                 bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A block's output added to the residual stream, and the sum normalized for the next block:
    ``(rms_norm(x + residual), x + residual)``, the sum rounded to the inputs' dtype first."""
    summed = x + residual
    return rms_norm(summed, weight, eps, form, bias), summed


def silu_mul(gate_up: Tensor) -> Tensor:
    """A gated MLP's activation over its stacked gate/up product ``[..., 2 * n]``: ``silu(gate) * up``,
    ``[..., n]``, each operation rounded to the input's dtype as torch rounds it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``q`` ``[tokens, heads, head_size]`` and ``k`` ``[tokens, kv_heads, head_size]`` rotated as
    transformers rotates them: ``x * cos + rotate_half(x) * sin``, with ``cos`` and ``sin``
    ``[tokens, 1, rotary_dim]`` (each operation rounded to the inputs' dtype; or, given float32 tables for
    narrower q and k, as ERNIE 4.5 rotates: in float32, rounded once). A ``rotary_dim`` below ``head_size``
    (a partial RoPE, GLM-4.5's) rotates each head's first ``rotary_dim`` entries only, the rest passing as
    they are."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < q.shape[-1]:
        q_rot, k_rot = rope(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
        return torch.cat((q_rot, q[..., rotary_dim:]), -1), torch.cat((k_rot, k[..., rotary_dim:]), -1)
    if cos.dtype != q.dtype:  # float32 tables: in float32, rounded once
        def turned(x: Tensor) -> Tensor:
            return (x.float() * cos + _rotate_half(x).float() * sin).to(x.dtype)

        return turned(q), turned(k)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_and_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv_layer: Tensor,
                   slot_mapping: Tensor) -> Tensor:
    """``q`` and ``k`` rotated (``rope``), the rotated keys and ``v`` written into their slots
    (``store_kv``); returns the rotated queries."""
    q, k = rope(q, k, cos, sin)
    store_kv(k, v, kv_layer, slot_mapping)
    return q


def store_kv(key: Tensor, value: Tensor, kv_layer: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into their slots, in place."""
    block_size = kv_layer.shape[2]
    slot_mapping = slot_mapping.long()
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key, value = cache_bytes(to_cache(key, kv_layer.dtype)), cache_bytes(to_cache(value, kv_layer.dtype))
    kv_layer = cache_bytes(kv_layer)
    flat = kv_layer.view(2, -1, *kv_layer.shape[3:]) if kv_layer.is_contiguous() else None
    if flat is not None:
        flat[0].index_copy_(0, slot_mapping, key)
        flat[1].index_copy_(0, slot_mapping, value)
        return
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_layer[0, block_ids, offsets] = key
    kv_layer[1, block_ids, offsets] = value


def _gather_blocks_flat(kv_layer: Tensor, block_ids: Tensor) -> Tensor:
    """K and V of ``block_ids`` (any shape) in one copy: ``[2, *block_ids.shape, block_size, heads, head_size]``.

    ``index_select`` over a flattened block dimension copies whole blocks as rows, which is several
    times faster on the CPU than advanced indexing of K and V separately.
    """
    _, num_blocks, *block_shape = kv_layer.shape
    flat = kv_layer.reshape(2, num_blocks, -1).index_select(1, block_ids.reshape(-1).long())
    return flat.view(2, *block_ids.shape, *block_shape)


def _readable(kv: Tensor, query_dtype: torch.dtype) -> Tensor:
    """Gathered K/V in the dtype attention runs in: an 8-bit cache's widened to the queries' dtype."""
    return kv.to(query_dtype) if kv.dtype in FP8_CACHES else kv


def _length_groups(lens: list[int], block_size: int) -> list[list[int]]:
    """Sequence indices grouped by context length, each group's longest at most twice its shortest.

    Decode attention pads every sequence of a group to the group's longest, so grouping bounds the
    wasted gather and attention work to half, at the cost of a few more calls.
    """
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = [[]]
    for i in order:
        if groups[-1] and lens[i] > 2 * max(lens[groups[-1][0]], block_size):
            groups.append([])
        groups[-1].append(i)
    return groups


def _attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, group: int,
               soft_cap: float | None, sinks: Tensor | None = None) -> Tensor:
    """SDPA over ``[..., heads, q_len, head_size]`` (K/V with ``heads // group`` heads), ``visible``
    broadcasting to the scores; with ``soft_cap`` or ``sinks`` written out, since SDPA does neither."""
    if not soft_cap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=group > 1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if soft_cap:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)
    # gpt-oss: each head's sink logit joins every query's softmax, and takes its share of the weight.
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat((scores, sink), dim=-1)
    probs = (combined - combined.amax(-1, keepdim=True)).softmax(-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def _keys_values(kv: Tensor, latent: bool) -> tuple[Tensor, Tensor]:
    """Gathered ``[2, ..., head_size]`` K and V as attention reads them: each slot's own, or, ``latent``, both
    the two halves joined (``[..., 2 * head_size]``, one tensor)."""
    if not latent:
        return kv[0], kv[1]
    joined = torch.cat((kv[0], kv[1]), dim=-1)
    return joined, joined


def _decode_padded(query: Tensor, kv_layer: Tensor, block_tables: Tensor, lens: Tensor, max_len: int,
                   scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                   sinks: Tensor | None = None, latent: bool = False, attention_chunk: int | None = None) -> Tensor:
    """Decode attention of sequences padded to ``max_len`` with the tail masked; ``[seqs, heads, head_size]``."""
    num_seqs, num_heads, head_size = query.shape
    _, total_blocks, block_size, num_kv_heads, cache_head_size = kv_layer.shape
    num_blocks = (max_len + block_size - 1) // block_size
    ids = block_tables[:, :num_blocks].long().clamp(0, total_blocks - 1)
    kv = _gather_blocks_flat(kv_layer, ids).view(2, num_seqs, num_blocks * block_size, num_kv_heads, cache_head_size)
    k, v = _keys_values(_readable(kv, query.dtype), latent)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [num_seqs, num_kv_heads, tokens, head_size]
    key_pos = torch.arange(num_blocks * block_size, device=query.device)[None, :]
    visible = key_pos < lens[:, None]
    if sliding_window:
        visible &= key_pos >= lens[:, None] - sliding_window
    if attention_chunk:  # the query sits at lens - 1
        visible &= key_pos >= (lens[:, None] - 1) // attention_chunk * attention_chunk
    return _attention(
        query[:, :, None, :].to(k.dtype), k, v, visible[:, None, None, :], scale, num_heads // num_kv_heads, soft_cap,
        sinks,
    ).view(num_seqs, num_heads, head_size)


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
    """One query token per sequence: ``query`` ``[num_seqs, num_heads, head_size]``.

    Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    ``sinks`` ``[num_heads]``: a logit per head that joins each softmax with no value (gpt-oss).
    ``latent``: keys and values are the cache's K and V halves joined (the queries twice its head_size).
    Returns (or fills ``out``) ``[num_seqs, num_heads, head_size]``; does not modify the cache.
    """
    result = out if out is not None else torch.empty_like(query)
    if query.shape[0] == 0:
        return result
    lens = context_lens.long()
    lens_list = lens.tolist()
    groups = _length_groups(lens_list, kv_layer.shape[2])
    if len(groups) == 1:
        result.copy_(_decode_padded(query, kv_layer, block_tables, lens, max(lens_list), scale, sliding_window,
                                    soft_cap, sinks, latent, attention_chunk))
        return result
    for group in groups:
        idx = torch.tensor(group, device=query.device)
        result[idx] = _decode_padded(
            query[idx], kv_layer, block_tables[idx], lens[idx], lens_list[group[-1]], scale, sliding_window,
            soft_cap, sinks, latent, attention_chunk,
        ).to(result.dtype)
    return result


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
    """Varlen attention for chunks whose earlier context (and the chunk itself) is in the cache.

    ``query`` ``[num_tokens, num_heads, head_size]``; causal within each chunk, or up to ``key_limits``
    ``[num_tokens]`` (the position of the last key each token sees). Sequences whose chunk is a single
    token take the batched decode path (such a token's limit is its own position). ``latent`` as
    ``paged_decode_attention``'s. Does not modify the cache.
    """
    num_heads = query.shape[1]
    num_kv_heads, cache_head_size = kv_layer.shape[3], kv_layer.shape[4]
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
            query[tok], kv_layer, block_tables[idx], context_lens[idx], scale, sliding_window=sliding_window,
            soft_cap=soft_cap, sinks=sinks, latent=latent, attention_chunk=attention_chunk,
        ).to(result.dtype)
    block_size = kv_layer.shape[2]
    for s, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        ctx = lens[s]
        num_blocks = (ctx + block_size - 1) // block_size
        kv = _gather_blocks_flat(kv_layer, block_tables[s, :num_blocks]).view(2, -1, num_kv_heads, cache_head_size)
        k, v = _keys_values(_readable(kv[:, :ctx], query.dtype), latent)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [num_kv_heads, ctx, head_size]
        q = query[starts[s] : starts[s + 1]].transpose(0, 1).to(k.dtype)  # [num_heads, q_len, head_size]
        # The chunk holds the last q_len positions: query i sees keys 0 .. ctx - q_len + i.
        visible = torch.ones(q_len, ctx, dtype=torch.bool, device=query.device).tril(ctx - q_len)
        if key_limits is not None:  # ... or up to its limit
            key_pos = torch.arange(ctx, device=query.device)
            visible = key_pos[None, :] <= key_limits[starts[s] : starts[s + 1], None].long()
        if sliding_window:  # ... and no key more than sliding_window - 1 before it
            visible = visible.triu(ctx - q_len - sliding_window + 1)
        if attention_chunk:  # ... and no key of an earlier chunk than its own
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
            visible = visible & (torch.arange(ctx, device=query.device)[None, :]
                                 >= (q_pos // attention_chunk * attention_chunk)[:, None])
        o = _attention(q, k, v, visible, scale, group, soft_cap, sinks)
        result[starts[s] : starts[s + 1]] = o.transpose(0, 1).to(result.dtype)
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
    cache_bytes(kv_cache).index_copy_(2, ids, cache_bytes(to_cache(src.to(kv_cache.device), kv_cache.dtype)))


def copy_blocks(kv_cache: Tensor, src_block_ids: Tensor, dst_block_ids: Tensor) -> None:
    """Copy whole blocks (all layers, K and V) from ``src`` to ``dst`` ids, in place (copy-on-write)."""
    src = src_block_ids.to(device=kv_cache.device, dtype=torch.long)
    dst = dst_block_ids.to(device=kv_cache.device, dtype=torch.long)
    kv_bytes = cache_bytes(kv_cache)
    kv_bytes.index_copy_(2, dst, kv_bytes.index_select(2, src))


def gpt_oss_swiglu(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's experts' activation over the stacked gate/up ``[..., 2 * n]``: the gate clamped above at
    ``limit``, the up within +-``limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``, in the input's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: ExpertWeights, w2: ExpertWeights,
                b13: Tensor | None = None, b2: Tensor | None = None,
                swiglu: tuple[float, float] | None = None) -> Tensor:
    """A mixture-of-experts block's experts over the tokens ``x`` ``[T, H]``: for each token, the sum
    over the experts its router chose (``topk_ids`` ``[T, k]``, distinct per row) of ``weight *
    down(silu(gate) * up)``, ``[T, H]``.

    ``w13`` ``[E, 2I, H]`` holds each expert's gate and up projections stacked, ``w2`` ``[E, H, I]``
    its down projection; ``topk_weights`` ``[T, k]`` is float32 or ``x``'s dtype (the family decides).
    The arithmetic is transformers' (its experts' loop): each expert's output rounded to the dtype,
    times its weight in the weight's dtype, rounded again, and a token's terms added in ascending expert
    order, each sum rounded to the dtype. Only the chosen experts run, over their own tokens.

    gpt-oss: ``b13`` ``[E, 2I]`` and ``b2`` ``[E, H]``, each projection's bias added to its product (each
    rounded), and ``swiglu`` ``(alpha, limit)`` its activation (``gpt_oss_swiglu``) in ``silu_mul``'s place.

    Either projection's weights may stay quantized (``pdserve_kernels.packed_weights``): each expert hit is widened
    to ``x``'s dtype as the checkpoint's dequantization widens it, then multiplied alike."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, ascending
    counts = torch.bincount(flat, minlength=expert_count(w13)).tolist()
    weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate_up = F.linear(x[tokens], expert_weight(w13, expert, x.dtype))
        if b13 is not None:
            gate_up = gate_up + b13[expert]
        y = F.linear(silu_mul(gate_up) if swiglu is None else gpt_oss_swiglu(gate_up, *swiglu),
                     expert_weight(w2, expert, x.dtype))
        if b2 is not None:
            y = y + b2[expert]
        out.index_add_(0, tokens, (y * weights[pairs, None]).to(x.dtype))
    return out


# Whether a backend keeps a checkpoint's quantized weights packed (``common.model.packed_linear``: its products
# ``int_linear`` and ``fp8_linear``); the torch reference widens them as they load, and its ``int_linear`` and
# ``fp8_linear`` are the Triton kernel's reference only.
PACKS_WEIGHTS = False


def int_linear(x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, bits: int,
               bias: Tensor | None = None, g_idx: Tensor | None = None) -> Tensor:
    """``x`` ``[tokens, in]`` times the packed integer weights (``unpack_int_weight``) of ``bits`` per value, plus
    ``bias``: ``F.linear`` with the weight they stand for, in ``x``'s dtype."""
    return F.linear(x, unpack_int_weight(qweight, qzeros, scales, x.dtype, bits, g_idx), bias)


def fp8_linear(x: Tensor, weight: Tensor, scale_inv: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x`` ``[tokens, in]`` times a block-wise FP8 weight ``[out, in]`` (e4m3) and its scales ``[out / m, in / n]``
    (``widen_fp8``), plus ``bias``: ``F.linear`` with the weight they stand for, in ``x``'s dtype."""
    return F.linear(x, widen_fp8(weight, scale_inv, x.dtype), bias)
