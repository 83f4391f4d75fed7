"""Pack blocks of the local cache into frame bytes (sender) and unpack frames into blocks (receiver).

On the CPU a frame goes out as a plan of parts (``PartPlan``): every run of consecutive ids long
enough to be worth it (``min_zero_copy_bytes`` per plane) is a view of the cache that ZMQ sends
without copying, and only the rest of the frame's blocks are gathered, with one index copy, into a
reusable staging buffer whose slices sit between those views. So the gather copy shrinks to the
fragmented remainder, and a frame of one run needs no copy at all. The receiver copies straight
out of the buffers ZMQ received into: each part is cut at plane boundaries, runs of consecutive
destination ids get plain slice copies and fragmented ones one index copy per piece.

On CUDA every frame is packed by ``pdserve_kernels.get_kernels(device)`` (the Triton gather/scatter) and
passes through pinned host buffers with asynchronous copies on a side stream; each packed or
unpacked frame carries an event that says when it is done.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvtransfer.blocks.layout import KVLayout
from kvtransfer.blocks.staging import StagingPool
from kvtransfer.wire.frames import MAX_DATA_PARTS, BlockRuns, FrameSpec
from pdserve_kernels import get_kernels

# A run whose bytes in one plane are fewer than this is gathered instead of sent as a view. Every
# part costs both ends something (a ZMQ message part, a piece to copy on the receiver): measured
# on a CPU host, 3 MiB sent as 48 zero-copy parts of 64 KiB took ZMQ twice the CPU of 12 parts of
# 256 KiB, and with 64 KiB the runs of a strict-LRU pool's recycled ids (6 to 13 blocks of 12 KiB)
# went out as views and the receiver's copies took 1.5x as long as from one gathered part.
MIN_ZERO_COPY_PLANE_BYTES = 256 << 10
# Pieces of a received frame with at least this many blocks per destination run on average are
# copied run by run; more fragmented ones take one index copy (fewer Python calls per byte).
MIN_BLOCKS_PER_COPIED_RUN = 4


class BlockIds:
    """A transfer's block ids: as a tensor on the cache's device, and as runs of consecutive ids.

    On a GPU nothing here waits for the device. The ids go up from pinned memory on ``stream``, the
    side stream whose kernels read them (a plain ``.to(device)`` from pageable memory would wait
    for everything queued on the caller's stream: on the engine's thread, the step in flight).
    With ``after_caller``, ``after`` is an event recorded on the caller's stream now: work the engine
    queued before these blocks were given to the transfer (the step in flight writing a slot of a
    request that has just finished, a scrub zeroing freed blocks) that the scatter into them must
    wait for (``BlockUnpacker.unpack``)."""

    def __init__(self, ids: list[int], device: torch.device, stream: Any | None = None,
                 after_caller: bool = False) -> None:
        self.runs = BlockRuns(ids)
        self.array = np.asarray(ids, dtype=np.int64)  # for numpy index copies on the CPU
        self.after: Any | None = None
        if stream is None:
            self.tensor = torch.from_numpy(self.array).to(device)
            return
        if after_caller:
            self.after = torch.cuda.Event()
            self.after.record(torch.cuda.current_stream(device))
        # The caching host allocator keeps the pinned block until the copy that reads it is done.
        host = torch.from_numpy(self.array).pin_memory()
        with torch.cuda.stream(stream):
            self.tensor = host.to(device, non_blocking=True)

    def __len__(self) -> int:
        return len(self.runs.ids)


class PackedFrame:
    """The bytes of one frame, in parts ZMQ can send without copying; send them once ``ready()``.

    ``base`` is the staging buffer holding the gathered part of the frame, ``None`` when every part
    is a view of the cache.
    """

    def __init__(
        self, spec: FrameSpec, parts: list[Any], nbytes: int, base: Tensor | None, event: Any | None
    ) -> None:
        self.spec = spec
        self.parts = parts  # objects ZMQ sends without copying; each keeps its memory alive
        self.nbytes = nbytes
        self.base = base
        self.event = event

    @property
    def zero_copy(self) -> bool:
        return self.base is None

    def ready(self) -> bool:
        """Whether an asynchronous device-to-host copy has finished (always on the CPU)."""
        return self.event is None or bool(self.event.query())


def _as_plane_bytes(planes: Tensor) -> np.ndarray:
    """``[planes, blocks, elements]`` of a CPU cache as uint8 numpy ``[planes, blocks, bytes]``, sharing memory."""
    return planes.view(torch.uint8).numpy()


class _CacheSide:
    """What packing and unpacking share: the cache, its kernels, a side stream and staging memory."""

    def __init__(self, kv_cache: Tensor, layout: KVLayout, budget_bytes: int) -> None:
        if not kv_cache.is_contiguous():  # byte views of it must share its memory
            raise ValueError("kv_cache must be contiguous")
        self.kv_cache = kv_cache
        self.layout = layout
        self.kernels = get_kernels(kv_cache.device)
        self.is_cuda = kv_cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(kv_cache.device) if self.is_cuda else None
        self.pool = StagingPool(budget_bytes, pin_memory=self.is_cuda)

    def block_ids(self, block_ids: list[int]) -> BlockIds:
        """The ids of one transfer on the cache's device, made once per transfer."""
        return BlockIds(block_ids, self.kv_cache.device, self.stream)


