"""The decode service: receives prompt KV over kvtransfer, batches continuously, streams tokens.

It also runs whole requests (prefill included) when the router sends one straight to it, and
recomputes locally after a preemption. The engine's pool is the transfer's allocator: blocks
for an incoming transfer are held under the request id until the transfer succeeds (the request
joins the batch) or fails (they return to the pool).
"""

from __future__ import annotations

import argparse
import logging

from common.engine.engine import EngineOutput
from common.kvcache.hashing import BlockHash
from common.protocol import GenerateRequest, ProtocolError, TransferMeta, decode_transfer_meta
from common.service import EngineService, RequestRecord
from kvtransfer.block_allocator import Allocation
from kvtransfer.curve import CurveConfig
from kvtransfer.layout import KVLayout
from kvtransfer.receiver import KVReceiver
from kvtransfer.transfer_state import ABORTED

logger = logging.getLogger(__name__)


class DecodeService(EngineService):
    role = "decode"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        layout = KVLayout.from_kv_cache(self.engine.runner.kv_cache, self.engine.model_id)
        port = args.kv_port or "*"
        self.receiver = KVReceiver(
            f"tcp://{args.host}:{port}", self.engine.runner.kv_cache, layout, self,
            timeout_s=args.kv_transfer_timeout, defer_timeout_s=args.kv_transfer_timeout,
            curve=CurveConfig.from_env(),
        )
        self.kv_address = self.receiver.address

    # ------------------------------------------------------------ allocator for the receiver
    def allocate_for_transfer(self, request_id: str, block_hashes: list[bytes], num_tokens: int) -> Allocation | str:
        got = self.engine.allocate_for_transfer(request_id, [BlockHash(h) for h in block_hashes], num_tokens)
        if isinstance(got, str):
            return got
        block_ids, num_cached = got
        return Allocation(block_ids=block_ids, num_cached_blocks=num_cached)

    def release_transfer(self, request_id: str) -> None:
        self.engine.kv.free(request_id)

    # ------------------------------------------------------------ requests
    def admit(self, msg: GenerateRequest) -> None:
        self.engine.add_request(
            msg.request_id, msg.prompt_token_ids, msg.sampling_params, cache_salt=msg.cache_salt,
            output_token_ids=msg.output_token_ids,
        )

    def on_abort(self, request_id: str) -> None:
        """Drops it wherever it is: running here, landing (the receiver frees), or not yet offered
        (the receiver refuses the offer when it comes)."""
        super().on_abort(request_id)
        self.receiver.abort(request_id)

    def on_outputs(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            record = self.records.get(out.request_id)
            if record is not None:
                self.send_output(out.request_id, self.to_wire(out, record.phase))

    def poll_transfers(self) -> bool:
        results = self.receiver.poll()
        for res in results:
            self.metrics.kv_transfer_bytes.inc(res.bytes_received)
            self.metrics.kv_transfer_seconds.observe(res.seconds)
            if res.ok:
                self._admit_transferred(res.request_id, res.meta)
                continue
            self.metrics.kv_transfer_failures.inc()
            logger.warning("incoming KV for %s failed: %s", res.request_id, res.reason)
            if res.reason != ABORTED:
                self._report_lost_transfer(res.request_id, res.meta, res.reason or "unknown")
        return bool(results)

    def _report_lost_transfer(self, request_id: str, raw_meta: bytes, reason: str) -> None:
        """Tell the request's router at once (it continues the request elsewhere), not only the log."""
        try:
            meta = self._checked_meta(request_id, raw_meta)
        except ProtocolError:
            return  # nobody to tell: the meta names no router we can trust
        self._send(meta.request.reply_to, self.error_output(
            request_id, f"KV transfer failed: {reason}", "decode", retryable=True
        ))

    @staticmethod
    def _checked_meta(request_id: str, raw_meta: bytes) -> TransferMeta:
        meta = decode_transfer_meta(raw_meta)
        if meta.request.request_id != request_id:
            raise ProtocolError("transfer meta names another request")
        return meta

    def _admit_transferred(self, request_id: str, raw_meta: bytes) -> None:
        try:
            meta = self._checked_meta(request_id, raw_meta)
        except ProtocolError as exc:
            logger.warning("dropping transfer %s: %s", request_id, exc)
            self.engine.kv.free(request_id)
            return
        msg = meta.request
        try:
            self.engine.validate(msg.prompt_token_ids, msg.sampling_params, [*msg.output_token_ids, meta.first_token_id])
            self.engine.add_transferred_request(
                request_id, msg.prompt_token_ids, meta.first_token_id, msg.sampling_params,
                num_cached_tokens=meta.num_cached_tokens, cache_salt=msg.cache_salt,
                output_token_ids=msg.output_token_ids,
            )
        except ValueError as exc:
            self.engine.kv.free(request_id)
            self.reject(msg, str(exc))
            return
        self.heard_from(msg.reply_to)
        self.records[request_id] = RequestRecord(msg, "decode")

    def busy(self) -> bool:
        return super().busy() or self.receiver.num_in_flight > 0

    def close(self) -> None:
        self.receiver.close()
