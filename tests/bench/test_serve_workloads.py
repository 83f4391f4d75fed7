"""Workloads: exact prompt lengths, a shared prefix that stays a token prefix, reproducible from the seed."""

from __future__ import annotations

from typing import Any

import pytest

from ops.bench.serve_workloads import (
    PromptBuilder,
    long_prompt_interference_workload,
    random_workload,
    shared_prefix_workload,
)

WORDS = [" " + a + b + c for a in "bcdfg" for b in "aeiou" for c in "lmnrst"]  # 150 three-letter words


class WordTokenizer:
    """A stand-in tokenizer: one token per space-led word or per other character."""

    def __init__(self) -> None:
        self.vocab = ["\n", " ", *WORDS]

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            word = text[i:i + 4]
            if word in WORDS:
                ids.append(self.vocab.index(word))
                i += 4
            else:
                ids.append(self.vocab.index(text[i]))
                i += 1
        return ids

    def batch_decode(self, batch: list[list[int]]) -> list[str]:
        return ["".join(self.vocab[i] for i in ids) for ids in batch]


def builder(seed: int = 0) -> PromptBuilder:
    tokenizer: Any = WordTokenizer()
    return PromptBuilder(tokenizer, seed)


def test_random_prompts_have_the_token_lengths_they_claim_within_the_range() -> None:
    b = builder()
    w = random_workload(b, 20, input_len=40, output_len=10, range_ratio=0.5)
    for r in w.requests:
        assert 20 <= r.prompt_len <= 60 and 5 <= r.max_tokens <= 15
        assert b.encode(r.prompt) == list(r.prompt_token_ids)
    assert len({r.prompt_len for r in w.requests}) > 5


def test_same_seed_same_workload() -> None:
    one = random_workload(builder(3), 5, 30, 10, 0.5).requests
    assert one == random_workload(builder(3), 5, 30, 10, 0.5).requests
    assert one != random_workload(builder(4), 5, 30, 10, 0.5).requests


def test_shared_prefix_is_a_token_prefix_of_every_prompt_and_questions_differ() -> None:
    b = builder()
    w = shared_prefix_workload(b, 8, prefix_len=64, question_len=8, output_len=4, range_ratio=0.5)
    prefix = w.requests[0].prompt_token_ids[:64]
    assert w.prefix_len == 64
    for r in w.requests:
        assert r.prompt_token_ids[:64] == prefix and 64 + 4 <= r.prompt_len <= 64 + 1 + 12
    assert len({r.prompt_token_ids[64:] for r in w.requests}) == 8


def test_several_prefixes_are_taken_in_turn_each_a_token_prefix_of_its_prompts() -> None:
    w = shared_prefix_workload(builder(), 9, prefix_len=32, question_len=8, output_len=4, range_ratio=0.5,
                               num_prefixes=3)
    heads = [r.prompt_token_ids[:32] for r in w.requests]
    assert len(set(heads)) == 3 and heads[:3] * 3 == heads
    assert shared_prefix_workload(builder(), 4, 32, 8, 4, 0.5).requests == \
        shared_prefix_workload(builder(), 4, 32, 8, 4, 0.5, num_prefixes=1).requests
    with pytest.raises(ValueError, match="at least one prefix"):
        shared_prefix_workload(builder(), 4, 32, 8, 4, 0.5, num_prefixes=0)


def test_interference_mixes_running_decodes_and_long_prompts() -> None:
    w = long_prompt_interference_workload(builder(), 6, 16, 40, 0.5, long_prompt_len=200, long_output_len=4,
                                          num_long_prompts=3, long_rate=2.0)
    assert {r.kind for r in w.requests} == {"decode"} and len(w.requests) == 6
    assert {r.kind for r in w.long_requests} == {"long"} and len(w.long_requests) == 3
    assert all(180 <= r.prompt_len <= 220 and r.max_tokens == 4 for r in w.long_requests)
    assert w.describe()["long_requests"]["num"] == 3
