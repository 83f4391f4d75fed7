"""Moves paged KV blocks between services over ZeroMQ: typed headers, raw zero-copy frames.

The prefill side calls ``KVSender.send``; the decode side runs a ``KVReceiver`` that allocates
blocks through the engine's ``BlockAllocator``. Both are polled from the engine step loop and
report every transfer once as a ``TransferResult``; timeouts, aborts, dead peers and bad frames
free the blocks on both sides.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtransfer.blocks.layout import KVLayout
    from kvtransfer.receiving.block_allocator import Allocation, BlockAllocator, Refusal
    from kvtransfer.receiving.receiver import KVReceiver
    from kvtransfer.sending.sender import KVSender
    from kvtransfer.transfer_state import ABORTED, TransferResult, TransferState
    from kvtransfer.wire.curve import CurveConfig

# Imported on first use: a process that needs only ``kvtransfer.wire`` (the router, for CURVE
# keys) does not pay for torch.
_HOMES = {
    "KVLayout": "kvtransfer.blocks.layout",
    "Allocation": "kvtransfer.receiving.block_allocator",
    "BlockAllocator": "kvtransfer.receiving.block_allocator",
    "Refusal": "kvtransfer.receiving.block_allocator",
    "KVReceiver": "kvtransfer.receiving.receiver",
    "KVSender": "kvtransfer.sending.sender",
    "ABORTED": "kvtransfer.transfer_state",
    "TransferResult": "kvtransfer.transfer_state",
    "TransferState": "kvtransfer.transfer_state",
    "CurveConfig": "kvtransfer.wire.curve",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")


__all__ = [
    "ABORTED",
    "Allocation",
    "BlockAllocator",
    "CurveConfig",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "Refusal",
    "TransferResult",
    "TransferState",
]
