"""Frame tiling, the receiver's order check, staging reuse, and the checks on the engine's allocation."""

from __future__ import annotations

import pytest
import torch

from kernels import get_kernels
from kvtransfer import Allocation, KVLayout
from kvtransfer.blocks.packing import BlockPacker, BlockUnpacker
from kvtransfer.blocks.staging import StagingPool
from kvtransfer.receiving.block_allocator import check_allocation
from kvtransfer.wire.frames import (
    BlockRuns,
    FrameCursor,
    FrameSpec,
    auto_layers_per_frame,
    check_parts,
    plan_frames,
)


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
        unpacker.unpack(spec, dst_ids, [memoryview(bytearray(part)) for part in frame.parts])
        packer.release(frame)
    assert torch.equal(dst[:, :, [2, 10, 5]], src[:, :, [8, 0, 3]])
    untouched = [b for b in range(11) if b not in (2, 10, 5)]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
    assert torch.equal(get_kernels("cpu").gather_blocks(dst, dst_ids.tensor), src[:, :, [8, 0, 3]])


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


def test_block_runs_find_consecutive_ids() -> None:
    runs = BlockRuns([4, 5, 6, 9, 2, 3, 10, 11, 12, 13])
    assert runs.runs() == [(0, 3, 4), (3, 1, 9), (4, 2, 2), (6, 4, 10)]
    assert runs.runs(1, 6) == [(1, 2, 5), (3, 1, 9), (4, 2, 2), (6, 1, 10)]
    assert runs.first_if_one_run(6, 4) == 10 and runs.first_if_one_run(7, 2) == 11
    assert runs.first_if_one_run(1, 3) is None and runs.first_if_one_run(0, 0) is None
    assert runs.cuts_around_runs(3) == [0, 3, 6, 10]
    assert runs.cuts_around_runs(2) == [0, 3, 4, 6, 10]
    assert BlockRuns([]).runs() == [] and BlockRuns([7]).runs() == [(0, 1, 7)]


def test_plan_never_spans_a_cut() -> None:
    cuts = [3, 9]
    frames = plan_frames(4, 12, 2, 100, 500, cuts=cuts)
    for f in frames:
        assert not any(f.block_start < c < f.block_start + f.num_blocks for c in cuts)
    cursor = FrameCursor(4, 12)
    for frame in frames:
        assert cursor.check(frame) is None
        cursor.advance(frame)
    assert cursor.done


def test_parts_must_be_whole_planes_adding_up_to_the_frame() -> None:
    spec = FrameSpec(0, 2, 0, 3)  # 4 planes of 3 blocks; a block-layer is 100 B, a plane 150 B
    assert check_parts([600], spec, 100) is None
    assert check_parts([150, 300, 150], spec, 100) is None
    assert "expected 600" in (check_parts([150, 300], spec, 100) or "")
    assert "whole planes of 150" in (check_parts([100, 500], spec, 100) or "")
    assert "whole planes" in (check_parts([0, 600], spec, 100) or "")
    assert "expected 1 to 4" in (check_parts([120] * 5, spec, 100) or "")
    assert "expected 1 to 4" in (check_parts([], spec, 100) or "")


def _moved(
    src_ids: list[int],
    dst_ids: list[int],
    max_frame_layers: int,
    dtype: torch.dtype = torch.float32,
    min_run_frame_bytes: int = 0,
) -> tuple[list, torch.Tensor]:
    """Frames of ``src_ids`` moved into ``dst_ids`` in memory; returns them and the sender's cache."""
    gen = torch.Generator().manual_seed(1)
    # float32: a block half is 8 KiB, so runs of 8 go unpacked (16 in half precision).
    src = torch.randn(4, 2, 40, 16, 2, 64, generator=gen).to(dtype)
    dst = torch.randn(4, 2, 40, 16, 2, 64, generator=gen).to(dtype)
    before = dst.clone()
    layout = KVLayout.from_kv_cache(src, "m")
    # Runs get frames of their own from 8 blocks (float32) on, whatever their frames hold in all.
    packer = BlockPacker(src, layout, 1 << 30, min_run_frame_bytes=min_run_frame_bytes)
    unpacker = BlockUnpacker(dst, layout)
    assert packer.min_zero_copy_blocks == 8 * 4 // dtype.itemsize
    send_ids, recv_ids = packer.block_ids(src_ids), unpacker.block_ids(dst_ids)
    frames = []
    specs = plan_frames(
        4,
        len(src_ids),
        max_frame_layers,
        layout.bytes_per_block_layer,
        1 << 30,
        packer.frame_cuts(send_ids, max_frame_layers, 1 << 30),
    )
    for spec in specs:
        frame = packer.pack(spec, send_ids)
        assert frame is not None
        assert (
            check_parts([memoryview(p).nbytes for p in frame.parts], spec, layout.bytes_per_block_layer)
            is None
        )
        # What ZMQ delivers: a copy of each part.
        unpacker.unpack(spec, recv_ids, [memoryview(bytearray(part)) for part in frame.parts])
        frames.append(frame)
        packer.release(frame)
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    untouched = [b for b in range(40) if b not in dst_ids]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
    return frames, src


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_blocks_land_bit_exact_through_run_copies(dtype: torch.dtype) -> None:
    # Two destination runs of 6: the receiver copies them as bytes, run by run.
    _moved(list(range(3, 15)), [*range(20, 26), *range(30, 36)], 2, dtype)
    _moved([9, 1, 30, 4, 5, 6, 7, 8, 22, 23, 24, 39], [*range(20, 26), *range(30, 36)], 4, dtype)


