"""Tensors from Python lists, cheaply: the host's side of every step's small index and parameter lists.

``torch.tensor(list)`` converts element by element (about 0.15 µs each: 40 µs for 256 ids). Packed
into an ``array`` first, whose buffer the CPU tensor then shares, a list costs a few µs whatever its
length up to thousands; on another device the tensor is then copied there.
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
    t = torch.frombuffer(values, dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.to(device)
