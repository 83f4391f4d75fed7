"""The prefill service: chunked prefill with a prefix cache, first token to the router, KV to decode.

Time to first token does not wait for the transfer: the first token leaves for the router the
step it is sampled, then the request's blocks are handed to the KV sender and freed when the
sender reports the transfer's end (success or failure).
"""

from __future__ import annotations

import argparse
import logging

from common.engine.engine import EngineOutput
from common.protocol import GenerateRequest, RequestOutput, TransferMeta, encode
from common.service import EngineService
from kvtransfer.curve import CurveConfig
from kvtransfer.layout import KVLayout
from kvtransfer.sender import KVSender

logger = logging.getLogger(__name__)


class PrefillService(EngineService):
    role = "prefill"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        layout = KVLayout.from_kv_cache(self.engine.runner.kv_cache, self.engine.model_id)
        self.sender = KVSender(
            self.engine.runner.kv_cache, layout, timeout_s=args.kv_transfer_timeout,
            curve=CurveConfig.from_env(), sender_id=self.instance_id,
        )
        self.requests: dict[str, GenerateRequest] = {}

    def on_generate(self, msg: GenerateRequest) -> None:
        transfer = msg.decode_target is not None
        try:
            self.engine.add_request(
                msg.request_id, msg.prompt_token_ids, msg.sampling_params, cache_salt=msg.cache_salt,
                kv_transfer=transfer,
            )
        except ValueError as exc:
            self.fail(msg.request_id, msg.reply_to, str(exc), "prefill" if transfer else "full")
            return
        self.reply_to[msg.request_id] = msg.reply_to
        self.phase[msg.request_id] = "prefill" if transfer else "full"
        self.requests[msg.request_id] = msg

    def on_abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self.sender.abort(request_id)
        self.requests.pop(request_id, None)
        self.reply_to.pop(request_id, None)

    def on_outputs(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            msg = self.requests.get(rid)
            phase = self.phase.get(rid, "full")
            if out.finish_reason is not None or msg is None:
                self.send_output(rid, self.to_wire(out, phase))
                self.requests.pop(rid, None)
                continue
            if not out.kv_ready:
                self.send_output(rid, self.to_wire(out, phase))
                continue
            # First token now; the KV follows to the decode instance.
            self.send_output(rid, self.to_wire(out, "prefill"))
            assert msg.decode_target is not None
            req = self.engine.transferring[rid]
            num_tokens = req.num_prompt_tokens
            meta = TransferMeta(
                request=msg, first_token_id=out.new_token_ids[0],
                first_logprobs=out.logprobs[0] if out.logprobs else None,
                num_cached_tokens=out.num_cached_tokens,
            )
            block_ids = self.engine.kv.block_ids(rid)[: -(-num_tokens // self.engine.block_size)]
            self.sender.send(
                rid, msg.decode_target.kv_address, block_ids,
                [bytes(h) for h in req.block_hashes[: num_tokens // self.engine.block_size]],
                num_tokens, encode(meta),
            )

    def poll_transfers(self) -> bool:
        results = self.sender.poll()
        for res in results:
            self.engine.release_kv(res.request_id)
            msg = self.requests.pop(res.request_id, None)
            self.metrics.kv_transfer_bytes.inc(res.bytes_sent)
            self.metrics.kv_transfer_seconds.observe(res.seconds)
            if not res.ok:
                self.metrics.kv_transfer_failures.inc()
                logger.warning("KV transfer of %s failed: %s", res.request_id, res.reason)
                if msg is not None and res.reason != "aborted":
                    self.send_output(res.request_id, RequestOutput(
                        request_id=res.request_id, new_token_ids=[], finish_reason="error",
                        error=f"KV transfer failed: {res.reason}", instance_id=self.instance_id,
                        phase="prefill",
                    ))
            self.reply_to.pop(res.request_id, None)
            self.phase.pop(res.request_id, None)
        return bool(results)

    def busy(self) -> bool:
        return super().busy() or bool(self.engine.transferring)

    def close(self) -> None:
        self.sender.close()
