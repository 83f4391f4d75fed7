"""The prefill service: chunked prefill with a prefix cache, first token to the router, KV to decode.

Time to first token does not wait for the transfer: the first token leaves for the router the
step it is sampled, then the request's blocks are handed to the KV sender and freed when the
sender reports the transfer's end (success or failure). A failed transfer is reported to the
router as retryable, so it continues the request (prompt + tokens streamed so far) elsewhere;
a decode that refused the offer as busy (draining) is reported as a refusal (``overloaded``), which
the router answers by sending the request again, not by spending a migration.
"""

from __future__ import annotations

import argparse
import logging

from common.endpoints import check_endpoint
from common.engine.engine import EngineOutput, KVHandoff
from common.protocol import GenerateRequest, TransferMeta, encode
from common.service import EngineService, Phase
from kvtransfer.sending.sender import KVSender
from kvtransfer.transfer_state import ABORTED

logger = logging.getLogger(__name__)


class PrefillService(EngineService):
    role = "prefill"
    # Prompts' chunks and their first token only (as SGLang's prefill servers, no CUDA graphs).
    runs_decode_steps = False

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        transfer = self.transfer_cache()
        if transfer is None:  # a prefill's every request ends in a transfer
            self.engine.close()  # its other ranks
            self.control.close(0)
            self.ctx.destroy(linger=0)
            raise ValueError(f"{self.no_transfer_reason()}; serve it from decode instances alone (pdserve up "
                             "--prefill 0), which run whole requests")
        cache, layout = transfer
        self.kv_layout = layout.fingerprint()
        self.sender = KVSender(
            cache, layout, timeout_s=args.kv_transfer_timeout,
            curve=self.kv_curve, sender_id=self.instance_id,
        )

    def phase_of(self, msg: GenerateRequest) -> Phase:
        return "prefill" if msg.decode_target is not None else "full"

    def admit(self, msg: GenerateRequest) -> None:
        if msg.decode_target is not None:  # checked before any work: a bad target fails only this request
            check_endpoint(msg.decode_target.kv_address, "decode_target.kv_address")
        self.engine.add_request(
            msg.request_id, msg.prompt_token_ids, msg.sampling_params, cache_salt=msg.cache_salt,
            kv_transfer=msg.decode_target is not None, output_token_ids=msg.output_token_ids,
            lora_name=msg.lora_name, pooling=msg.pooling, images=msg.images,
        )

    def on_abort(self, request_id: str) -> None:
        group = self.choice_group(request_id)
        super().on_abort(request_id)
        # The KV leaves under the request's own id, once for all its choices: it stops only when
        # no choice wants it. Its blocks come back when the sender reports the end.
        if not any(choice_id in self.records for choice_id in group):
            self.sender.abort(group[0])

    def on_outputs(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            record = self.records.get(out.request_id)
            if record is None:
                continue
            if out.kv_handoff is None:
                self.send_output(out.request_id, self.to_wire(out, record.phase))
                continue
            # First token now; the KV follows to the decode instance. The record stays until the
            # transfer ends, so a failure still reaches the router.
            self.send_output(out.request_id, self.to_wire(out, "prefill"))
            self._send_kv(record.request, out, out.kv_handoff)

    def _send_kv(self, msg: GenerateRequest, out: EngineOutput, handoff: KVHandoff) -> None:
        assert msg.decode_target is not None
        meta = TransferMeta(
            request=msg, first_token_id=out.new_token_ids[0],
            first_logprobs=out.logprobs[0] if out.logprobs else None,
            num_cached_tokens=out.num_cached_tokens, choice_token_ids=handoff.choice_token_ids,
        )
        try:
            self.sender.send(
                msg.request_id, msg.decode_target.kv_address, handoff.block_ids,
                [bytes(h) for h in handoff.block_hashes], handoff.num_tokens, encode(meta), after=handoff.ready,
                num_released_blocks=handoff.num_released_blocks,
            )
        except ValueError as exc:  # e.g. a decode target address the sender cannot use
            self.engine.release_kv(msg.request_id)
            for choice_id in self.choice_group(msg.request_id):
                self.fail(choice_id, f"KV transfer not started: {exc}")

    def poll_transfers(self) -> bool:
        results = self.sender.poll()
        for res in results:
            self.engine.release_kv(res.request_id)
            self.metrics.kv_transfer_bytes.inc(res.bytes_sent)
            self.metrics.kv_transfer_seconds.observe(res.seconds)
            group = self.choice_group(res.request_id)
            if not res.ok:
                self.metrics.kv_transfer_failures.inc()
                logger.warning("KV transfer of %s failed: %s", res.request_id, res.reason)
                for choice_id in group if res.reason != ABORTED else []:  # each continues elsewhere
                    failed = self.error_output(choice_id, f"KV transfer failed: {res.reason}", "prefill", retryable=True)
                    # A decode that refused the offer as busy (draining) is not a loss: the router
                    # sends the request again elsewhere, as after a full queue, spending no migration.
                    failed.overloaded = res.receiver_busy
                    self.send_output(choice_id, failed)
            for choice_id in group:
                self.forget(choice_id)
        return bool(results)

    def busy(self) -> bool:
        return super().busy() or self.engine.num_held_for_transfer > 0

    def close(self) -> None:
        self.sender.close()
