"""Frame tiling, the receiver's order check, staging reuse, and the checks on the engine's allocation."""

from __future__ import annotations

import pytest
import torch

from kernels import get_kernels
from kvtransfer import Allocation, KVLayout
from kvtransfer.block_allocator import check_allocation
from kvtransfer.frames import FrameCursor, FrameSpec, auto_layers_per_frame, plan_frames
from kvtransfer.packing import BlockPacker, BlockUnpacker
from kvtransfer.staging import StagingPool


@pytest.mark.parametrize(
    ("num_layers", "num_blocks", "layers_per_frame", "max_frame_bytes"),
    [(30, 125, 1, 1 << 30), (30, 125, 4, 1 << 30), (7, 5, 3, 10 * 100), (5, 13, 8, 4 * 100), (3, 1, 1, 100)],
)
def test_plan_tiles_every_layer_and_block_once_within_the_limit(
    num_layers: int, num_blocks: int, layers_per_frame: int, max_frame_bytes: int
) -> None:
    frames = plan_frames(num_layers, num_blocks, layers_per_frame, 100, max_frame_bytes)
    covered = [
        (layer, block)
        for f in frames
        for layer in range(f.layer_start, f.layer_start + f.num_layers)
        for block in range(f.block_start, f.block_start + f.num_blocks)
    ]
    assert sorted(covered) == [(layer, block) for layer in range(num_layers) for block in range(num_blocks)]
    assert all(f.num_layers * f.num_blocks * 100 <= max_frame_bytes for f in frames)
    cursor = FrameCursor(num_layers, num_blocks)
    for frame in frames:
        assert cursor.check(frame) is None
        cursor.advance(frame)
    assert cursor.done


def test_cursor_refuses_gaps_repeats_and_overruns() -> None:
    cursor = FrameCursor(num_layers=4, num_blocks=6)
    assert "expected layer 0 block 0" in (cursor.check(FrameSpec(1, 1, 0, 6)) or "")
    assert "blocks up to 7" in (cursor.check(FrameSpec(0, 1, 0, 7)) or "")
    assert "layers up to 5" in (cursor.check(FrameSpec(0, 5, 0, 6)) or "")
    cursor.advance(FrameSpec(0, 2, 0, 3))
    assert "inside a group of 2" in (cursor.check(FrameSpec(0, 1, 3, 3)) or "")
    assert "expected layer 0 block 3" in (cursor.check(FrameSpec(0, 2, 0, 3)) or "")  # a repeat
    cursor.advance(FrameSpec(0, 2, 3, 3))
    cursor.advance(FrameSpec(2, 2, 0, 6))
    assert cursor.done and cursor.check(FrameSpec(4, 1, 0, 1)) == "frame after the last one"


def test_nothing_to_send_plans_no_frames_and_is_done_at_once() -> None:
    assert plan_frames(30, 0, 1, 100, 1000) == []
    assert FrameCursor(30, 0).done
    with pytest.raises(ValueError, match="exceeds the frame limit"):
        plan_frames(30, 1, 1, 100, 99)


def test_pack_then_unpack_moves_blocks_bit_exact_across_ids() -> None:
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(5, 2, 9, 4, 2, 8, generator=gen)
    dst = torch.randn(5, 2, 11, 4, 2, 8, generator=gen)
    before = dst.clone()
    layout = KVLayout.from_kv_cache(src, "m")
    packer, unpacker = BlockPacker(src, layout, 1 << 20), BlockUnpacker(dst, layout)
    src_ids, dst_ids = packer.block_ids([8, 0, 3]), unpacker.block_ids([2, 10, 5])
    for spec in plan_frames(5, 3, 2, layout.bytes_per_block_layer, 2 * layout.bytes_per_block_layer):
        frame = packer.pack(spec, src_ids)
        assert frame is not None and frame.ready()
        unpacker.unpack(spec, dst_ids, memoryview(bytearray(frame.buffer())))
        packer.release(frame)
    assert torch.equal(dst[:, :, [2, 10, 5]], src[:, :, [8, 0, 3]])
    untouched = [b for b in range(11) if b not in (2, 10, 5)]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
    assert torch.equal(get_kernels("cpu").gather_blocks(dst, dst_ids), src[:, :, [8, 0, 3]])


def test_staging_pool_reuses_buffers_and_respects_its_budget() -> None:
    pool = StagingPool(budget_bytes=1000)
    a = pool.acquire(400)
    b = pool.acquire(400)
    assert a is not None and b is not None and pool.acquire(400) is None  # over budget while both are out
    pool.release(a)
    c = pool.acquire(300)
    assert c is not None and c.data_ptr() == a.data_ptr()  # reused, not reallocated
    pool.release(b)
    pool.release(c)
    assert pool.bytes_in_use == 0
    big = pool.acquire(5000)  # larger than the budget: allowed while nothing else is out
    assert big is not None and big.numel() == 5000


@pytest.mark.parametrize(
    ("allocation", "error"),
    [
        (Allocation([1, 2, 3], 0), None),
        (Allocation([1, 2], 0), "2 block ids for 3 blocks"),
        (Allocation([1, 2, 3], 3), "num_cached_blocks 3 outside 0..2"),
        (Allocation([1, 2, 99], 0), "out of range"),
        (Allocation([1, 2, 2], 0), "the same block id twice"),
        (Allocation([2, 2, 3], 1), "the same block id twice"),  # a cached block must not be written
    ],
)
def test_unusable_allocations_are_caught(allocation: Allocation, error: str | None) -> None:
    found = check_allocation(allocation, num_blocks=3, num_hashes=2, num_pool_blocks=10)
    assert (found is None) if error is None else (error in (found or ""))


def test_automatic_frames_hold_about_four_mib() -> None:
    per_layer = 125 * 2 * 16 * 3 * 64 * 4  # a 2,000-token SmolLM2 prompt: 3 MB per layer
    assert auto_layers_per_frame(125, per_layer // 125) == 1
    assert auto_layers_per_frame(1, per_layer // 125) == (4 << 20) // (per_layer // 125)  # short prompt: many
    assert auto_layers_per_frame(10_000, 1 << 20) == 1