class PartPlan(NamedTuple):
    """How one CPU frame goes out: which of its runs are sent as views, which blocks are gathered.

    ``segments`` walk one plane's blocks in order as ``(index in the frame, length, first id,
    as a view)``; every plane of the frame has the same segments. ``gathered`` holds the frame
    indices of the blocks not sent as views, in order.
    """

    segments: list[tuple[int, int, int, bool]]
    gathered: list[int]


class BlockPacker(_CacheSide):
    """Gathers ``[layers, 2, blocks, ...]`` frames out of a sender's cache. One I/O thread owns it."""

    def __init__(
        self,
        kv_cache: Tensor,
        layout: KVLayout,
        budget_bytes: int,
        min_zero_copy_bytes: int = MIN_ZERO_COPY_PLANE_BYTES,
    ) -> None:
        super().__init__(kv_cache, layout, budget_bytes)
        self.bytes_per_block_layer = layout.bytes_per_block_layer  # computed once, not per frame
        self.bytes_per_block_plane = self.bytes_per_block_layer // 2
        # Blocks per run below which a run is gathered rather than sent as views of the cache.
        self.min_zero_copy_blocks = max(1, -(-min_zero_copy_bytes // self.bytes_per_block_plane))

    def frame_bytes(self, spec: FrameSpec) -> int:
        return spec.num_layers * spec.num_blocks * self.bytes_per_block_layer

    def part_plan(self, spec: FrameSpec, block_ids: BlockIds) -> PartPlan:
        """Which runs of ``spec``'s blocks go out as views, within ``MAX_DATA_PARTS`` parts a frame."""
        runs = block_ids.runs.runs(spec.block_start, spec.num_blocks)
        long = sorted((r for r in runs if r[1] >= self.min_zero_copy_blocks), key=lambda r: -r[1])
        # Each plane takes a part per view and at most one per gathered stretch between them.
        max_views = max(0, (MAX_DATA_PARTS // (2 * spec.num_layers) - 1) // 2)
        as_view = {r[0] for r in long[:max_views]}
        if not as_view:  # all gathered (scattered ids): skip the walk over the runs
            return PartPlan([(0, spec.num_blocks, runs[0][2], False)], list(range(spec.num_blocks)))
        segments: list[tuple[int, int, int, bool]] = []
        gathered: list[int] = []
        for index, length, first_id in runs:
            view = index in as_view
            if not view:
                gathered.extend(range(index - spec.block_start, index - spec.block_start + length))
            if segments and not view and not segments[-1][3]:  # merge neighbouring gathered runs
                start, prev_length, prev_first, _ = segments[-1]
                segments[-1] = (start, prev_length + length, prev_first, False)
            else:
                segments.append((index - spec.block_start, length, first_id, view))
        return PartPlan(segments, gathered)

    def pack(self, spec: FrameSpec, block_ids: BlockIds, after: Any | None = None) -> PackedFrame | None:
        """Start packing ``spec`` of the blocks ``block_ids``; ``None`` while staging memory is full.

        ``after`` is a CUDA event the gather must wait for (the engine's write of the blocks). On
        the CPU, long runs of consecutive ids come back as views of the cache (``part_plan``).
        """
        nbytes = self.frame_bytes(spec)
        layers = self.kv_cache[spec.layer_start : spec.layer_start + spec.num_layers]
        if not self.is_cuda:
            return self._pack_cpu(spec, block_ids, layers, nbytes)
        base = self.pool.acquire(nbytes)
        if base is None:
            return None
        staged = base[:nbytes]
        out = staged.view(self.kv_cache.dtype).view(self.layout.frame_shape(spec.num_layers, spec.num_blocks))
        ids = block_ids.tensor[spec.block_start : spec.block_start + spec.num_blocks]
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            out.copy_(self.kernels.gather_blocks(layers, ids), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return PackedFrame(spec, [staged.numpy()], nbytes, base, event)

    def _pack_cpu(self, spec: FrameSpec, block_ids: BlockIds, layers: Tensor, nbytes: int) -> PackedFrame | None:
        plan = self.part_plan(spec, block_ids)
        num_planes = 2 * spec.num_layers
        # [planes, pool blocks, one block's bytes]: a plane's run of ids is one contiguous range.
        planes = layers.flatten(0, 1).flatten(2)
        plane_bytes = _as_plane_bytes(planes)
        base = None
        staged_np = None
        if plan.gathered:
            gathered_bytes = num_planes * len(plan.gathered) * self.bytes_per_block_plane
            base = self.pool.acquire(gathered_bytes)
            if base is None:
                return None
            out = base[:gathered_bytes].view(planes.dtype).view(num_planes, len(plan.gathered), planes.shape[2])
            ids = block_ids.tensor[spec.block_start : spec.block_start + spec.num_blocks]
            if len(plan.gathered) < spec.num_blocks:
                ids = ids[torch.tensor(plan.gathered, dtype=torch.long)]
            torch.index_select(planes, 1, ids, out=out)
            staged_np = base[:gathered_bytes].numpy()
        parts: list[Any] = []
        unit = self.bytes_per_block_plane
        pending = (0, 0)  # a stretch of the staging buffer not yet made a part
        offset = 0  # where the next gathered bytes sit in the staging buffer
        for plane in range(num_planes):
            for _, length, first_id, view in plan.segments:
                if view:
                    if pending[1] > pending[0]:
                        parts.append(staged_np[pending[0] : pending[1]])  # type: ignore[index]
                    pending = (offset, offset)
                    parts.append(plane_bytes[plane, first_id : first_id + length].reshape(-1))
                else:
                    offset += length * unit
                    pending = (pending[0], offset)
        if pending[1] > pending[0]:
            parts.append(staged_np[pending[0] : pending[1]])  # type: ignore[index]
        return PackedFrame(spec, parts, nbytes, base, None)

    def release(self, frame: PackedFrame) -> None:
        """Give the staging buffer back; ZMQ must be done with it and any copy finished."""
        if frame.event is not None:
            frame.event.synchronize()
        if frame.base is not None:
            self.pool.release(frame.base)


class BlockUnpacker(_CacheSide):
    """Scatters received frames into a receiver's cache. One I/O thread owns it."""

    def __init__(self, kv_cache: Tensor, layout: KVLayout, budget_bytes: int = 256 << 20) -> None:
        super().__init__(kv_cache, layout, budget_bytes)
        self._in_flight: list[tuple[Any, Tensor]] = []

    def block_ids(self, block_ids: list[int]) -> BlockIds:
        """The ids of one transfer's blocks, made on the engine's thread when it gives them: on a GPU,
        with the event the scatters into them wait for (``BlockIds.after``)."""
        return BlockIds(block_ids, self.kv_cache.device, self.stream, after_caller=True)

    def unpack(self, spec: FrameSpec, block_ids: BlockIds, parts: list[Any]) -> Any | None:
        """Write one frame into ``block_ids[spec.block_start:...]``; returns a CUDA event or ``None`` (done).

        ``parts`` hold the frame's bytes in order, each a whole number of block-planes (``check_parts``).
        """
        shape = self.layout.frame_shape(spec.num_layers, spec.num_blocks)
        layers = self.kv_cache[spec.layer_start : spec.layer_start + spec.num_layers]
        if self.stream is None:
            self._copy_in(spec, block_ids, layers.flatten(0, 1), parts)
            return None
        ids = block_ids.tensor[spec.block_start : spec.block_start + spec.num_blocks]
        nbytes = sum(memoryview(p).nbytes for p in parts)
        self._reclaim()
        pinned = self.pool.acquire(nbytes)
        if pinned is None and len(parts) == 1:
            # Staging full: a synchronous copy from pageable memory is slower but correct.
            staged = torch.frombuffer(parts[0], dtype=torch.uint8)
        else:
            staged = pinned[:nbytes] if pinned is not None else torch.empty(nbytes, dtype=torch.uint8)
            offset = 0
            for part in parts:
                src = torch.frombuffer(part, dtype=torch.uint8)
                _copy(staged[offset : offset + src.numel()], src)
                offset += src.numel()
        with torch.cuda.stream(self.stream):
            device_src = staged.to(self.kv_cache.device, non_blocking=pinned is not None)
            if block_ids.after is not None:  # the engine's writes queued before it gave the blocks
                self.stream.wait_event(block_ids.after)
            self.kernels.scatter_blocks(layers, ids, device_src.view(self.kv_cache.dtype).view(shape))
            event = torch.cuda.Event()
            event.record(self.stream)
        if pinned is not None:
            self._in_flight.append((event, pinned))
        return event

    def _copy_in(self, spec: FrameSpec, block_ids: BlockIds, planes: Tensor, parts: list[Any]) -> None:
        """CPU: copy the parts into ``planes`` (``[2 * layers, pool blocks, ...]``).

        The parts concatenate to the frame's bytes, plane after plane, each a whole number of
        block-planes (``check_parts``); a part is cut where a plane ends.
        """
        n = spec.num_blocks
        dst = _as_plane_bytes(planes.flatten(2))  # [planes, pool blocks, bytes of a block-plane]
        unit = dst.shape[2]
        at = 0  # the next block-plane of the frame, counted plane after plane
        for part in parts:
            src = np.frombuffer(part, dtype=np.uint8).reshape(-1, unit)
            done = 0
            while done < len(src):
                plane, block = divmod(at, n)
                if block == 0 and len(src) - done >= n:  # whole planes at once
                    count = (len(src) - done) // n
                    piece = src[done : done + count * n].reshape(count, n, unit)
                else:
                    count = 1
                    piece = src[done : done + min(n - block, len(src) - done)].reshape(1, -1, unit)
                self._scatter(dst[plane : plane + count], piece, block_ids, spec.block_start + block)
                done += piece.shape[0] * piece.shape[1]
                at += piece.shape[0] * piece.shape[1]

    @staticmethod
    def _scatter(dst: np.ndarray, src: np.ndarray, block_ids: BlockIds, start: int) -> None:
        """Write ``src`` (``[planes, k, bytes]``) into ``dst``'s blocks ``block_ids[start:start + k]``."""
        k = src.shape[1]
        if block_ids.runs.num_runs(start, k) * MIN_BLOCKS_PER_COPIED_RUN <= k:
            for index, length, first_id in block_ids.runs.runs(start, k):
                offset = index - start
                np.copyto(dst[:, first_id : first_id + length], src[:, offset : offset + length])
        else:
            dst[:, block_ids.array[start : start + k]] = src

    def _reclaim(self) -> None:
        still = []
        for event, pinned in self._in_flight:
            if event.query():
                self.pool.release(pinned)
            else:
                still.append((event, pinned))
        self._in_flight = still


def _copy(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` for CPU tensors, as numpy byte copies where their rows are contiguous.

    numpy copies each contiguous row with the C library's ``memcpy``: faster than torch's element
    loop for rows of this size, and with non-temporal stores (``common.glibc_env``) it does not
    read the cold destination first. Any dtype: the bytes are copied.
    """
    if dst.stride(-1) != 1 or src.stride(-1) != 1:  # no byte view of these: torch copies them
        dst.copy_(src)
        return
    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())


def use_one_cpu_thread() -> None:
    """Make torch CPU copies issued by the calling thread single-threaded; other threads keep theirs.

    The engine owns the cores: an OpenMP-parallel gather in an I/O thread competes with it, and on
    a busy machine a parallel copy waits for its slowest worker (measured 8x slower than one
    thread). ``torch.set_num_threads`` would also change the default of threads started later, so
    the calling thread's OpenMP setting is changed directly; without libgomp this does nothing.
    """
    torch.get_num_threads()  # torch initialises this thread's OpenMP setting on first use
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(1)


def use_cache_device(kv_cache: Tensor) -> None:
    """Make the cache's GPU the calling thread's current device (an I/O thread's is GPU 0 otherwise).
    Streams switch devices on their own, but an event's ``query`` or ``synchronize`` and leaving a
    stream's context touch the current device: on GPU 0, for an engine on another GPU, that made a
    CUDA context there (half a GiB of another engine's GPU). Nothing on the CPU."""
    if kv_cache.device.type == "cuda":
        torch.cuda.set_device(kv_cache.device)


def wait(event: Any | None) -> None:
    """Block until a copy started by ``pack``/``unpack`` finished (no-op for ``None``)."""
    if event is not None:
        event.synchronize()


def order_after(event: Any | None, device: torch.device) -> None:
    """Queue a wait for ``event`` on the calling thread's current stream of ``device``: whatever that
    thread queues there afterwards (the engine's next steps) runs after the copy the event marks, and
    the host waits for nothing (no-op for ``None``)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
