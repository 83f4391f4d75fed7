"""Greedy output through the engine equals transformers ``generate`` token for token.

Block size, token budget (chunks ending inside blocks), prefix-cache hits, preemption and n > 1
must never change a greedy output.
"""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from tests.engine.conftest import MAX_NEW_TOKENS, hf_greedy, hf_greedy_batch, prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def _expected() -> list[list[int]]:
    return [list(hf_greedy(p)) for p in prompt_ids()]


def _run(engine, prompts, params=GREEDY):  # type: ignore[no-untyped-def]
    return [choices[0] for choices in engine.generate([list(p) for p in prompts], params)]


# Budget 12 ends prefill chunks inside 16-token blocks (12, 24, 36...) and decodes 12 requests a step;
# 64 chunks prompts across 32-token blocks; 512 takes every prompt whole.
@pytest.mark.parametrize(("budget", "block_size"), [(12, 16), (64, 32), (512, 16)])
def test_greedy_equals_transformers_for_block_sizes_and_token_budgets(engine_factory, block_size, budget):
    assert len(prompt_ids()) >= 16
    engine = engine_factory(block_size=block_size, max_num_batched_tokens=budget, num_blocks=8192 // block_size)
    got = _run(engine, prompt_ids())
    expected = _expected()
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} diverged at token {next(j for j, (a, b) in enumerate(zip(g, e, strict=False)) if a != b)}"


def test_capped_prefill_chunks_do_not_change_output(engine_factory):
    engine = engine_factory(block_size=16, max_num_batched_tokens=512, long_prefill_token_threshold=7)
    assert engine.scheduler.max_prefill_chunk == 7
    assert _run(engine, prompt_ids()) == _expected()


def test_prefix_cache_hits_do_not_change_output(engine_factory):
    engine = engine_factory(block_size=16, max_num_batched_tokens=64)
    prompts = prompt_ids()
    # Half the usual output: these runs go one or three prompts at a time, a model step per token.
    short = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS // 2, ignore_eos=True)
    # The same prompt twice: the second run reuses every full block but the last token's.
    first = _run(engine, [prompts[12]], short)
    hits_before = engine.kv.prefix_cache_hits
    second = _run(engine, [prompts[12]], short)
    assert engine.kv.prefix_cache_hits - hits_before >= (len(prompts[12]) - 1) // 16 * 16 > 0
    assert first == second == [list(hf_greedy(prompts[12], short.max_tokens))]
    # A shared prefix that ends mid-block: a prefix of 12 blocks + 5 tokens, then different tails.
    shared = list(prompts[12][: 16 * 3 + 5])
    variants = [tuple(shared + list(prompts[i][1:9])) for i in (0, 3, 9)]
    hits_before = engine.kv.prefix_cache_hits
    got = _run(engine, variants, short)
    assert engine.kv.prefix_cache_hits - hits_before >= 3 * 16 * 3
    assert got == [list(e) for e in hf_greedy_batch(tuple(variants), short.max_tokens)]


def test_forced_preemption_keeps_greedy_output(engine_factory):
    # 8 prompts, each needing up to ~8 blocks; 24 blocks cannot hold them all at once.
    engine = engine_factory(block_size=16, num_blocks=24, max_num_batched_tokens=64)
    prompts = [p for p in prompt_ids() if len(p) < 60][:8]
    got = _run(engine, prompts)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert got == [list(hf_greedy(p)) for p in prompts]


def test_n2_greedy_gives_two_identical_copies_sharing_prompt_blocks(engine_factory):
    engine = engine_factory(block_size=16)
    prompt = list(prompt_ids()[6])  # ends mid-block, so the shared last block is copied on write
    assert len(prompt) % 16 != 0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, n=2)
    engine.add_request("r", prompt, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert set(outputs) == {"r", "r#1"}
    assert engine.kv.num_cow_copies == 1, "the shared partial block must be copied once"
    assert outputs["r"] == outputs["r#1"] == list(hf_greedy(tuple(prompt)))
