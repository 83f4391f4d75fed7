"""Token sampling: penalties, temperature, top-k/top-p/min-p, per-request seeds, logprobs.

A request with a seed draws from its own generator, so its tokens do not depend on which other
requests share the batch. Logprobs are those of the model's raw distribution (before penalties
and temperature), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from common.engine.request import Request
from common.protocol import PositionLogprobs, TokenLogprob


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(self, logits: Tensor, requests: list[Request]) -> SampleResult:
        """Sample one token per row of ``logits`` ``[len(requests), vocab]``; rows are not mutated."""
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()
        for row, req in enumerate(requests):
            self._apply_penalties(logits[row], req)
        token_ids: list[int] = []
        for row, req in enumerate(requests):
            p = req.sampling_params
            if p.greedy:
                token_ids.append(int(torch.argmax(logits[row])))
                continue
            token_ids.append(self._sample_row(logits[row], req))
        logprobs: list[PositionLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for row, req in enumerate(requests):
                k = req.sampling_params.logprobs
                if k is None:
                    continue
                lp = raw_logprobs[row]
                top: list[TokenLogprob] = []
                if k > 0:
                    values, ids = torch.topk(lp, k)
                    top = [TokenLogprob(int(i), float(v)) for v, i in zip(values, ids, strict=True)]
                tok = token_ids[row]
                logprobs[row] = PositionLogprobs(tok, float(lp[tok]), top)
        return SampleResult(token_ids, logprobs)

    def _apply_penalties(self, logits: Tensor, req: Request) -> None:
        p = req.sampling_params
        if req.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            if banned:
                logits[banned] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
            ids, counts = torch.unique(torch.tensor(req.output_token_ids, dtype=torch.long), return_counts=True)
            logits[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty

    def _sample_row(self, logits: Tensor, req: Request) -> int:
        p = req.sampling_params
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            drop_sorted = (cum - sorted_probs) >= p.top_p
            probs = probs.clone()
            probs[order[drop_sorted]] = 0.0
        if p.min_p > 0.0:
            probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
        gen = req.generator if req.generator is not None else self.generator
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one draw per row.
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return int(torch.argmax(probs / noise))
