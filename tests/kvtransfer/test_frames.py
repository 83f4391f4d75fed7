"""Frame tiling, the receiver's order check, staging reuse, and the checks on the engine's allocation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

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
from pdserve_kernels import get_kernels


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
        (Allocation([2, 2, 3], 1, num_released_blocks=1), None),  # out of a window: a placeholder, not held
        (Allocation([2, 2, 2], 2, num_released_blocks=2), None),
        (Allocation([2, 2, 3], 1, num_released_blocks=2), "num_released_blocks 2 outside 0..1"),
        (Allocation([2, 3, 3], 1, num_released_blocks=1), "the same block id twice"),
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
    for start in range(10):
        for count in range(1, 11 - start):
            assert runs.num_runs(start, count) == len(runs.runs(start, count)), (start, count)
    assert BlockRuns([]).runs() == [] and BlockRuns([7]).runs() == [(0, 1, 7)]


def test_parts_must_be_whole_block_planes_adding_up_to_the_frame() -> None:
    spec = FrameSpec(0, 2, 0, 3)  # 4 planes of 3 blocks; a block-layer is 100 B, a block-plane 50 B
    assert check_parts([600], spec, 100) is None
    assert check_parts([150, 300, 150], spec, 100) is None
    assert check_parts([50, 200, 350], spec, 100) is None  # cuts inside planes, between blocks
    assert "expected 600" in (check_parts([150, 300], spec, 100) or "")
    assert "whole block-planes of 50" in (check_parts([120, 480], spec, 100) or "")
    assert "whole block-planes" in (check_parts([0, 600], spec, 100) or "")
    assert "expected 1 to 4" in (check_parts([50] * 12, spec, 100, max_parts=4) or "")
    assert "expected 1 to 4" in (check_parts([], spec, 100, max_parts=4) or "")


def _caches(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, KVLayout]:
    gen = torch.Generator().manual_seed(1)
    # float32: a block-plane is 8 KiB, so runs of 8 go out as views (16 in half precision).
    src = torch.randn(4, 2, 40, 16, 2, 64, generator=gen).to(dtype)
    dst = torch.randn(4, 2, 40, 16, 2, 64, generator=gen).to(dtype)
    return src, dst, KVLayout.from_kv_cache(src, "m")


def _moved(
    src_ids: list[int],
    dst_ids: list[int],
    max_frame_layers: int,
    dtype: torch.dtype = torch.float32,
    min_zero_copy_bytes: int = 64 << 10,
) -> tuple[list, torch.Tensor]:
    """Frames of ``src_ids`` moved into ``dst_ids`` in memory; returns them and the sender's cache."""
    assert len(src_ids) == len(dst_ids)
    src, dst, layout = _caches(dtype)
    before = dst.clone()
    packer = BlockPacker(src, layout, 1 << 30, min_zero_copy_bytes=min_zero_copy_bytes)
    unpacker = BlockUnpacker(dst, layout)
    send_ids, recv_ids = packer.block_ids(src_ids), unpacker.block_ids(dst_ids)
    frames = []
    for spec in plan_frames(4, len(src_ids), max_frame_layers, layout.bytes_per_block_layer, 1 << 30):
        frame = packer.pack(spec, send_ids)
        assert frame is not None
        lengths = [memoryview(p).nbytes for p in frame.parts]
        assert check_parts(lengths, spec, layout.bytes_per_block_layer) is None
        # What ZMQ delivers: a copy of each part.
        unpacker.unpack(spec, recv_ids, [memoryview(bytearray(part)) for part in frame.parts])
        frames.append(frame)
        packer.release(frame)
    assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    untouched = [b for b in range(40) if b not in dst_ids]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])
    assert packer.pool.bytes_in_use == 0
    return frames, src


def _address(part: object) -> int:
    return int(part.__array_interface__["data"][0])  # type: ignore[attr-defined]


