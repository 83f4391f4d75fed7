"""The requests of a chaos run: mixed prompt lengths, both endpoints, streaming and not, from one seed.

Prompt lengths are drawn log-uniformly between ``min_prompt_len`` and ``max_prompt_len`` tokens, so
there are many short prompts (under one block, which the router may send straight to decode) and
a tail of long ones (several blocks, which go through prefill and a KV transfer). The four
(endpoint, streaming) combinations take turns, so even a handful of requests covers each of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ops.bench.serve_workloads import BenchRequest, PromptBuilder

# (endpoint, stream) in turn: request i gets COMBINATIONS[i % 4]
COMBINATIONS = (("completions", True), ("chat", True), ("completions", False), ("chat", False))


@dataclass(frozen=True)
class ChaosRequest:
    request_index: int
    prompt: str
    prompt_len: int  # tokens of the prompt text (before any chat template)
    max_tokens: int
    endpoint: str  # "completions" or "chat"
    stream: bool

    def bench_request(self) -> BenchRequest:
        """The serving benchmark's request type, whose ``ClientConfig.payload`` builds the body."""
        return BenchRequest(self.prompt, (), self.max_tokens, self.kind)

    @property
    def kind(self) -> str:
        return f"{self.endpoint}-{'stream' if self.stream else 'json'}"


def log_uniform_int(rng: Any, low: int, high: int) -> int:
    """An integer in ``[low, high]`` whose logarithm is uniform (``rng``: a ``random.Random``)."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got {low}, {high}")
    value = math.exp(rng.uniform(math.log(low), math.log(high + 1)))
    return min(high, max(low, int(value)))


def chaos_workload(
    builder: PromptBuilder, num_requests: int, min_prompt_len: int, max_prompt_len: int,
    min_output_len: int, max_output_len: int,
) -> list[ChaosRequest]:
    """``num_requests`` requests drawn from ``builder``'s seeded generator (the same seed, the same list)."""
    if not 1 <= min_output_len <= max_output_len:
        raise ValueError(f"need 1 <= min output <= max output, got {min_output_len}, {max_output_len}")
    requests = []
    for i in range(num_requests):
        prompt, ids = builder.build(log_uniform_int(builder.rng, min_prompt_len, max_prompt_len))
        endpoint, stream = COMBINATIONS[i % len(COMBINATIONS)]
        max_tokens = builder.rng.randint(min_output_len, max_output_len)
        requests.append(ChaosRequest(i, prompt, len(ids), max_tokens, endpoint, stream))
    return requests


def describe(requests: list[ChaosRequest], block_size: int = 16) -> dict[str, Any]:
    """Counts and length ranges, for the report."""
    if not requests:
        return {"num_requests": 0}
    prompts = [r.prompt_len for r in requests]
    outputs = [r.max_tokens for r in requests]
    return {
        "num_requests": len(requests),
        "by_kind": {k: sum(1 for r in requests if r.kind == k) for k in sorted({r.kind for r in requests})},
        "prompt_len_min": min(prompts), "prompt_len_max": max(prompts),
        "prompt_len_mean": sum(prompts) / len(prompts),
        f"num_prompts_over_{block_size}_tokens": sum(1 for n in prompts if n > block_size),
        "max_tokens_min": min(outputs), "max_tokens_max": max(outputs),
        "max_tokens_total": sum(outputs),
    }
