"""Reusable host buffers for frames in flight, pinned when the KV cache lives on a GPU.

Reuse matters: a fresh multi-megabyte buffer per frame costs page faults (and, pinned, a slow
driver call) on every transfer. The pool hands out buffers until ``budget_bytes`` are in use,
which also bounds how much a sender queues ahead of the network.
"""

from __future__ import annotations

import torch
from torch import Tensor


class StagingPool:
    """Byte buffers of at least the asked size; ``acquire`` returns ``None`` when over budget.

    Not thread-safe: one I/O thread owns it.
    """

    def __init__(self, budget_bytes: int, pin_memory: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self._free: list[Tensor] = []
        self._allocated = 0
        self._in_use = 0

    @property
    def bytes_in_use(self) -> int:
        return self._in_use

    def acquire(self, nbytes: int) -> Tensor | None:
        """A uint8 buffer of ``>= nbytes``; one larger than the budget is allowed when nothing else is out."""
        best = None
        for i, buf in enumerate(self._free):
            if nbytes <= buf.numel() <= 2 * nbytes and (
                best is None or buf.numel() < self._free[best].numel()
            ):
                best = i
        if best is not None:
            buf = self._free.pop(best)
            self._in_use += buf.numel()
            return buf
        if self._in_use and self._in_use + nbytes > self.budget_bytes:
            return None
        # Drop idle buffers of the wrong size to make room, largest first.
        self._free.sort(key=lambda b: b.numel())
        while self._free and self._allocated + nbytes > self.budget_bytes:
            self._allocated -= self._free.pop().numel()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self._allocated += nbytes
        self._in_use += nbytes
        return buf

    def release(self, buf: Tensor) -> None:
        """Return a buffer from ``acquire``; the caller must no longer read or write it."""
        self._in_use -= buf.numel()
        self._free.append(buf)

    def clear(self) -> None:
        """Free every idle buffer."""
        self._allocated -= sum(b.numel() for b in self._free)
        self._free.clear()
