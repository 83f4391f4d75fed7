"""Pack blocks of the local cache into frame bytes (sender) and unpack frames into blocks (receiver).

On the CPU, a frame whose blocks are one run of consecutive ids in the sender's cache is not
packed at all: each of its K and V planes is already one contiguous range of the cache, and ZMQ
sends those ranges as the frame's parts without copying them. Other frames are gathered into a
reusable staging buffer that ZMQ then sends without copying. The receiver copies straight out of
the buffers ZMQ received into: runs of consecutive destination ids as plain slice copies, scattered
ids through an index copy.

On CUDA every frame is packed by ``kernels.get_kernels(device)`` (the Triton gather/scatter) and
passes through pinned host buffers with asynchronous copies on a side stream; each packed or
unpacked frame carries an event that says when it is done.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kernels import get_kernels
from kvtransfer.blocks.layout import KVLayout
from kvtransfer.blocks.staging import StagingPool
from kvtransfer.wire.frames import BlockRuns, FrameSpec, layer_group

# A plane smaller than this is packed instead (ZMQ copies small zero-copy parts anyway).
MIN_ZERO_COPY_PLANE_BYTES = 64 << 10
# A run of consecutive ids gets frames of its own only when each carries at least this much: every
# frame costs both ends a fixed overhead (measured about 0.2 ms each on a CPU host) that the
# saved pack copy of a shorter run does not repay. Shorter runs are packed with their neighbours.
MIN_RUN_FRAME_BYTES = 1 << 20


class BlockIds:
    """A transfer's block ids: as a tensor on the cache's device, and as runs of consecutive ids."""

    def __init__(self, ids: list[int], device: torch.device) -> None:
        self.runs = BlockRuns(ids)
        self.tensor = torch.tensor(ids, dtype=torch.long).to(device)

    def __len__(self) -> int:
        return len(self.runs.ids)


class PackedFrame:
    """The bytes of one frame, in parts ZMQ can send without copying; send them once ``ready()``.

    ``base`` is the staging buffer of a packed frame, ``None`` when the parts are views of the cache.
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


def _as_bytes(t: Tensor) -> Any:
    """A contiguous CPU tensor as a flat uint8 numpy array sharing its memory (any dtype)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class _CacheSide:
    """What packing and unpacking share: the cache, its kernels, a side stream and staging memory."""

    def __init__(self, kv_cache: Tensor, layout: KVLayout, budget_bytes: int) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.kernels = get_kernels(kv_cache.device)
        self.is_cuda = kv_cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(kv_cache.device) if self.is_cuda else None
        self.pool = StagingPool(budget_bytes, pin_memory=self.is_cuda)

    def block_ids(self, block_ids: list[int]) -> BlockIds:
        """The ids of one transfer on the cache's device, made once per transfer."""
        return BlockIds(block_ids, self.kv_cache.device)


