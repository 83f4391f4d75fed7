"""KV-cache movement in Triton: store new tokens into their slots, and move whole blocks.

``gather_blocks``, ``scatter_blocks`` and ``copy_blocks`` share one kernel: in a contiguous
``[num_layers, 2, num_blocks, ...]`` cache each (layer, K or V, block) is one contiguous run of
``block_size * num_kv_heads * head_size`` elements, so moving a block is a flat copy whose source
and destination run are looked up (or not) in an id list.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pdserve_kernels.reference import FP8_CACHES
from pdserve_kernels.triton_checks import check_index, check_kv_cache, check_kv_layer
from pdserve_kernels.triton_common import to_cache

MAX_COPY_TILE = 4096  # elements per program when moving blocks


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_tok, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SATURATE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    # A skipped slot masks every head; folded into a bound because the interpreter mishandles
    # scalar & vector masks.
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_SIZE)
    block_id = slot // BLOCK_SIZE
    dst = block_id * stride_c_block + (slot % BLOCK_SIZE) * stride_c_tok
    dst_offs = dst + offs_h[:, None] * stride_c_head + offs_d[None, :]
    k = tl.load(key_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst_offs, to_cache(k, k_cache_ptr.dtype.element_ty, SATURATE), mask=mask)
    tl.store(v_cache_ptr + dst_offs, to_cache(v, v_cache_ptr.dtype.element_ty, SATURATE), mask=mask)


@triton.jit
def _move_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
    src_blocks_per_plane, dst_blocks_per_plane,
    BLOCK_NUMEL: tl.constexpr, TILE: tl.constexpr,
    SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr,
):
    """Copies block run ``i`` of every (layer, K/V) plane; a plane holds ``*_blocks_per_plane`` runs."""
    i = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    if SRC_INDEXED:
        src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    else:
        src_block = i.to(tl.int64)
    if DST_INDEXED:
        dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    else:
        dst_block = i.to(tl.int64)
    offs = tile * TILE + tl.arange(0, TILE)
    mask = offs < BLOCK_NUMEL
    src = src_ptr + (plane * src_blocks_per_plane + src_block) * BLOCK_NUMEL + offs
    dst = dst_ptr + (plane * dst_blocks_per_plane + dst_block) * BLOCK_NUMEL + offs
    x = tl.load(src, mask=mask)
    tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


def store_kv(key: Tensor, value: Tensor, kv_layer: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into their slots, in place.

    A negative slot is skipped. Slots must be below ``num_blocks * block_size`` (not checked: that
    would read the mapping on the host).
    """
    check_kv_layer(kv_layer)
    _, _, block_size, num_kv_heads, head_size = kv_layer.shape
    num_tokens = key.shape[0]
    for name, t in (("key", key), ("value", value)):
        assert tuple(t.shape) == (num_tokens, num_kv_heads, head_size), (
            f"{name} must be [{num_tokens}, {num_kv_heads}, {head_size}], got {tuple(t.shape)}"
        )
        assert t.stride(-1) == 1, f"{name}'s head_size dimension must be contiguous"
        assert t.device == kv_layer.device, f"{name} is on {t.device}, cache on {kv_layer.device}"
        assert t.is_floating_point(), f"{name} must be floating point, got {t.dtype}"
    check_index("slot_mapping", slot_mapping, num_tokens, kv_layer.device)
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, H_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size, D_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=block_size,
        SATURATE=kv_layer.dtype in FP8_CACHES,
    )


def _move_blocks(src: Tensor, dst: Tensor, src_ids: Tensor | None, dst_ids: Tensor | None, count: int) -> None:
    block_numel = src[0, 0, 0].numel()
    tile = min(MAX_COPY_TILE, triton.next_power_of_2(block_numel))
    num_planes = src.shape[0] * 2
    grid = (count, num_planes, triton.cdiv(block_numel, tile))
    _move_blocks_kernel[grid](
        src, dst, src_ids if src_ids is not None else src, dst_ids if dst_ids is not None else dst,
        src.shape[2], dst.shape[2],
        BLOCK_NUMEL=block_numel, TILE=tile,
        SRC_INDEXED=src_ids is not None, DST_INDEXED=dst_ids is not None,
    )


def _ids_on(block_ids: Tensor, device: torch.device) -> Tensor:
    check_index("block_ids", block_ids)
    return block_ids.to(device=device)


def gather_blocks(kv_cache: Tensor, block_ids: Tensor, out: Tensor | None = None) -> Tensor:
    """Pack blocks into a contiguous ``[num_layers, 2, len(block_ids), block_size, heads, head_size]``.

    ``kv_cache`` may be a slice of layers. Does not modify the cache.
    """
    check_kv_cache(kv_cache)
    ids = _ids_on(block_ids, kv_cache.device)
    shape = (kv_cache.shape[0], 2, ids.shape[0], *kv_cache.shape[3:])
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    assert tuple(out.shape) == shape, f"out must be {shape}, got {tuple(out.shape)}"
    assert out.is_contiguous() and out.device == kv_cache.device, "out must be contiguous, on the cache's device"
    assert out.dtype == kv_cache.dtype, f"out dtype {out.dtype} != cache dtype {kv_cache.dtype}"
    if ids.shape[0] and kv_cache.shape[0]:
        _move_blocks(kv_cache, out, ids, None, ids.shape[0])
    return out


def scatter_blocks(kv_cache: Tensor, block_ids: Tensor, src: Tensor) -> None:
    """Unpack ``src`` (as made by ``gather_blocks``) into ``block_ids`` of ``kv_cache``, in place.

    ``src`` may live on another device (it is copied over first) and have another float dtype.
    ``block_ids`` must not repeat.
    """
    check_kv_cache(kv_cache)
    ids = _ids_on(block_ids, kv_cache.device)
    shape = (kv_cache.shape[0], 2, ids.shape[0], *kv_cache.shape[3:])
    assert tuple(src.shape) == shape, f"src must be {shape}, got {tuple(src.shape)}"
    assert src.is_floating_point(), f"src must be floating point, got {src.dtype}"
    # A blocking copy: the caller may reuse a pinned staging buffer as soon as this returns.
    src = src.to(device=kv_cache.device).contiguous()
    if ids.shape[0] and kv_cache.shape[0]:
        _move_blocks(src, kv_cache, None, ids, ids.shape[0])


def copy_blocks(kv_cache: Tensor, src_block_ids: Tensor, dst_block_ids: Tensor) -> None:
    """Copy whole blocks (all layers, K and V) from ``src`` to ``dst`` ids, in place (copy-on-write).

    All copies run at once, so no destination may also be a source (a fresh copy-on-write block never
    is); this is checked when the ids are on the CPU.
    """
    check_kv_cache(kv_cache)
    check_index("src_block_ids", src_block_ids)
    check_index("dst_block_ids", dst_block_ids, src_block_ids.shape[0])
    if src_block_ids.device.type == "cpu" and dst_block_ids.device.type == "cpu":
        pairs = [(s, d) for s, d in zip(src_block_ids.tolist(), dst_block_ids.tolist(), strict=True) if s != d]
        overlap = {d for _, d in pairs} & {s for s, _ in pairs}
        assert not overlap, f"copy_blocks destinations {sorted(overlap)} are also sources"
    src = src_block_ids.to(device=kv_cache.device)
    dst = dst_block_ids.to(device=kv_cache.device)
    if src.shape[0] and kv_cache.shape[0]:
        _move_blocks(kv_cache, kv_cache, src, dst, src.shape[0])
