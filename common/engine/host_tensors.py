"""Tensors from Python lists, cheaply: the host's side of every step's small index and parameter lists.

``torch.tensor(list)`` converts element by element (about 0.15 µs each: 40 µs for 256 ids). Packed
into an ``array`` first, whose buffer the CPU tensor then shares, a list costs a few µs whatever its
length up to thousands; on another device the tensor is then copied there.

To a GPU every copy goes through pinned memory without blocking (``to_device``): a copy from pageable
memory may wait for the work already queued on the stream, which would end the overlap of the host's
next step with the device's current one (async scheduling). The caching host allocator keeps each
pinned block until the copy that reads it has run.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch
from torch import Tensor


def long_tensor(values: Iterable[int], device: torch.device | str = "cpu") -> Tensor:
    """``torch.tensor(values, dtype=torch.long, device=device)``."""
    return _packed(array("q", values), torch.long, device)


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


def pinned_for(t: Tensor, device: torch.device) -> Tensor:
    """``t`` ready for a non-blocking copy to ``device``: a CPU tensor in pinned memory when ``device``
    is a GPU, else ``t`` itself."""
    return t.pin_memory() if device.type == "cuda" and t.device.type == "cpu" else t


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """A CPU tensor on ``device``: itself on the CPU; to a GPU through pinned memory, not blocking."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cpu":
        return t
    return pinned_for(t, device).to(device, non_blocking=True)


def to_host(t: Tensor) -> Tensor:
    """A GPU tensor's copy in pinned host memory, started without waiting (read it after an event
    recorded after this call); a CPU tensor itself."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
