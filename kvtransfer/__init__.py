"""Moves paged KV blocks between services over ZeroMQ: typed headers, raw zero-copy frames.

The prefill side calls ``KVSender.send``; the decode side runs a ``KVReceiver`` that allocates
blocks through the engine's ``BlockAllocator``. Both are polled from the engine step loop and
report every transfer once as a ``TransferResult``; timeouts, aborts, dead peers and bad frames
free the blocks on both sides.
"""

from kvtransfer.blocks.layout import KVLayout
from kvtransfer.receiving.block_allocator import Allocation, BlockAllocator, Refusal
from kvtransfer.receiving.receiver import KVReceiver
from kvtransfer.sending.sender import KVSender
from kvtransfer.transfer_state import ABORTED, TransferResult, TransferState
from kvtransfer.wire.curve import CurveConfig

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
