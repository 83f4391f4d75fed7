"""``KVSender``: the prefill side. Hands a request's KV blocks to a decode instance, polled.

Every method returns at once; a background I/O thread does the networking and the packing. The
engine must not write or free the blocks of a request from ``send`` until ``poll`` has returned
that request's result (ok or not); after that this layer never writes them.

On a CPU cache, a run of consecutive block ids goes out unpacked: ZMQ reads the cache's memory
itself (and keeps the cache tensor alive while it does). After a successful transfer it has read
everything (the receiver acknowledged every byte). After a failed one it may still read frames it
had queued while the engine reuses the blocks; those bytes only reach a transfer that the receiver
fails too (the ``Abort`` follows them) or a closed connection, so they are never used.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from common.endpoints import check_endpoint
from kvtransfer.blocks.layout import KVLayout
from kvtransfer.sending.outgoing import Outgoing
from kvtransfer.sending.sender_loop import SenderLoop
from kvtransfer.state_board import StateBoard
from kvtransfer.transfer_state import TransferResult, TransferState
from kvtransfer.wire.curve import CurveConfig
from kvtransfer.wire.messages import MAX_BLOCKS_PER_REQUEST, MAX_HASH_BYTES, MAX_META_BYTES
from kvtransfer.wire.sockets import Waker

DEFAULT_LAYERS_PER_FRAME = 0  # 0: per transfer, as many layers as make a frame of about 4 MiB
DEFAULT_MAX_FRAME_BYTES = 16 << 20
DEFAULT_STAGING_BYTES = 256 << 20


class KVSender:
    """Sends paged KV blocks to ``KVReceiver`` peers; one instance per engine, any number of peers.

    ``layers_per_frame`` 0 picks, per transfer, as many layers as make a frame of about 4 MiB;
    ``staging_bytes`` bounds the packed bytes ZMQ still holds (how far packing runs ahead).
    """

    def __init__(
        self,
        kv_cache: Tensor,
        layout: KVLayout,
        *,
        timeout_s: float = 30.0,
        curve: CurveConfig | None = None,
        layers_per_frame: int = DEFAULT_LAYERS_PER_FRAME,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        sender_id: str = "",
    ) -> None:
        layout.check_kv_cache(kv_cache)
        if timeout_s <= 0 or layers_per_frame < 0:
            raise ValueError("timeout_s must be > 0 and layers_per_frame >= 0 (0: automatic)")
        if curve is not None and curve.server_public_key is None:
            raise ValueError("a CURVE sender needs curve.server_public_key")
        self.kv_cache = kv_cache
        self.layout = layout
        self._num_pool_blocks = kv_cache.shape[2]
        self._board = StateBoard()
        self._waker = Waker()
        self._lock = threading.Lock()
        self._closed = False
        self._loop = SenderLoop(
            kv_cache,
            layout,
            self._board,
            self._waker,
            timeout_s=timeout_s,
            curve=curve,
            layers_per_frame=layers_per_frame,
            max_frame_bytes=max(max_frame_bytes, layout.bytes_per_block_layer),
            staging_bytes=staging_bytes,
            sender_id=sender_id,
        )
        self._thread = threading.Thread(target=self._loop.run, name="kv-sender", daemon=True)
        self._thread.start()

    def send(
        self,
        request_id: str,
        peer_address: str,
        block_ids: list[int],
        block_hashes: list[bytes],
        num_tokens: int,
        meta: bytes = b"",
        after: Any | None = None,
        num_released_blocks: int = 0,
    ) -> None:
        """Start sending; never blocks. Raises ``ValueError`` on bad arguments or a live duplicate id.

        ``block_ids`` hold all ``ceil(num_tokens / block_size)`` blocks of the request in order;
        ``block_hashes`` the hashes of its full blocks (a prefix of them is enough). On a GPU the
        gathers wait for ``after``, a CUDA event after which the blocks hold the KV; without one, for
        everything queued on the current stream now. The first ``num_released_blocks`` are out of the
        model's window and no longer held here (``KVCacheManager.release_out_of_window``): a receiver
        that asks for any of them fails the transfer instead of receiving other requests' KV.
        """
        self._validate(request_id, peer_address, block_ids, block_hashes, num_tokens, meta)
        if not 0 <= num_released_blocks < len(block_ids):
            raise ValueError(f"num_released_blocks {num_released_blocks} outside 0..{len(block_ids) - 1}: "
                             "at least the last block is held")
        if after is None and self.kv_cache.is_cuda:
            after = torch.cuda.current_stream(self.kv_cache.device).record_event()
        transfer = Outgoing(
            request_id, peer_address, list(block_ids), list(block_hashes), num_tokens, bytes(meta), after,
            num_released_blocks=num_released_blocks,
        )
        with self._lock:
            if not self._board.start(request_id, TransferState.BOOTSTRAPPING):
                raise ValueError(f"duplicate request id {request_id!r}: a transfer with it is still live")
            if self._closed or not self._thread.is_alive():
                self._board.finish(transfer.result(False, "sender closed"))
                return
            self._loop.commands.append(("send", transfer))
        self._waker.wake()

    def poll(self) -> list[TransferResult]:
        """Results of transfers that ended since the last call, each reported exactly once."""
        return self._board.drain()

    @property
    def staging_bytes_in_use(self) -> int:
        """Bytes of gathered frames not yet given back (ZMQ may still read them); a snapshot."""
        return self._loop.packer.pool.bytes_in_use

    def abort(self, request_id: str) -> None:
        """Stop a transfer and tell the receiver; its result (failed) still comes from ``poll``."""
        self._loop.commands.append(("abort", request_id))
        self._waker.wake()

    def state(self, request_id: str) -> TransferState:
        """Current state of a live or recently finished transfer; ``KeyError`` if unknown."""
        return self._board.get(request_id)

    def close(self, timeout_s: float = 5.0) -> None:
        """Fail what is still live (results stay pollable), close the sockets. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._loop.stop_event.set()
        self._waker.wake()
        self._thread.join(timeout_s)
        self._waker.close()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _validate(
        self,
        request_id: str,
        peer_address: str,
        block_ids: list[int],
        block_hashes: list[bytes],
        num_tokens: int,
        meta: bytes,
    ) -> None:
        if not isinstance(request_id, str) or not 1 <= len(request_id) <= 256:
            raise ValueError("request_id must be a string of 1 to 256 characters")
        check_endpoint(peer_address, "peer_address")
        if num_tokens < 1 or len(block_ids) != self.layout.num_blocks_for(num_tokens):
            raise ValueError(
                f"{num_tokens} tokens need {self.layout.num_blocks_for(num_tokens)} blocks, got {len(block_ids)}"
            )
        if len(block_ids) > MAX_BLOCKS_PER_REQUEST or not all(
            0 <= b < self._num_pool_blocks for b in block_ids
        ):
            raise ValueError("block_ids out of range of the kv_cache")
        if len(block_hashes) > len(block_ids) or not all(
            isinstance(h, bytes) and 1 <= len(h) <= MAX_HASH_BYTES for h in block_hashes
        ):
            raise ValueError("block_hashes must be at most one non-empty hash of <= 64 bytes per block")
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"meta of {len(meta)} bytes exceeds {MAX_META_BYTES}")
