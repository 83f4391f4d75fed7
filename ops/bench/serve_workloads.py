"""Benchmark workloads: lists of prompts with known token lengths, built from a fixed seed.

Prompts are runs of common whole-word tokens of the model's own tokenizer (" house", " river"...),
re-encoded and trimmed until the prompt is exactly the asked number of tokens, so lengths are
controlled while the text stays plain words any OpenAI-compatible server accepts.

* ``random``: prompt and output lengths drawn uniformly from ``len * [1 - r, 1 + r]``.
* ``shared-prefix``: one long common prefix (a system prompt of ``prefix_len`` tokens) followed by
  short distinct questions; the prefix's tokens are checked to be a token prefix of every prompt. With
  ``num_prefixes`` above 1, that many such prefixes (users' documents, each a conversation's own), the requests
  taking them in turn: more of them than an engine's KV cache holds make it give some back between turns.
* ``long-prompt-interference``: short-prompt, long-output requests (kind ``decode``, kept running
  in a closed loop) while long prompts (kind ``long``) arrive as a Poisson stream among them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("random", "shared-prefix", "long-prompt-interference")
_MAX_FIXUPS = 32


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    kind: str = "main"

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    """``requests`` follow the run's arrival mode; ``long_requests`` arrive at ``long_rate`` beside them."""

    name: str
    requests: list[BenchRequest]
    long_requests: list[BenchRequest] = field(default_factory=list)
    long_rate: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 1  # distinct prefixes of ``prefix_len`` tokens (shared-prefix)

    def describe(self) -> dict[str, Any]:
        def lengths(reqs: list[BenchRequest]) -> dict[str, Any]:
            if not reqs:
                return {"num": 0}
            prompt = [r.prompt_len for r in reqs]
            out = [r.max_tokens for r in reqs]
            return {
                "num": len(reqs), "prompt_len_mean": sum(prompt) / len(prompt), "prompt_len_min": min(prompt),
                "prompt_len_max": max(prompt), "max_tokens_mean": sum(out) / len(out),
                "max_tokens_min": min(out), "max_tokens_max": max(out),
            }

        return {
            "name": self.name, "prefix_len": self.prefix_len, "num_prefixes": self.num_prefixes,
            "requests": lengths(self.requests),
            "long_requests": lengths(self.long_requests), "long_rate": self.long_rate,
        }


class PromptBuilder:
    """Plain-word prompts of an exact token length under ``tokenizer`` (a transformers tokenizer)."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.words = word_tokens(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def build(self, num_tokens: int, head: str = "") -> tuple[str, list[int]]:
        """``head`` followed by random words, ``num_tokens`` tokens in all (head included)."""
        num_head = len(self.encode(head)) if head else 0
        words = self.rng.choices(self.words, k=max(num_tokens - num_head, 1))
        ids: list[int] = []
        for _ in range(_MAX_FIXUPS):
            ids = self.encode(head + "".join(words))
            if len(ids) == num_tokens:
                break
            if len(ids) > num_tokens:
                del words[max(len(words) - (len(ids) - num_tokens), 1):]
            else:
                words += self.rng.choices(self.words, k=num_tokens - len(ids))
        return head + "".join(words), ids


def word_tokens(tokenizer: Any, limit: int = 4000) -> list[str]:
    """Vocabulary entries that are a space and a short lower-case word, and encode back to themselves."""
    vocab_size = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(vocab_size)])
    words: list[str] = []
    for token_id, text in enumerate(texts):
        body = text[1:]
        if not (text.startswith(" ") and 3 <= len(body) <= 10 and body.isascii() and body.isalpha()):
            continue
        if body.islower() and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.append(text)
            if len(words) >= limit:
                break
    if len(words) < 100:
        raise ValueError("the tokenizer has too few plain word tokens to build prompts from")
    return words


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_workload(
    builder: PromptBuilder, num_prompts: int, input_len: int, output_len: int, range_ratio: float
) -> Workload:
    requests = []
    for _ in range(num_prompts):
        prompt_len = _length(builder.rng, input_len, range_ratio)
        text, ids = builder.build(prompt_len)
        requests.append(BenchRequest(text, tuple(ids), _length(builder.rng, output_len, range_ratio)))
    return Workload("random", requests)


def shared_prefix_workload(
    builder: PromptBuilder, num_prompts: int, prefix_len: int, question_len: int, output_len: int, range_ratio: float,
    num_prefixes: int = 1,
) -> Workload:
    if num_prefixes < 1:
        raise ValueError(f"need at least one prefix, got {num_prefixes}")
    # The questions start on their own line; the newline is a token of its own.
    prefixes = [(text + "\n", ids) for text, ids in (builder.build(prefix_len) for _ in range(num_prefixes))]
    requests = []
    for i in range(num_prompts):
        prefix, prefix_ids = prefixes[i % num_prefixes]
        total = len(builder.encode(prefix)) + _length(builder.rng, question_len, range_ratio)
        text, ids = builder.build(total, head=prefix)
        if ids[:prefix_len] != prefix_ids:
            raise ValueError("the common prefix does not tokenize the same inside a prompt")
        requests.append(BenchRequest(text, tuple(ids), _length(builder.rng, output_len, range_ratio)))
    return Workload("shared-prefix", requests, prefix_len=prefix_len, num_prefixes=num_prefixes)


def long_prompt_interference_workload(
    builder: PromptBuilder,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    long_prompt_len: int,
    long_output_len: int,
    num_long_prompts: int,
    long_rate: float,
) -> Workload:
    decodes = random_workload(builder, num_prompts, input_len, output_len, range_ratio).requests
    decodes = [BenchRequest(r.prompt, r.prompt_token_ids, r.max_tokens, "decode") for r in decodes]
    longs = []
    for _ in range(num_long_prompts):
        text, ids = builder.build(_length(builder.rng, long_prompt_len, min(range_ratio, 0.1)))
        longs.append(BenchRequest(text, tuple(ids), long_output_len, "long"))
    return Workload("long-prompt-interference", decodes, longs, long_rate)
