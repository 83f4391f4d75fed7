"""In-process reference figures a serving run is compared with, measured in the same invocation.

* ``decode_ceiling``: the engine's bare batched decode forward (``ModelRunner.execute`` on one new
  token per sequence, no scheduler, no sockets, no HTTP) at the batch size and context lengths the
  served run saw; tokens/s = batch / step time. Nothing served can be faster on the same machine.
* ``hf_generate_throughput``: the same requests through ``transformers`` ``generate`` with static
  batching (left-padded batches in arrival order, each batch generating as many tokens as its
  longest request asks for). Only the tokens each request asked for count as output.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ops.bench.serve_workloads import BenchRequest


@torch.inference_mode()
def decode_ceiling(
    model: str | None, context_lens: Sequence[int], num_steps: int = 32, num_warmup: int = 3, block_size: int = 16
) -> dict[str, Any]:
    """Decode tokens/s of the bare model runner for ``len(context_lens)`` sequences of these lengths."""
    from common.config import EngineConfig
    from common.engine.model_runner import ModelRunner
    from common.engine.request import Request
    from common.engine.scheduler import ScheduledRequest, SchedulerOutput
    from common.sampling_params import SamplingParams

    batch = len(context_lens)
    longest = max(context_lens) + num_steps + num_warmup + 1
    blocks_per_seq = -(-longest // block_size)
    runner = ModelRunner(EngineConfig(model=model, block_size=block_size, num_blocks=batch * blocks_per_seq + 1))
    gen = torch.Generator().manual_seed(0)
    requests = []
    for i, ctx in enumerate(context_lens):
        ids = torch.randint(100, runner.vocab_size, (ctx,), generator=gen).tolist()
        req = Request(f"ceiling-{i}", ids, SamplingParams(max_tokens=longest), block_size=block_size,
                      model_id=runner.model_id)
        req.num_computed_tokens = ctx - 1  # the KV content does not matter for timing
        requests.append(req)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)]
    step_s = []
    for step in range(num_warmup + num_steps):
        out = SchedulerOutput([ScheduledRequest.of(r, 1, t) for r, t in zip(requests, tables, strict=True)])
        start = time.perf_counter()
        logits = runner.execute(out)
        elapsed = time.perf_counter() - start
        for req, token in zip(requests, logits.argmax(-1).tolist(), strict=True):
            req.num_computed_tokens += 1
            req.append_output_token(int(token))
        if step >= num_warmup:
            step_s.append(elapsed)
    median = statistics.median(step_s)
    return {
        "batch_size": batch,
        "mean_context_len": sum(context_lens) / batch,
        "num_steps": num_steps,
        "step_ms_median": median * 1000,
        "step_ms_min": min(step_s) * 1000,
        "tokens_per_s": batch / median,
    }


@torch.inference_mode()
def hf_generate_throughput(model_path: str, requests: Sequence[BenchRequest], batch_size: int) -> dict[str, Any]:
    """Output tokens/s of ``transformers`` ``generate`` (greedy, float32, this process, static batches)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    pad_id = model.config.eos_token_id
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    pad_id = int(pad_id if pad_id is not None else 0)

    def generate(batch: Sequence[BenchRequest]) -> int:
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, req in enumerate(batch):
            ids[row, width - req.prompt_len:] = torch.tensor(req.prompt_token_ids)
            mask[row, width - req.prompt_len:] = 1
        num_new = max(r.max_tokens for r in batch)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=num_new, min_new_tokens=num_new,
            do_sample=False, pad_token_id=pad_id,
        )
        return int(out.shape[1] - width) * len(batch)

    generate([BenchRequest("warm-up", requests[0].prompt_token_ids[:8], 2)])
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(requests), batch_size):
        generated += generate(requests[i:i + batch_size])
    duration = time.perf_counter() - start
    useful = sum(r.max_tokens for r in requests)
    return {
        "batch_size": batch_size,
        "num_requests": len(requests),
        "duration_s": duration,
        "output_tokens": useful,
        "generated_tokens": generated,
        "output_throughput": useful / duration,
    }
