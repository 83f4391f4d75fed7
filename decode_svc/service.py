"""The decode service: receives prompt KV over kvtransfer, batches continuously, streams tokens.

It also runs whole requests (prefill included) when the router sends one straight to it, and
recomputes locally after a preemption. The engine's pool is the transfer's allocator: blocks
for an incoming transfer are held under the request id until the transfer succeeds (the request
joins the batch) or fails (they return to the pool).
"""

from __future__ import annotations

import argparse
import logging

from common.endpoints import check_endpoint
from common.engine.engine import EngineOutput
from common.protocol import (
    MAX_MESSAGE_BYTES,
    GenerateRequest,
    ProtocolError,
    TransferMeta,
    choice_request_ids,
    decode_transfer_meta,
)
from common.registry import NO_KV_TRANSFER
from common.service import EngineService, RequestRecord
from kvtransfer.receiving.block_allocator import Allocation, Refusal
from kvtransfer.receiving.receiver import KVReceiver
from kvtransfer.transfer_state import ABORTED

logger = logging.getLogger(__name__)


def _offer_priority(meta: bytes) -> int:
    """Where an offer waits for blocks under the priority policy: its request's priority (lower
    first); a meta that does not decode sorts as 0, and its allocation refuses it."""
    try:
        return decode_transfer_meta(meta).request.sampling_params.priority
    except ProtocolError:
        return 0


class DecodeService(EngineService):
    role = "decode"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.receiver: KVReceiver | None = None
        transfer = self.transfer_cache()
        if transfer is None:
            # Whole requests only: its layout fits no prefill's, so routers send it every request directly.
            self.kv_layout = NO_KV_TRANSFER
            logger.warning("%s: this decode instance runs whole requests only (no prefill hands it KV)",
                           self.no_transfer_reason())
            return
        cache, layout = transfer
        self.kv_layout = layout.fingerprint()
        port = args.kv_port or "*"
        priority = self.engine.scheduler.policy == "priority"
        self.receiver = KVReceiver(
            f"tcp://{args.host}:{port}", cache, layout, self,
            timeout_s=args.kv_transfer_timeout, defer_timeout_s=args.kv_transfer_timeout,
            curve=self.kv_curve, offer_order=_offer_priority if priority else None,
            # The offer's meta carries the request, its prompt's images included (``GenerateRequest``).
            max_meta_bytes=MAX_MESSAGE_BYTES,
        )
        self.kv_address = self.receiver.address

    # ------------------------------------------------------------ allocator for the receiver
    def allocate_for_transfer(
        self, request_id: str, block_hashes: list[bytes], num_tokens: int, meta: bytes
    ) -> Allocation | Refusal | str:
        """The request waits for remote KV in the engine from here; nothing in the offer is trusted
        before it is checked against the request the meta describes."""
        try:
            transfer = self._checked_meta(request_id, meta)
        except ProtocolError as exc:
            return Refusal(str(exc))
        msg = transfer.request
        if self.draining:
            return Refusal(f"instance {self.instance_id} is draining", busy=True)
        try:
            handoff = self.engine.add_remote_request(
                request_id, msg.prompt_token_ids, transfer.first_token_id, msg.sampling_params,
                num_cached_tokens=transfer.num_cached_tokens, cache_salt=msg.cache_salt,
                output_token_ids=msg.output_token_ids, choice_token_ids=transfer.choice_token_ids or None,
                lora_name=msg.lora_name, images=msg.images,
            )
        except ValueError as exc:
            return Refusal(str(exc))
        if handoff is None:
            return "KV cache full"
        mismatch = None
        if num_tokens != handoff.num_tokens:
            mismatch = f"offer of {num_tokens} tokens for a request with {handoff.num_tokens} tokens of KV"
        elif [bytes(h) for h in handoff.block_hashes] != block_hashes:
            mismatch = "block hashes do not match the request's tokens (another model or cache salt?)"
        if mismatch is not None:
            self.engine.release_kv(request_id)
            return Refusal(mismatch)
        self.heard_from(msg.reply_to)
        record = RequestRecord(msg, "decode")
        for choice_id in choice_request_ids(request_id, msg.sampling_params.n):
            self.records[choice_id] = record
        return Allocation(block_ids=handoff.block_ids, num_cached_blocks=handoff.num_cached_blocks,
                          num_released_blocks=handoff.num_released_blocks)

    def release_transfer(self, request_id: str) -> None:
        self.engine.release_kv(request_id)

    # ------------------------------------------------------------ requests
    def admit(self, msg: GenerateRequest) -> None:
        self.engine.add_request(
            msg.request_id, msg.prompt_token_ids, msg.sampling_params, cache_salt=msg.cache_salt,
            output_token_ids=msg.output_token_ids, lora_name=msg.lora_name, pooling=msg.pooling, images=msg.images,
        )

    def on_abort(self, request_id: str) -> None:
        """Drops it wherever it is: running here, landing (the receiver frees), or not yet offered
        (the receiver refuses the offer when it comes)."""
        super().on_abort(request_id)
        # n > 1: the KV lands under the request's own id for all its choices; while another
        # choice still waits for it, the transfer goes on (the aborted choice never forks).
        parent, _, index = request_id.rpartition("#")
        carrier = parent if index.isdigit() and self.engine.knows(parent) else request_id
        if self.receiver is not None and not self.engine.kv_still_wanted(carrier):
            self.receiver.abort(carrier)

    def on_outputs(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            record = self.records.get(out.request_id)
            if record is not None:
                self.send_token_output(out.request_id, self.to_wire(out, record.phase))

    def poll_transfers(self) -> bool:
        if self.receiver is None:
            return False
        results = self.receiver.poll()
        for res in results:
            self.metrics.kv_transfer_bytes.inc(res.bytes_received)
            self.metrics.kv_transfer_seconds.observe(res.seconds)
            if res.ok:
                self.engine.remote_kv_arrived(res.request_id)
                continue
            self.metrics.kv_transfer_failures.inc()
            logger.warning("incoming KV for %s failed: %s", res.request_id, res.reason)
            group = self.choice_group(res.request_id)
            for choice_id in group:
                if res.reason != ABORTED:
                    # Tell the router at once (it continues the choice elsewhere), not only the log.
                    self.send_output(choice_id, self.error_output(
                        choice_id, f"KV transfer failed: {res.reason}", "decode", retryable=True
                    ))
                self.forget(choice_id)
        return bool(results)

    @staticmethod
    def _checked_meta(request_id: str, raw_meta: bytes) -> TransferMeta:
        meta = decode_transfer_meta(raw_meta)
        if meta.request.request_id != request_id:
            raise ProtocolError("transfer meta names another request")
        try:
            check_endpoint(meta.request.reply_to, "reply_to")
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        return meta

    def busy(self) -> bool:
        return super().busy() or (self.receiver is not None and self.receiver.num_in_flight > 0)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