@pytest.mark.parametrize("dst_ids", [list(range(20, 32)), [5, 39, 2, 17, 8, 9, 10, 30, 31, 0, 1, 22]])
def test_consecutive_sender_blocks_go_out_as_views_of_the_cache_and_land_bit_exact(
    dst_ids: list[int],
) -> None:
    frames, src = _moved(list(range(3, 15)), dst_ids, 2)
    assert frames and all(f.zero_copy for f in frames)
    first = frames[0]
    assert len(first.parts) == 4  # K and V of each of its 2 layers
    assert first.parts[0].__array_interface__["data"][0] == src[0, 0, 3].data_ptr()  # not copied
    assert first.parts[1].__array_interface__["data"][0] == src[0, 1, 3].data_ptr()


@pytest.mark.parametrize("dst_ids", [list(range(0, 23)), [*range(39, 28, -1), *range(0, 12)]])
def test_mixed_consecutive_and_scattered_sender_blocks_land_bit_exact(dst_ids: list[int]) -> None:
    src_ids = [*range(20, 30), 3, 7, 5, 0, *range(30, 39)]  # a long run, four strays, another run
    frames, _ = _moved(src_ids, dst_ids, 4)
    assert [f.zero_copy for f in frames] == [True, False, True]
    assert [(f.spec.block_start, f.spec.num_blocks) for f in frames] == [(0, 10), (10, 4), (14, 9)]


def test_runs_whose_frames_would_carry_little_are_packed_with_their_neighbours() -> None:
    src_ids = [*range(20, 30), 3, 7, 5, 0, *range(30, 39)]  # runs of 10 and 9: 640 and 576 KiB frames
    frames, _ = _moved(src_ids, list(range(23)), 4, min_run_frame_bytes=600 << 10)
    assert [(f.spec.block_start, f.spec.num_blocks, f.zero_copy) for f in frames] == [
        (0, 10, True),  # its own frame, sent from the cache
        (10, 13, False),  # the strays and the shorter run, packed together
    ]
    frames, _ = _moved(src_ids, list(range(23)), 4, min_run_frame_bytes=1 << 20)
    assert [(f.spec.num_blocks, f.zero_copy) for f in frames] == [(23, False)]  # one packed frame
    # Groups of 3 layers leave a last group of 1 (4 layers): there the run of 10 would make a
    # 160 KiB frame, below 400 KiB, so it is not cut out, although its 3-layer frames hold 480 KiB.
    frames, _ = _moved(src_ids, list(range(23)), 3, min_run_frame_bytes=400 << 10)
    assert [(f.spec.num_blocks, f.zero_copy) for f in frames] == [(23, False), (23, False)]


def test_short_runs_are_packed() -> None:
    frames, _ = _moved([*range(10, 17), 30], [*range(0, 8)], 4)  # a run of 7 < 8 blocks
    assert [f.zero_copy for f in frames] == [False]


def test_byte_copies_fall_back_to_torch_where_rows_are_not_contiguous() -> None:
    from kvtransfer.blocks.packing import _copy

    src = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    dst = torch.zeros(6, 4, dtype=torch.bfloat16).t()  # a last stride of 4: no byte view of it
    _copy(dst, src)
    assert torch.equal(dst, src)
    rows = torch.zeros(8, 6, dtype=torch.bfloat16)
    _copy(rows[::2], src)  # rows apart, each contiguous: copied as bytes
    assert torch.equal(rows[::2], src) and not rows[1::2].any()
