"""Shared fixtures for engine tests: the default model, its tokenizer and transformers' outputs."""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.model.loader import resolve_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors of the rainbow:",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Q: What is the boiling point of water at sea level?\nA:",
    "In machine learning, overfitting happens when",
    "1, 2, 3, 5, 8, 13,",
    "Write a haiku about the ocean.",
    "SELECT name, age FROM users WHERE",
    "A long time ago the history of the Roman Empire began with " * 12,
    "Dear Sir or Madam, I am writing to",
    "The mitochondria is",
    "<html><body><h1>Title</h1><p>",
]
MAX_NEW_TOKENS = 48


@functools.cache
def model_path() -> str:
    return str(resolve_model_path(None))


@functools.cache
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path())


def drain_tokens(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Steps ``engine`` until its requests finish: each one's tokens and finish reason, by id."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    return tokens, reasons


@functools.cache
def prompt_ids() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(tokenizer()(p).input_ids) for p in PROMPTS)


@functools.cache
def hf_model():  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()


@functools.cache
def hf_greedy(prompt: tuple[int, ...], max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[int, ...]:
    """transformers ``generate`` (greedy, float32, CPU), EOS ignored; computed once per test run
    (the test processes of a run share the results, see ``PDSERVE_TEST_SHARED_DIR``). The prompts of
    ``PROMPTS`` go through in one left-padded batch, which gives exactly what one prompt at a time
    gives for them (checked when this was written) in a third of the time; any other prompt alone
    (``hf_greedy_batch`` batches others)."""
    if max_new_tokens <= MAX_NEW_TOKENS and prompt in prompt_ids():  # greedy: a prefix of the longer run
        return hf_greedy_batch(prompt_ids())[prompt_ids().index(prompt)][:max_new_tokens]
    return _shared_result([list(prompt), max_new_tokens], lambda: _hf_generate([prompt], max_new_tokens))[0]


@functools.cache
def hf_greedy_batch(prompts: tuple[tuple[int, ...], ...], max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[tuple[int, ...], ...]:
    """``hf_greedy`` of each prompt, in one left-padded batch."""
    return _shared_result([list(map(list, prompts)), max_new_tokens], lambda: _hf_generate(prompts, max_new_tokens))


def _shared_result(what: list[Any], compute: Callable[[], tuple[tuple[int, ...], ...]]) -> tuple[tuple[int, ...], ...]:
    shared = os.environ.get("PDSERVE_TEST_SHARED_DIR")
    if not shared:
        return compute()
    key = hashlib.sha256(json.dumps([model_path(), what]).encode()).hexdigest()[:32]
    path = Path(shared) / f"hf-greedy-{key}.json"
    with FileLock(f"{path}.lock"):  # another process computing the same one: wait for it
        if path.exists():
            return tuple(tuple(t) for t in json.loads(path.read_text()))
        tokens = compute()
        path.write_text(json.dumps(tokens))
        return tokens


def _hf_generate(prompts: Sequence[tuple[int, ...]], max_new_tokens: int) -> tuple[tuple[int, ...], ...]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):  # padded on the left, masked out
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = hf_model().generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )
    return tuple(tuple(row[width:].tolist()) for row in out)


def make_engine(**overrides) -> LLMEngine:  # type: ignore[no-untyped-def]
    cfg = {"model": model_path(), "num_blocks": 256, "block_size": 16, "max_num_batched_tokens": 512}
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


@pytest.fixture
def engine_factory():  # type: ignore[no-untyped-def]
    """Builds engines and checks, after the test, that every block is free and the pool is sound."""
    engines: list[LLMEngine] = []

    def build(**overrides) -> LLMEngine:  # type: ignore[no-untyped-def]
        eng = make_engine(**overrides)
        engines.append(eng)
        return eng

    yield build
    for eng in engines:
        eng.check_integrity()
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks, "blocks leaked after the test"
        assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    # An engine sits in reference cycles (its grammar cache holds a bound method of it): collect them
    # now, so that each test's KV caches (hundreds of MB each) are gone before the next one builds its own.
    engines.clear()
    gc.collect()