def _block_planes(frame: object) -> list[int]:
    return [memoryview(p).nbytes // (8 << 10) for p in frame.parts]  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_half_precision_blocks_land_bit_exact_through_run_copies(dtype: torch.dtype) -> None:
    """(And an 8-bit cache's, ``--kv-cache-dtype fp8`` or ``fp8_e5m2``: the frames carry bytes, whatever they hold.)"""
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
    assert _address(first.parts[0]) == src[0, 0, 3].data_ptr()  # not copied
    assert _address(first.parts[1]) == src[0, 1, 3].data_ptr()


FRAGMENTED_DST = [3, 17, 4, 9, 30, *range(10, 16), 33, 0, 1, 2, 20, 21, 38, 37, 36, 35, 34, 5]


@pytest.mark.parametrize("dst_ids", [list(range(0, 23)), [*range(39, 28, -1), *range(0, 12)], FRAGMENTED_DST])
def test_fragmented_frame_sends_its_runs_from_the_cache_gathers_the_rest_and_lands_bit_exact(
    dst_ids: list[int],
) -> None:
    src_ids = [*range(20, 30), 3, 7, 5, 0, *range(30, 39)]  # a long run, four strays, another run
    frames, src = _moved(src_ids, dst_ids, 4)
    [frame] = frames  # 4 layers of 23 blocks: one frame, 8 planes
    assert not frame.zero_copy  # the strays needed a staging buffer
    assert _block_planes(frame) == [10, 4, 9] * 8  # per plane: the run, the gathered strays, the other run
    for plane in range(8):
        layer, kv = divmod(plane, 2)
        assert _address(frame.parts[3 * plane]) == src[layer, kv, 20].data_ptr()
        assert _address(frame.parts[3 * plane + 2]) == src[layer, kv, 30].data_ptr()


def test_gathered_stretches_of_neighbouring_planes_make_one_part() -> None:
    # Strays, a run, a stray: one plane ends gathered and the next starts gathered, as one part.
    frames, _ = _moved([2, 9, *range(20, 30), 5], list(range(13)), 2)
    assert [_block_planes(f) for f in frames] == [[2, 10, 3, 10, 3, 10, 3, 10, 1]] * 2


def test_short_runs_are_gathered() -> None:
    frames, _ = _moved([*range(10, 17), 30], [*range(0, 8)], 4)  # a run of 7 < 8 blocks
    assert [(f.zero_copy, len(f.parts)) for f in frames] == [(False, 1)]
    frames, _ = _moved(list(range(3, 15)), list(range(12)), 4, min_zero_copy_bytes=1 << 20)
    assert [(f.zero_copy, len(f.parts)) for f in frames] == [(False, 1)]


def test_a_frame_with_more_runs_than_parts_allowed_gathers_the_shortest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtransfer.blocks import packing

    monkeypatch.setattr(packing, "MAX_DATA_PARTS", 6)  # one layer: 2 planes of (gathered, view, gathered)
    src_ids = [*range(0, 8), 20, *range(30, 40), 25]
    frames, src = _moved(src_ids, list(range(20)), 1)
    assert len(frames) == 4
    for frame in frames:
        assert _block_planes(frame) == [9, 10, 1 + 9, 10, 1]
        assert _address(frame.parts[1]) == src[frame.spec.layer_start, 0, 30].data_ptr()


@pytest.mark.parametrize("seed", range(4))
def test_any_cut_of_a_frame_into_whole_block_planes_lands_bit_exact(seed: int) -> None:
    src, dst, layout = _caches()
    before = dst.clone()
    gen = torch.Generator().manual_seed(seed)
    src_ids = torch.randperm(40, generator=gen)[:11].tolist()
    dst_ids = list(dict.fromkeys([*range(4, 9), *torch.randperm(40, generator=gen).tolist()]))[:11]
    spec = FrameSpec(1, 3, 0, 11)  # layers 1-3: 6 planes of 11 blocks
    frame = src[1:4, :, src_ids].contiguous().view(torch.uint8).flatten().numpy()
    unit = layout.bytes_per_block_layer // 2
    cuts = sorted(set(torch.randint(1, 66, (7,), generator=gen).tolist()))
    bounds = [0, *(c * unit for c in cuts), frame.nbytes]
    parts = [memoryview(bytearray(frame[lo:hi])) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    assert check_parts([p.nbytes for p in parts], spec, layout.bytes_per_block_layer) is None
    unpacker = BlockUnpacker(dst, layout)
    unpacker.unpack(spec, unpacker.block_ids(dst_ids), parts)
    assert torch.equal(dst[1:4, :, dst_ids], src[1:4, :, src_ids])
    others = [b for b in range(40) if b not in dst_ids]
    assert torch.equal(dst[1:4, :, others], before[1:4, :, others])
    assert torch.equal(dst[0], before[0])


def test_byte_copies_fall_back_to_torch_where_rows_are_not_contiguous() -> None:
    from kvtransfer.blocks.packing import _copy

    src = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    dst = torch.zeros(6, 4, dtype=torch.bfloat16).t()  # a last stride of 4: no byte view of it
    _copy(dst, src)
    assert torch.equal(dst, src)
    rows = torch.zeros(8, 6, dtype=torch.bfloat16)
    _copy(rows[::2], src)  # rows apart, each contiguous: copied as bytes
    assert torch.equal(rows[::2], src) and not rows[1::2].any()


class _FakeCuda:
    """The CUDA calls of ``BlockIds`` and ``BlockUnpacker.unpack`` on a GPU, logged in order, on the CPU:
    streams are names, events record where they were recorded, copies say whether they block."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, ...]] = []
        self.stream = "engine"  # the caller's current stream
        fake = self

        class Event:
            def record(self, stream: object) -> None:
                self.on = stream if isinstance(stream, str) else "side"
                fake.log.append(("record", self.on))

            def query(self) -> bool:
                return True

        class Side:
            def wait_event(self, event: Event) -> None:
                fake.log.append(("wait", event.on))

        self.side = Side()

        @contextlib.contextmanager
        def stream(s: Side) -> Iterator[None]:
            before, fake.stream = fake.stream, "side"
            try:
                yield
            finally:
                fake.stream = before

        original_to = torch.Tensor.to

        self.paused = False

        def to(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            if not fake.paused:
                fake.log.append(("copy", fake.stream, "async" if kwargs.get("non_blocking") else "blocking"))
            return original_to(tensor, *args, **{k: v for k, v in kwargs.items() if k != "non_blocking"})

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.stream)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: tensor)
        monkeypatch.setattr(torch.Tensor, "to", to)


def test_on_a_gpu_the_ids_go_up_without_a_wait_and_the_scatter_waits_for_the_engine_s_earlier_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's thread gives a transfer its blocks (``BlockUnpacker.block_ids``) while its step may
    still be running: the ids' copy must not wait for that step (a blocking copy would, and a decode
    instance would lose its overlap of steps), and the scatter into the blocks must wait for what the
    engine had queued when it gave them (the step in flight may still write a slot of a request that
    just finished, whose blocks these may be)."""
    from kvtransfer.blocks.packing import BlockIds

    src, dst, layout = _caches()
    cuda = _FakeCuda(monkeypatch)
    unpacker = BlockUnpacker(dst, layout)  # a CPU cache, turned into a GPU one's below
    unpacker.stream, unpacker.is_cuda = cuda.side, True
    scatter = unpacker.kernels.scatter_blocks

    def logged_scatter(*args: object) -> None:
        cuda.log.append(("scatter", cuda.stream))
        cuda.paused = True  # the CPU's scatter, standing in for the GPU's kernel, copies as it likes
        try:
            scatter(*args)
        finally:
            cuda.paused = False

    monkeypatch.setattr(unpacker, "kernels", SimpleNamespace(scatter_blocks=logged_scatter))
    ids = unpacker.block_ids([7, 3, 12])
    assert cuda.log == [("record", "engine"), ("copy", "side", "async")]
    assert ids.tensor.tolist() == [7, 3, 12] and ids.after is not None
    cuda.log.clear()
    spec = FrameSpec(0, 2, 0, 3)
    frame = src[0:2, :, [1, 2, 4]].contiguous().view(torch.uint8).flatten().numpy()
    unpacker.unpack(spec, ids, [memoryview(bytearray(frame))])
    assert cuda.log == [("copy", "side", "async"), ("wait", "engine"), ("scatter", "side"), ("record", "side")]
    assert torch.equal(dst[0:2, :, [7, 3, 12]], src[0:2, :, [1, 2, 4]])
    # The sender's ids wait for nothing: its gathers wait for the engine's write event of the blocks.
    cuda.log.clear()
    sent = BlockIds([1, 2], dst.device, cuda.side)
    assert cuda.log == [("copy", "side", "async")] and sent.after is None


def test_a_failed_transfer_s_blocks_go_back_with_the_engine_s_stream_waiting_for_its_scatter_not_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An aborted or failed transfer gives its blocks back on the engine's thread (``poll``, ``abort``)
    while a scatter into them may still run on the side stream: the engine's stream waits for it, so
    its next writes into the blocks come after, and the engine's thread goes on at once (a host wait
    there would stall a decode instance's steps behind the transfer's copies). Once per transfer."""
    from kvtransfer.receiving.receiver import KVReceiver

    log: list[object] = []

    class Event:
        def synchronize(self) -> None:
            log.append("the host waits")

    class Stream:
        def wait_event(self, event: Event) -> None:
            log.append(("the engine's stream waits", event))

    stream = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    allocator = SimpleNamespace(release_transfer=lambda request_id: log.append(("released", request_id)))
    receiver = SimpleNamespace(kv_cache=SimpleNamespace(device=torch.device("cuda", 0)), allocator=allocator)
    scatter = Event()
    record = SimpleNamespace(allocation=object(), released=False, last_event=scatter, request_id="r")
    KVReceiver._release(receiver, record)  # type: ignore[arg-type]
    KVReceiver._release(receiver, record)  # type: ignore[arg-type]
    assert log == [("the engine's stream waits", scatter), ("released", "r")]
    # On the CPU the scatter is done when it returns: nothing to wait for.
    log.clear()
    record = SimpleNamespace(allocation=object(), released=False, last_event=None, request_id="c")
    KVReceiver._release(receiver, record)  # type: ignore[arg-type]
    assert log == [("released", "c")]