class BlockPacker(_CacheSide):
    """Gathers ``[layers, 2, blocks, ...]`` frames out of a sender's cache. One I/O thread owns it."""

    def __init__(
        self,
        kv_cache: Tensor,
        layout: KVLayout,
        budget_bytes: int,
        min_run_frame_bytes: int = MIN_RUN_FRAME_BYTES,
    ) -> None:
        super().__init__(kv_cache, layout, budget_bytes)
        # Blocks per run below which a run is packed rather than sent as views of the cache.
        self.bytes_per_block_layer = layout.bytes_per_block_layer  # computed once, not per frame
        half_block = self.bytes_per_block_layer // 2
        self.min_zero_copy_blocks = -(-MIN_ZERO_COPY_PLANE_BYTES // half_block)
        self.min_run_frame_bytes = min_run_frame_bytes

    def frame_cuts(self, block_ids: BlockIds, layers_per_frame: int, max_frame_bytes: int) -> list[int]:
        """Where to cut frames so that each long run of consecutive ids goes out unpacked.

        A run qualifies when its frames hold planes of at least ``MIN_ZERO_COPY_PLANE_BYTES`` and
        at least ``min_run_frame_bytes`` in all, also in the smallest layer group ``plan_frames``
        makes of ``layers_per_frame`` (the last one, or fewer layers where frames are capped).
        """
        if self.is_cuda:
            return []
        num_layers = self.layout.num_layers
        group = layer_group(num_layers, layers_per_frame, self.bytes_per_block_layer, max_frame_bytes)
        per_block = min(group, num_layers % group or group) * self.bytes_per_block_layer
        min_length = max(self.min_zero_copy_blocks, -(-self.min_run_frame_bytes // per_block))
        return block_ids.runs.cuts_around_runs(min_length)

    def frame_bytes(self, spec: FrameSpec) -> int:
        return spec.num_layers * spec.num_blocks * self.bytes_per_block_layer

    def pack(self, spec: FrameSpec, block_ids: BlockIds, after: Any | None = None) -> PackedFrame | None:
        """Start packing ``spec`` of the blocks ``block_ids``; ``None`` while staging memory is full.

        ``after`` is a CUDA event the gather must wait for (the engine's write of the blocks). On
        the CPU, blocks that are one long run of consecutive ids come back as views of the cache.
        """
        nbytes = self.frame_bytes(spec)
        layers = self.kv_cache[spec.layer_start : spec.layer_start + spec.num_layers]
        if not self.is_cuda and spec.num_blocks >= self.min_zero_copy_blocks:
            first = block_ids.runs.first_if_one_run(spec.block_start, spec.num_blocks)
            if first is not None:
                planes = layers[:, :, first : first + spec.num_blocks].flatten(0, 1)
                return PackedFrame(spec, [_as_bytes(plane) for plane in planes], nbytes, None, None)
        base = self.pool.acquire(nbytes)
        if base is None:
            return None
        staged = base[:nbytes]
        out = staged.view(self.kv_cache.dtype).view(self.layout.frame_shape(spec.num_layers, spec.num_blocks))
        ids = block_ids.tensor[spec.block_start : spec.block_start + spec.num_blocks]
        event = None
        if self.stream is None:
            self.kernels.gather_blocks(layers, ids, out=out)
        else:
            with torch.cuda.stream(self.stream):
                if after is not None:
                    self.stream.wait_event(after)
                out.copy_(self.kernels.gather_blocks(layers, ids), non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        return PackedFrame(spec, [staged.numpy()], nbytes, base, event)

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

    def unpack(self, spec: FrameSpec, block_ids: BlockIds, parts: list[Any]) -> Any | None:
        """Write one frame into ``block_ids[spec.block_start:...]``; returns a CUDA event or ``None`` (done).

        ``parts`` hold the frame's bytes in order, each a whole number of planes (``check_parts``).
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
            self.kernels.scatter_blocks(layers, ids, device_src.view(self.kv_cache.dtype).view(shape))
            event = torch.cuda.Event()
            event.record(self.stream)
        if pinned is not None:
            self._in_flight.append((event, pinned))
        return event

    def _copy_in(self, spec: FrameSpec, block_ids: BlockIds, planes: Tensor, parts: list[Any]) -> None:
        """CPU: copy each part's planes into ``planes`` (``[2 * layers, pool blocks, ...]``)."""
        n = spec.num_blocks
        runs = block_ids.runs.runs(spec.block_start, n)
        # Few long runs: slice copies. Many short ones: one index copy per part is cheaper.
        by_runs = len(runs) * 4 <= n
        ids = None if by_runs else block_ids.tensor[spec.block_start : spec.block_start + n]
        plane_shape = planes.shape[2:]
        first_plane = 0
        for part in parts:
            src = torch.frombuffer(part, dtype=torch.uint8).view(planes.dtype).view(-1, n, *plane_shape)
            dst = planes[first_plane : first_plane + src.shape[0]]
            if ids is not None:
                dst.index_copy_(1, ids, src)
            else:
                for index, length, first_id in runs:
                    offset = index - spec.block_start
                    _copy(dst[:, first_id : first_id + length], src[:, offset : offset + length])
            first_plane += src.shape[0]

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


def wait(event: Any | None) -> None:
    """Block until a copy started by ``pack``/``unpack`` finished (no-op for ``None``)."""
    if event is not None:
        event.synchronize()
