"""Prompt logprobs: each prompt token's logprob given the tokens before it, its rank and the top
alternatives, equal to transformers' full-prompt forward, whatever chunking, prefix-cache state,
preemption or hand-off the prompt goes through; sent once, with the first token."""

from __future__ import annotations

import functools

import pytest
import torch

from common.sampling_params import SamplingParams
from tests.engine.conftest import hf_model, prompt_ids

K = 3


@functools.cache
def _reference(prompt: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model()(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(prompt: tuple[int, ...], got, k: int = K) -> None:  # type: ignore[no-untyped-def]
    ref = _reference(prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row = got[i], ref[i - 1]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=2e-3), i
        # The rank counts the tokens strictly more likely; near-ties may differ by float noise.
        assert abs(entry.rank - (int((row > row[prompt[i]]).sum()) + 1)) <= 1, i
        assert len(entry.top) == k
        assert [t.logprob for t in entry.top] == pytest.approx(row.topk(k).values.tolist(), abs=2e-3)


def _run(engine, request_id: str, prompt, params):  # type: ignore[no-untyped-def]
    engine.add_request(request_id, list(prompt), params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def _run_all(engine) -> dict[str, list]:  # type: ignore[no-untyped-def]
    """Step until every request is done; each request's prompt logprobs, checked to come once."""
    firsts: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in firsts, "sent twice"
                firsts[out.request_id] = out.prompt_logprobs
    return firsts


PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("budget", [8, 512], ids=["chunked", "whole"])
def test_prompt_logprobs_equal_transformers_and_come_once_with_the_first_token(engine_factory, budget,  # type: ignore[no-untyped-def]
                                                                                async_scheduling):
    prompt = prompt_ids()[12]
    assert len(prompt) > 3 * 8
    engine = engine_factory(block_size=16, max_num_batched_tokens=budget, async_scheduling=async_scheduling)
    outs = _run(engine, "a", prompt, PARAMS)
    _check(prompt, outs[0].prompt_logprobs)
    assert all(o.prompt_logprobs is None for o in outs[1:])
    # A second run hits the prefix cache for plain requests, yet computes every position for this one.
    plain = _run(engine, "b", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    assert plain[0].prompt_logprobs is None and plain[0].num_cached_tokens > 0
    again = _run(engine, "c", prompt, PARAMS)
    assert again[0].num_cached_tokens == 0
    _check(prompt, again[0].prompt_logprobs)
    assert [o.new_token_ids for o in again] == [o.new_token_ids for o in outs]


def test_zero_alternatives_and_n2_give_them_to_the_first_choice_only(engine_factory):  # type: ignore[no-untyped-def]
    prompt = prompt_ids()[6]
    engine = engine_factory(block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0, n=2)
    engine.add_request("r", list(prompt), params)
    by_id: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            by_id.setdefault(out.request_id, []).append(out)
    _check(prompt, by_id["r"][0].prompt_logprobs, k=0)
    assert all(o.prompt_logprobs is None for o in by_id["r#1"])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_keeps_them_whole_exact_and_sent_once(engine_factory, async_scheduling):  # type: ignore[no-untyped-def]
    """Also under async scheduling, where a step's logprobs reach the request when a later step
    resolves."""
    prompts = [p for p in prompt_ids() if len(p) < 60][:8]
    engine = engine_factory(block_size=16, num_blocks=24, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, prompt_logprobs=K)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", list(prompt), params)
    firsts = _run_all(engine)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    for i, prompt in enumerate(prompts):
        _check(prompt, firsts[f"r{i}"])


def test_the_prefill_instance_sends_them_and_a_continuation_does_not(engine_factory):  # type: ignore[no-untyped-def]
    prompt = prompt_ids()[12]
    prefill = engine_factory(block_size=16, max_num_batched_tokens=32)
    prefill.add_request("r", list(prompt), PARAMS, kv_transfer=True)
    outs = []
    while not outs:
        outs = prefill.step()
    assert outs[0].kv_handoff is not None
    _check(prompt, outs[0].prompt_logprobs)
    assert prefill.release_kv("r")
    # Continued elsewhere after its first token: the router already has them.
    prefill.add_request("r2", list(prompt), PARAMS, output_token_ids=outs[0].new_token_ids)
    rest = []
    while prefill.has_unfinished_requests():
        rest += prefill.step()
    assert rest and all(o.prompt_logprobs is None for o in rest)


def test_too_many_entries_are_refused_naming_the_field(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory(block_size=16)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("big", [1] * 8000, SamplingParams(max_tokens=1, prompt_logprobs=20))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_recompute_skips_the_positions_still_on_their_way(engine_factory, async_scheduling):  # type: ignore[no-untyped-def]
    """Prompt logprobs join their request when a step that samples resolves; two prompts that only
    prefill sample nothing. The second is preempted by the first's growth, then recomputed in the step
    that completes the first: the positions its earlier chunks computed are still on their way, and
    must not be computed (and appended) again."""
    tokens = [t for p in prompt_ids() for t in p]
    first, second = tuple(tokens[:80]), tuple(tokens[100:160])
    engine = engine_factory(block_size=16, num_blocks=6, max_num_batched_tokens=32, long_prefill_token_threshold=16,
                            async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)
    engine.add_request("first", list(first), params)
    engine.add_request("second", list(second), params)
    firsts = _run_all(engine)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    _check(first, firsts["first"])
    _check(second, firsts["second"])
