"""Tensors from Python lists, cheaply: the host's side of every step's small index and parameter lists.

``torch.tensor(list)`` converts element by element (about 0.15 µs each: 40 µs for 256 ids). Packed
into an ``array`` first, whose buffer the CPU tensor then shares, a list costs a few µs whatever its
length up to thousands; on another device the tensor is then copied there.

To a GPU every copy goes through pinned memory without blocking (``to_device``): a copy from pageable
memory may wait for the work already queued on the stream, which would end the overlap of the host's
next step with the device's current one (async scheduling). The pinned memory is a ring per stream
(``_Staging``): a tensor's bytes are copied into its next free span, several tensors go up in one copy
(``to_device_all``), and an event marks when a span may be written again. ``Tensor.pin_memory`` took
about 50 µs of host time per tensor on an H200's host (the caching host allocator's bookkeeping and a
pointer query each time), and a decode step uploads a dozen or two small tensors.
"""

from __future__ import annotations

import ctypes
import threading
from array import array
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def long_tensor(values: Iterable[int], device: torch.device | str = "cpu") -> Tensor:
    """``torch.tensor(values, dtype=torch.long, device=device)``."""
    return _packed(array("q", values), torch.long, device)


def long_tensors(lists: Sequence[Iterable[int]], device: torch.device | str = "cpu") -> list[Tensor]:
    """``long_tensor`` of each list, sent to ``device`` in one copy."""
    return to_device_all([_host_tensor(array("q", values), torch.long) for values in lists], device)


def int_tensor(values: Iterable[int], device: torch.device | str = "cpu") -> Tensor:
    """``torch.tensor(values, dtype=torch.int32, device=device)``."""
    return _packed(array("i", values), torch.int32, device)


def float_tensor(values: Iterable[float], device: torch.device | str = "cpu") -> Tensor:
    """``torch.tensor(values, dtype=torch.float32, device=device)`` (each value rounded to float32)."""
    return _packed(array("f", values), torch.float32, device)


def bool_tensor(values: Iterable[bool], device: torch.device | str = "cpu") -> Tensor:
    """``torch.tensor(values, dtype=torch.bool, device=device)``."""
    return _packed(array("b", values), torch.int8, device).bool()


def _packed(values: array, dtype: torch.dtype, device: torch.device | str) -> Tensor:  # type: ignore[type-arg]
    if not values:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype, device=device)
    return to_device(torch.frombuffer(values, dtype=dtype), device)


def _host_tensor(values: array, dtype: torch.dtype) -> Tensor:  # type: ignore[type-arg]
    """A CPU tensor over ``values``' buffer (shared, not copied)."""
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def pinned_for(t: Tensor, device: torch.device) -> Tensor:
    """``t`` ready for a non-blocking copy to ``device``: a CPU tensor in pinned memory when ``device``
    is a GPU, else ``t`` itself."""
    return t.pin_memory() if device.type == "cuda" and t.device.type == "cpu" else t


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """A CPU tensor on ``device``: itself on the CPU; to a GPU through pinned memory, not blocking."""
    return to_device_all((t,), device)[0]


def to_device_all(tensors: Sequence[Tensor], device: torch.device | str) -> list[Tensor]:
    """CPU tensors on ``device``: themselves on the CPU; to a GPU through the current stream's pinned
    ring in one copy, not blocking (each a view of one device buffer), or, too large for the ring,
    through pinned memory of their own."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    if device.type != "cuda":  # the ring's events and streams are CUDA's
        return [t.to(device) for t in tensors]
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    stream = torch.cuda.current_stream(device)
    key = (device, stream.stream_id)
    staging = _STAGING.get(key)
    if staging is None:
        with _STAGING_LOCK:
            staging = _STAGING.setdefault(key, _Staging(device, stream))
    staged = staging.upload(tensors)
    if staged is not None:
        return staged
    return [pinned_for(t, device).to(device, non_blocking=True) for t in tensors]


# Every span of the ring starts at a multiple of this: each tensor's device view is aligned for its dtype.
_ALIGN = 16


class _Staging:
    """A ring of pinned host memory in ``num_chunks`` chunks of ``chunk_bytes``, that one stream's small
    host-to-GPU copies pass through. An upload takes the next span of the current chunk (the next chunk
    when it does not fit: wrapping around, a chunk is reused only after the event recorded after its
    last copy, normally long done), copies its tensors' bytes there on the host, and sends the span up
    with one non-blocking copy on the stream."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, chunk_bytes: int = 1 << 20,
                 num_chunks: int = 8) -> None:
        self.device, self.stream = device, stream
        self.chunk_bytes = chunk_bytes
        self.ring = torch.empty(chunk_bytes * num_chunks, dtype=torch.uint8, pin_memory=True)
        self.events: list[torch.cuda.Event | None] = [None] * num_chunks
        self.chunk = 0
        self.used = 0  # bytes of the current chunk taken
        self.lock = threading.Lock()  # uploads to one stream may come from more than one thread

    def upload(self, tensors: Sequence[Tensor]) -> list[Tensor] | None:
        """The tensors (on the CPU) on the device, with ``self.stream`` current; None when one is not on
        the CPU or they do not fit one chunk."""
        offsets = []
        total = 0
        for t in tensors:
            if t.device.type != "cpu":
                return None
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        if total > self.chunk_bytes:
            return None
        with self.lock:
            if self.used + total > self.chunk_bytes:
                self.chunk = (self.chunk + 1) % len(self.events)
                self.used = 0
                event = self.events[self.chunk]
                if event is not None:
                    event.synchronize()
            start = self.chunk * self.chunk_bytes + self.used
            self.used += total
            span = self.ring[start : start + total]
            pack(tensors, span, offsets)
            up = span.to(self.device, non_blocking=True)  # on the current stream: this ring's
            event = self.events[self.chunk]
            if event is None:
                event = self.events[self.chunk] = torch.cuda.Event()
            event.record(self.stream)
        return [up[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for t, offset in zip(tensors, offsets, strict=True)]


def pack(tensors: Sequence[Tensor], buffer: Tensor, offsets: Sequence[int]) -> None:
    """Each CPU tensor's bytes into the uint8 CPU ``buffer`` at its offset: a ``memmove`` each where
    the tensor is contiguous (a torch ``copy_`` through views of the buffer took four dispatches of
    1-3 µs each on an H200's host), else a copy through a view of its shape."""
    base = buffer.data_ptr()
    for t, offset in zip(tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        if t.is_contiguous():
            if n:
                ctypes.memmove(base + offset, t.data_ptr(), n)
        else:
            buffer[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)


_STAGING: dict[tuple[torch.device, int], _Staging] = {}
_STAGING_LOCK = threading.Lock()


def to_host(t: Tensor) -> Tensor:
    """A GPU tensor's copy in pinned host memory, started without waiting (read it after an event
    recorded after this call); a CPU tensor itself."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
