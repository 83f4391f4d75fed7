"""Pack blocks of the local cache into frame bytes (sender) and unpack frames into blocks (receiver).

Both go through ``kernels.get_kernels(device)`` so a GPU cache uses the Triton gather/scatter.
On the CPU the sender gathers straight into a reusable staging buffer that ZMQ then sends
without copying; the receiver scatters straight out of the buffer ZMQ received into. On CUDA
the data passes through pinned host buffers with asynchronous copies on a side stream, and
each packed or unpacked frame carries an event that says when it is done.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import torch
from torch import Tensor

from kernels import get_kernels
from kvtransfer.frames import FrameSpec
from kvtransfer.layout import KVLayout
from kvtransfer.staging import StagingPool


class PackedFrame:
    """Bytes of one frame in a staging buffer; send them once ``ready()``."""

    def __init__(self, spec: FrameSpec, base: Tensor, nbytes: int, event: Any | None) -> None:
        self.spec = spec
        self.base = base
        self.data = base[:nbytes]
        self.event = event

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def ready(self) -> bool:
        """Whether an asynchronous device-to-host copy has finished (always on the CPU)."""
        return self.event is None or bool(self.event.query())

    def buffer(self) -> Any:
        """The bytes as an object ZMQ can send without copying (it keeps the memory alive)."""
        return self.data.numpy()


class BlockPacker:
    """Gathers ``[layers, 2, blocks, ...]`` frames out of a sender's cache. One I/O thread owns it."""

    def __init__(self, kv_cache: Tensor, layout: KVLayout, budget_bytes: int) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.kernels = get_kernels(kv_cache.device)
        self.is_cuda = kv_cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(kv_cache.device) if self.is_cuda else None
        self.pool = StagingPool(budget_bytes, pin_memory=self.is_cuda)

    def block_ids(self, block_ids: list[int]) -> Tensor:
        """The ids as a tensor on the cache's device, made once per transfer."""
        return torch.tensor(block_ids, dtype=torch.long).to(self.kv_cache.device)

    def frame_bytes(self, spec: FrameSpec) -> int:
        return spec.num_layers * spec.num_blocks * self.layout.bytes_per_block_layer

    def pack(self, spec: FrameSpec, block_ids: Tensor, after: Any | None = None) -> PackedFrame | None:
        """Start packing ``spec`` of the blocks ``block_ids``; ``None`` while staging memory is full.

        ``after`` is a CUDA event the gather must wait for (the engine's write of the blocks).
        """
        nbytes = self.frame_bytes(spec)
        base = self.pool.acquire(nbytes)
        if base is None:
            return None
        shape = self.layout.frame_shape(spec.num_layers, spec.num_blocks)
        out = base[:nbytes].view(self.kv_cache.dtype).view(shape)
        layers = self.kv_cache[spec.layer_start : spec.layer_start + spec.num_layers]
        ids = block_ids[spec.block_start : spec.block_start + spec.num_blocks]
        if self.stream is None:
            self.kernels.gather_blocks(layers, ids, out=out)
            return PackedFrame(spec, base, nbytes, None)
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            packed = self.kernels.gather_blocks(layers, ids)
            out.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return PackedFrame(spec, base, nbytes, event)

    def release(self, frame: PackedFrame) -> None:
        """Give the staging buffer back; ZMQ must be done with it and any copy finished."""
        if frame.event is not None:
            frame.event.synchronize()
        self.pool.release(frame.base)


class BlockUnpacker:
    """Scatters received frames into a receiver's cache. One I/O thread owns it."""

    def __init__(self, kv_cache: Tensor, layout: KVLayout, budget_bytes: int = 256 << 20) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.kernels = get_kernels(kv_cache.device)
        self.is_cuda = kv_cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(kv_cache.device) if self.is_cuda else None
        self.pool = StagingPool(budget_bytes, pin_memory=self.is_cuda)
        self._in_flight: list[tuple[Any, Tensor]] = []

    def block_ids(self, block_ids: list[int]) -> Tensor:
        return torch.tensor(block_ids, dtype=torch.long).to(self.kv_cache.device)

    def unpack(self, spec: FrameSpec, block_ids: Tensor, data: memoryview) -> Any | None:
        """Write one frame into ``block_ids[spec.block_start:...]``; returns a CUDA event or ``None`` (done)."""
        shape = self.layout.frame_shape(spec.num_layers, spec.num_blocks)
        src = torch.frombuffer(data, dtype=torch.uint8)
        layers = self.kv_cache[spec.layer_start : spec.layer_start + spec.num_layers]
        ids = block_ids[spec.block_start : spec.block_start + spec.num_blocks]
        if self.stream is None:
            self.kernels.scatter_blocks(layers, ids, src.view(self.kv_cache.dtype).view(shape))
            return None
        self._reclaim()
        pinned = self.pool.acquire(src.numel())
        if pinned is None:  # staging full: a synchronous pageable copy is slower but correct
            staged = src
        else:
            staged = pinned[: src.numel()]
            staged.copy_(src)
        with torch.cuda.stream(self.stream):
            device_src = staged.to(self.kv_cache.device, non_blocking=pinned is not None)
            self.kernels.scatter_blocks(layers, ids, device_src.view(self.kv_cache.dtype).view(shape))
            event = torch.cuda.Event()
            event.record(self.stream)
        if pinned is not None:
            self._in_flight.append((event, pinned))
        return event

    def _reclaim(self) -> None:
        still = []
        for event, pinned in self._in_flight:
            if event.query():
                self.pool.release(pinned)
            else:
                still.append((event, pinned))
        self._in_flight = still


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
