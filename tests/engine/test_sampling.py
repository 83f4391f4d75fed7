"""Sampling: seeds, logprobs, stop conditions, penalties and filters, on the real model and on hand-made logits.

A seeded request's draws are a function of its seed and output position, so its tokens must not depend
on which other requests share its batch, how the prompt was chunked or where it continued; logprobs are those of the model's raw distribution.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

import common.engine.row_ops as row_ops
import common.engine.sampler as sampler_module
import common.engine.seeded_draws as seeded_draws
from common.engine.engine import LLMEngine
from common.engine.request import Request
from common.engine.row_ops import argmax_rows, topk_rows
from common.engine.sampler import Sampler, apply_top_p
from common.protocol import PositionLogprobs
from common.sampling_params import SamplingParams
from tests.engine.conftest import hf_greedy, hf_model, prompt_ids, tokenizer
from tests.engine.splitmix import GOLDEN, MASK, key_with_state, mix

SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
STORY = (
    "Once upon a time, in a land far away, there lived a young girl who loved to explore the forest "
    "near her village. One day she found"
)
REPETITIVE = "I like cats. I like cats. I like cats. I like cats."


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    saw_logprobs_none: bool = False


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    """Add every request, step until all finish; per request id (children included) what came out."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, list(prompt), params)
    results: dict[str, Result] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            res = results.setdefault(out.request_id, Result())
            assert res.finish_reason is None, f"{out.request_id} produced output after finishing"
            res.token_ids.extend(out.new_token_ids)
            if out.logprobs is None:
                res.saw_logprobs_none = True
            else:
                res.logprobs.extend(out.logprobs)
            res.finish_reason = out.finish_reason
    return results


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(length)]  # ids 0..2 are special


def _companions(seed: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Five other requests of different lengths and kinds (greedy, unseeded, other seeds)."""
    rng = random.Random(seed)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=40, seed=99, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, min_p=0.05, seed=7, max_tokens=18, ignore_eos=True, n=2),
    ]
    lengths = [7, 131, 40, 70, 18]
    return {f"c{seed}-{i}": (_random_prompt(rng, n), p) for i, (n, p) in enumerate(zip(lengths, kinds, strict=True))}


# --------------------------------------------------------------------------- through the engine
def test_seeded_sampling_is_reproducible_across_runs_batch_companions_and_token_budgets(engine_factory):
    prompt = list(tokenizer()(STORY).input_ids)
    engine = engine_factory()
    alone = _run(engine, {"alone": (prompt, SEEDED)})["alone"].token_ids
    hits = engine.kv.prefix_cache_hits
    again = _run(engine, {"again": (prompt, SEEDED)})["again"].token_ids
    assert engine.kv.prefix_cache_hits > hits, "the second run was meant to start from cached blocks"
    batch = {**dict(list(_companions(1).items())[:2]), "mixed": (prompt, SEEDED), **dict(list(_companions(1).items())[2:])}
    mixed = _run(engine, batch)
    # Another engine: prompts chunked by a small token budget, different block size, other companions.
    chunked_engine = engine_factory(max_num_batched_tokens=40, block_size=32, num_blocks=128)
    chunked = _run(chunked_engine, {**_companions(2), "chunked": (prompt, SEEDED)})

    assert len(alone) == SEEDED.max_tokens
    assert alone == again == mixed["mixed"].token_ids == chunked["chunked"].token_ids
    assert alone != list(hf_greedy(tuple(prompt), SEEDED.max_tokens)), "sampling never left the greedy path"
    assert len(mixed) == 7 and len(chunked) == 7  # the n=2 companion has two choices


def test_different_seeds_give_different_tokens(engine_factory):
    prompt = list(tokenizer()(STORY).input_ids)
    engine = engine_factory()
    seeds = [1234, 4321, 5]
    got = _run(engine, {f"s{s}": (prompt, SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=16,
                                                         ignore_eos=True)) for s in seeds})
    outputs = [tuple(got[f"s{s}"].token_ids) for s in seeds]
    assert len(set(outputs)) == len(seeds)


def test_logprobs_are_the_models_raw_log_softmax_with_k_sorted_alternatives(engine_factory):
    engine = engine_factory()
    prompts = {name: list(prompt_ids()[i]) for name, i in (("k20", 0), ("k5", 3), ("k0", 9), ("sampled", 1))}
    params = {
        "k20": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=20),
        "k5": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5),
        "k0": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0),
        # Logprobs of a sampled token come from the raw distribution, not the tempered, penalized one.
        "sampled": SamplingParams(temperature=0.6, top_k=50, repetition_penalty=1.2, seed=3, max_tokens=10,
                                  ignore_eos=True, logprobs=3),
        "none": SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    }
    prompts["none"] = list(prompt_ids()[4])
    got = _run(engine, {name: (prompts[name], params[name]) for name in params})

    assert got["none"].logprobs == [] and got["none"].saw_logprobs_none
    for name in ("k20", "k5", "k0", "sampled"):
        res, k = got[name], params[name].logprobs
        assert k is not None and len(res.logprobs) == len(res.token_ids) == params[name].max_tokens
        prompt = prompts[name]
        with torch.inference_mode():
            logits = hf_model()(torch.tensor([prompt + res.token_ids])).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)
        for i, (token, lp) in enumerate(zip(res.token_ids, res.logprobs, strict=True)):
            ref = reference[len(prompt) - 1 + i]
            assert lp.token_id == token
            assert abs(lp.logprob - float(ref[token])) < 1e-4, f"{name} position {i}"
            assert len(lp.top) == k
            values = [t.logprob for t in lp.top]
            assert values == sorted(values, reverse=True)
            assert len({t.token_id for t in lp.top}) == k
            ref_top = torch.topk(ref, k).values.tolist() if k else []
            assert all(abs(a - b) < 1e-4 for a, b in zip(values, ref_top, strict=True))
            for t in lp.top:
                assert abs(t.logprob - float(ref[t.token_id])) < 1e-4
            if params[name].greedy and k:
                assert lp.top[0].token_id == token and lp.top[0].logprob == lp.logprob
    assert got["k20"].token_ids == list(hf_greedy(tuple(prompts["k20"]), 10))


def _chat_prompt(text: str) -> list[int]:
    tok = tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    return list(tok(rendered, add_special_tokens=False).input_ids)


def test_stop_tokens_eos_max_tokens_ignore_eos_and_min_tokens(engine_factory):
    engine = engine_factory()
    (eos,) = engine.eos_token_ids
    plain = list(prompt_ids()[0])
    plain_greedy = list(hf_greedy(tuple(plain), 16))
    # A stop token the greedy output reaches at index k, not before.
    k = next(i for i in range(3, 12) if plain_greedy[i] not in plain_greedy[:i])
    stop = plain_greedy[k]
    chat = _chat_prompt("What is 2+2? Answer with one number.")
    chat_greedy = list(hf_greedy(tuple(chat), 14))
    assert eos in chat_greedy[:10], "the chat prompt was meant to end its answer early"
    eos_at = chat_greedy.index(eos)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    got = _run(engine, {
        "stop": (plain, replace(greedy, stop_token_ids=[stop])),
        "stop-after-min": (plain, replace(greedy, stop_token_ids=[stop], min_tokens=k + 2)),
        "length": (plain, replace(greedy, max_tokens=5)),
        "eos": (chat, replace(greedy, max_tokens=14)),
        "ignore-eos": (chat, replace(greedy, max_tokens=14, ignore_eos=True)),
        "min-tokens": (chat, replace(greedy, max_tokens=14, min_tokens=eos_at + 4)),
    })
    assert got["stop"].token_ids == plain_greedy[: k + 1] and got["stop"].finish_reason == "stop"
    assert got["length"].token_ids == plain_greedy[:5] and got["length"].finish_reason == "length"
    assert got["eos"].token_ids == chat_greedy[: eos_at + 1] and got["eos"].finish_reason == "stop"
    assert got["ignore-eos"].token_ids == chat_greedy and got["ignore-eos"].finish_reason == "length"
    min_tokens = got["min-tokens"].token_ids
    assert min_tokens[:eos_at] == chat_greedy[:eos_at]
    assert eos not in min_tokens[: eos_at + 4] and len(min_tokens) > eos_at + 4
    after_min = got["stop-after-min"].token_ids
    assert stop not in after_min[: k + 2] and len(after_min) > k + 2


def test_penalties_move_a_greedy_output_away_from_repetition(engine_factory):
    engine = engine_factory()
    prompt = list(tokenizer()(REPETITIVE).input_ids)
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = _run(engine, {
        "plain": (prompt, base),
        "repetition": (prompt, replace(base, repetition_penalty=1.3)),
        "presence": (prompt, replace(base, presence_penalty=2.0)),
        "frequency": (prompt, replace(base, frequency_penalty=1.0)),
        "negative-presence": (prompt, replace(base, presence_penalty=-2.0)),
    })
    out = {name: r.token_ids for name, r in got.items()}
    assert out["plain"] == list(hf_greedy(tuple(prompt), 24))

    def num_repeats(tokens: list[int], seen: set[int]) -> int:
        seen = set(seen)
        count = 0
        for t in tokens:
            count += t in seen
            seen.add(t)
        return count

    assert num_repeats(out["plain"], set(prompt)) > 16, "the prompt was meant to make greedy repeat itself"
    assert num_repeats(out["repetition"], set(prompt)) < num_repeats(out["plain"], set(prompt)) // 2
    assert len(set(out["presence"])) > len(set(out["plain"]))
    assert max(Counter(out["frequency"]).values()) < max(Counter(out["plain"]).values())
    assert len(set(out["negative-presence"])) <= len(set(out["plain"]))
    # The repetition penalty is transformers' (over prompt and output): greedy matches its generate.
    with torch.inference_mode():
        hf = hf_model().generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, repetition_penalty=1.3)
    assert out["repetition"] == hf[0, len(prompt):].tolist()


def test_sampling_restricted_to_one_token_equals_greedy(engine_factory):
    engine = engine_factory()
    prompt = list(prompt_ids()[7])
    one_token = {
        "top_k=1": SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
        "top_p=0.01": SamplingParams(temperature=1.0, top_p=0.01, max_tokens=12, ignore_eos=True),
        "min_p=1": SamplingParams(temperature=1.5, min_p=1.0, max_tokens=12, ignore_eos=True, seed=8),
    }
    got = _run(engine, {name: (prompt, p) for name, p in one_token.items()})
    expected = list(hf_greedy(tuple(prompt), 12))
    for name in one_token:
        assert got[name].token_ids == expected, name


def test_n2_seeded_choices_differ_and_are_reproducible(engine_factory):
    engine = engine_factory()
    prompt = list(prompt_ids()[10])
    params = SamplingParams(temperature=1.0, seed=2024, max_tokens=16, ignore_eos=True, n=2)
    first = _run(engine, {"a": (prompt, params)})
    second = _run(engine, {"b": (prompt, params)})
    assert set(first) == {"a", "a#1"} and set(second) == {"b", "b#1"}
    assert first["a"].token_ids != first["a#1"].token_ids
    assert first["a"].token_ids == second["b"].token_ids and first["a#1"].token_ids == second["b#1"].token_ids
    assert all(len(r.token_ids) == 16 and r.finish_reason == "length" for r in (*first.values(), *second.values()))


# --------------------------------------------------------------------------- the Sampler on hand-made logits
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
PERM = [2, 0, 3, 1]  # token ids are not in probability order
LOGITS = torch.empty(4).index_copy_(0, torch.tensor(PERM), PROBS.log())  # token PERM[i] has PROBS[i]


def _request(params: SamplingParams, prompt: tuple[int, ...] = (9,), output: tuple[int, ...] = ()) -> Request:
    req = Request("r", list(prompt), params, block_size=16, model_id="m")
    for t in output:
        req.append_output_token(t)
    return req


def _draw(params: SamplingParams, num: int, logits: torch.Tensor = LOGITS, seed: int = 0) -> Counter[int]:
    """``num`` independent draws from the sampler's own generator, one row each."""
    sampler = Sampler(eos_token_ids=set(), seed=seed)
    rows = logits.expand(num, -1).contiguous()
    return Counter(sampler(rows, [_request(params) for _ in range(num)]).token_ids)


def _ids(*ranks: int) -> set[int]:
    return {PERM[r] for r in ranks}


@pytest.mark.parametrize(("top_p", "kept_ranks"), [(0.45, (0,)), (0.75, (0, 1)), (0.85, (0, 1, 2)), (0.97, (0, 1, 2, 3))])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p, kept_ranks):
    counts = _draw(SamplingParams(top_p=top_p), 3000)
    assert set(counts) == _ids(*kept_ranks)
    mass = float(PROBS[list(kept_ranks)].sum())
    for r in kept_ranks:
        assert abs(counts[PERM[r]] / 3000 - float(PROBS[r]) / mass) < 0.04


@pytest.mark.parametrize(("min_p", "kept_ranks"), [(0.05, (0, 1, 2, 3)), (0.2, (0, 1, 2)), (0.5, (0, 1)), (0.7, (0,))])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(min_p, kept_ranks):
    assert set(_draw(SamplingParams(min_p=min_p), 2000)) == _ids(*kept_ranks)


@pytest.mark.parametrize(("top_k", "kept_ranks"), [(1, (0,)), (2, (0, 1)), (3, (0, 1, 2)), (0, (0, 1, 2, 3)), (-1, (0, 1, 2, 3))])
def test_top_k_keeps_the_k_most_likely_tokens(top_k, kept_ranks):
    assert set(_draw(SamplingParams(top_k=top_k), 2000)) == _ids(*kept_ranks)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_unseeded_draws_follow_the_tempered_probabilities(temperature):
    num = 20_000
    counts = _draw(SamplingParams(temperature=temperature), num)
    expected = torch.softmax(PROBS.log() / temperature, dim=-1)
    for r in range(4):
        freq = counts[PERM[r]] / num
        p = float(expected[r])
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / num) + 1e-3, (r, freq, p)
    assert _draw(SamplingParams(temperature=temperature), 500, seed=3) == _draw(
        SamplingParams(temperature=temperature), 500, seed=3
    ), "a fixed generator must give the same draws"


def test_a_seeded_row_draws_the_same_token_wherever_it_sits_in_the_batch():
    vocab = 1000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler(set(), seed=1)(logits[3:4], [_request(seeded)]).token_ids[0] for _ in range(2)]
    others = [_request(SamplingParams(temperature=1.0)) for _ in range(5)]
    batch = Sampler(set(), seed=2)(logits, [*others[:3], _request(seeded), *others[3:]]).token_ids
    assert alone[0] == alone[1] == batch[3]
    # Successive tokens of one request draw other noise (the draw index is the output position); the
    # same position draws the same token again.
    req = _request(seeded)
    sampler = Sampler(set())
    draws = []
    for _ in range(20):
        draws.append(sampler(logits[3:4], [req]).token_ids[0])
        assert sampler(logits[3:4], [req]).token_ids[0] == draws[-1]
        req.append_output_token(draws[-1])
    assert len(set(draws)) > 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    sampler = Sampler(set())
    positive = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    assert sampler(positive, [_request(greedy, prompt=(0,))]).token_ids == [1]  # 2.0 / 1.3 < 1.9
    assert sampler(positive, [_request(greedy, prompt=(3,))]).token_ids == [0]
    negative = torch.tensor([[-1.0, -1.1, -5.0, -5.0]])
    assert sampler(negative, [_request(greedy, prompt=(0,))]).token_ids == [1]  # -1.0 * 1.3 < -1.1
    assert sampler(negative, [_request(greedy, prompt=(2,), output=(0,))]).token_ids == [1]


def test_presence_and_frequency_penalties_count_only_output_tokens():
    sampler = Sampler(set())
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    presence = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sampler(logits, [_request(presence, prompt=(0, 0, 0))]).token_ids == [0]
    assert sampler(logits, [_request(presence, output=(0,))]).token_ids == [1]
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert sampler(logits, [_request(frequency, output=(0,))]).token_ids == [0]  # 2.0 - 0.3 > 1.5
    assert sampler(logits, [_request(frequency, output=(0, 2, 0))]).token_ids == [1]  # 2.0 - 0.6 < 1.5


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    sampler = Sampler(eos_token_ids={0})
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], max_tokens=8)
    assert sampler(logits, [_request(params, output=(3,))]).token_ids == [2]
    assert sampler(logits, [_request(params, output=(3, 3))]).token_ids == [0]
    no_eos = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, max_tokens=8)
    assert sampler(logits, [_request(no_eos)]).token_ids == [0]  # EOS stops nothing, so it is not banned


def test_sampler_logprobs_ignore_temperature_and_penalties_and_leave_logits_untouched():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = SamplingParams(temperature=0.3, repetition_penalty=1.5, presence_penalty=1.0, logprobs=4, seed=5)
    reqs = [_request(params, prompt=(1, 2, 3), output=(4,)), _request(SamplingParams(temperature=0.0))]
    result = Sampler(set())(logits, reqs)
    assert torch.equal(logits, before)
    raw = torch.log_softmax(before[0], dim=-1)
    lp = result.logprobs[0]
    assert lp is not None and result.logprobs[1] is None
    assert lp.token_id == result.token_ids[0] and lp.logprob == pytest.approx(float(raw[lp.token_id]), abs=1e-6)
    assert [t.token_id for t in lp.top] == torch.topk(raw, 4).indices.tolist()
    assert result.token_ids[1] == int(torch.argmax(before[1]))


# --------------------------------------------------------------------------- the batched Sampler against a per-row reference
def _reference_row(
    logits: torch.Tensor, req: Request, eos_token_ids: set[int], draw: bool = True
) -> tuple[int | None, torch.Tensor | None]:
    """One row the straightforward way: (greedy token, None) or (for a seeded request, with ``draw``,
    the token the draw contract picks, else None; the filtered probabilities the row draws from)."""
    p = req.sampling_params
    x = logits.float().clone()
    if req.num_output_tokens < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if banned:
            x[banned] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = x[seen]
        x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        ids, counts = torch.unique(torch.tensor(req.output_token_ids, dtype=torch.long), return_counts=True)
        x[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
    if p.greedy:
        return int(torch.argmax(x)), None
    x = x / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= p.top_p
        probs[order[drop]] = 0.0
    if p.min_p > 0.0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    if req.draw_seed is None or not draw:
        return None, probs
    keys = seeded_draws.draw_keys([req.draw_seed], [req.num_output_tokens])
    noise = seeded_draws.exponentials(keys, torch.arange(len(probs)))  # the whole row's noise
    return int(torch.argmax(probs / noise)), probs


BATCH_KINDS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.4, logprobs=2),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7, seed=5),  # greedy: no draw
    SamplingParams(temperature=0.8, top_k=20, seed=11),
    SamplingParams(temperature=1.0, top_p=0.9, seed=12),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.8, min_p=0.02, seed=13, logprobs=4),
    SamplingParams(temperature=1.2, min_p=0.1, repetition_penalty=1.2, seed=14),
    SamplingParams(temperature=0.9, presence_penalty=-1.0, frequency_penalty=0.5, top_p=0.95, seed=15),
    SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[1, 2], max_tokens=8),
    SamplingParams(temperature=1.0, min_tokens=2, top_k=5, seed=16),
    SamplingParams(temperature=1.1, top_p=0.7),  # unseeded: checked against the reference's support
    SamplingParams(temperature=0.6, top_k=8, repetition_penalty=0.8),
    SamplingParams(temperature=0.9, seed=17),  # seeded, no filter: on the CPU, the whole-row race
    SamplingParams(temperature=1.0, repetition_penalty=1.1, seed=18),
]


@pytest.mark.parametrize(("vocab", "top_p_window", "chunk_rows", "kernel_backend"),
                         [(300, None, None, "torch"), (3000, 32, 5, "torch"), (300, None, None, "triton")])
def test_batched_rows_equal_the_per_row_reference_for_greedy_and_seeded_requests_step_after_step(
    vocab, top_p_window, chunk_rows, kernel_backend, monkeypatch
):
    """Greedy and seeded rows give the reference's very tokens (a seeded one: the dense race over the
    whole row's counter-based noise), and unseeded rows stay in the reference's support.
    Half the rows are peaked, so from a 32-entry window top-p takes its window, a larger one and a full sort;
    with 5-row chunks the batch goes through the CPU's chunked path, the last chunk short. With the
    Triton backend (its interpreter here) the penalties, top-p with min-p, and the draws are its kernels."""
    if top_p_window is not None:
        monkeypatch.setattr(sampler_module, "TOP_P_WINDOW", top_p_window)
    if chunk_rows is not None:
        monkeypatch.setattr(sampler_module, "CPU_CHUNK_BYTES", 4 * vocab * chunk_rows)
    eos = {0}
    gen = torch.Generator().manual_seed(vocab)
    num_rows = 3 * len(BATCH_KINDS)
    scales = torch.tensor([6.0 if row % 2 else 1.0 for row in range(num_rows)]).unsqueeze(1)
    prompts = [tuple(torch.randint(0, vocab, (5 + row,), generator=gen).tolist()) for row in range(num_rows)]
    kinds = [BATCH_KINDS[row % len(BATCH_KINDS)] for row in range(num_rows)]
    batched = [_request(k, prompt=pr) for k, pr in zip(kinds, prompts, strict=True)]
    reference = [_request(k, prompt=pr) for k, pr in zip(kinds, prompts, strict=True)]
    sampler = Sampler(eos_token_ids=eos, seed=0, kernel_backend=kernel_backend)
    num_left_greedy = 0
    for _ in range(5):
        logits = torch.randn(num_rows, vocab, generator=gen) * scales
        before = logits.clone()
        result = sampler(logits, batched)
        assert torch.equal(logits, before), "the sampler wrote into its input"
        for row, (b, r) in enumerate(zip(batched, reference, strict=True)):
            token, probs = _reference_row(logits[row], r, eos)
            got = result.token_ids[row]
            if token is not None:
                assert got == token, (row, r.sampling_params)
            else:
                assert probs is not None and probs[got] > 0, (row, r.sampling_params)
            num_left_greedy += probs is not None and got != int(torch.argmax(logits[row]))
            b.append_output_token(got)
            r.append_output_token(got)
    assert num_left_greedy > 20, "sampling never left the greedy path"


def test_a_batch_plan_lasts_while_the_same_requests_come_in_order_and_is_rebuilt_for_any_other_batch():
    """The sampler sorts a batch's rows out once for as long as the same requests come in the same
    order; reordered or fewer requests get a plan of their own (a stale one would give each row another
    row's parameters)."""
    vocab = 400
    gen = torch.Generator().manual_seed(4)
    requests = [_request(kind, prompt=(row + 3, row + 4)) for row, kind in enumerate(BATCH_KINDS)]
    for req in requests:
        req.append_output_token(7)
    logits = torch.randn(len(requests), vocab, generator=gen) * 4
    sampler = Sampler(eos_token_ids={0})
    sampler(logits, requests)
    plan = sampler._plan
    sampler(logits, list(requests))  # another list of the same requests
    assert sampler._plan is plan
    for order in (requests[::-1], requests[2:], [requests[1], requests[0], *requests[2:]]):
        got = sampler(logits[: len(order)], order).token_ids
        fresh = Sampler(eos_token_ids={0})(logits[: len(order)], order).token_ids
        assert sampler._plan is not plan
        exact = [row for row, r in enumerate(order) if r.sampling_params.greedy or r.draw_seed is not None]
        assert len(exact) >= len(order) - 2
        assert [got[row] for row in exact] == [fresh[row] for row in exact]
        plan = sampler._plan


def test_a_seeded_request_continued_from_its_output_draws_what_the_uninterrupted_one_draws():
    """No generator state: a request rebuilt from its prompt and output so far (a migration, a decode
    after its prefill) draws the next tokens the uninterrupted request draws, in another batch."""
    vocab = 500
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, top_k=40, seed=21)
    whole = _request(params, prompt=(1, 2, 3))
    sampler = Sampler(set())
    steps = [torch.randn(2, vocab, generator=gen) * 3 for _ in range(8)]
    for logits in steps:
        whole.append_output_token(sampler(logits, [_request(SamplingParams(temperature=0.5)), whole]).token_ids[1])
    resumed = _request(params, prompt=(1, 2, 3), output=tuple(whole.output_token_ids[:5]))
    for logits in steps[5:]:
        resumed.append_output_token(Sampler(set(), seed=9)(logits[1:], [resumed]).token_ids[0])
    assert resumed.output_token_ids == whole.output_token_ids
    assert len(set(whole.output_token_ids)) > 3, "the draws never moved"
    # The same seed at another output position draws other noise; another seed, too.
    keys = seeded_draws.draw_keys([21, 21, 22], [0, 1, 0])
    noise = seeded_draws.exponentials(keys.unsqueeze(1), torch.arange(vocab).unsqueeze(0))
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])


def test_the_counter_based_noise_is_splitmix64_and_exponential():
    """``draw_keys`` and ``exponentials`` equal a pure-Python splitmix64 (int64 wrap-around and the
    masked right shifts included), and the noise has the Exp(1) mean and variance."""
    mask = MASK
    seeds, indices = [0, 1, -5, 2**70 + 3, 12345], [0, 7, 3, 100_000, 2**40]
    keys = seeded_draws.draw_keys(seeds, indices)
    tokens = [0, 1, 5, 49_151]
    noise = seeded_draws.exponentials(keys.unsqueeze(1), torch.tensor(tokens).unsqueeze(0))
    for row, (seed, index) in enumerate(zip(seeds, indices, strict=True)):
        key = mix((mix(seed & mask) + index * GOLDEN) & mask)
        assert int(keys[row]) & mask == key
        for col, t in enumerate(tokens):
            u = (mix((key + (t + 1) * GOLDEN) & mask) >> 11) * 2.0**-53
            assert float(noise[row, col]) == float(torch.tensor(-math.log1p(-u)).float())
    sample = seeded_draws.exponentials(keys[:1], torch.arange(1_000_000))
    assert abs(float(sample.mean()) - 1) < 0.01 and abs(float(sample.double().var()) - 1) < 0.02


def test_a_token_of_probability_zero_is_never_drawn_where_its_uniform_is_zero():
    """Where an entry's uniform is 0 (once in 2**53 entries; here a key built for it, through splitmix64's
    inverse), the logarithm is 0 and the noise float32's smallest normal: a zero-probability entry scores
    0 and loses (0 / 0 would be NaN, which wins an ``argmax``), a positive one scores high and wins. The
    same over whole rows and over the positive entries alone."""
    vocab, token = 3000, 1234
    key = key_with_state(token, 5)  # a state below 2**11: the uniform's 53 bits are all zero
    keys = torch.tensor([key, key])
    noise = seeded_draws.exponentials(keys[:1].unsqueeze(1), torch.arange(vocab).unsqueeze(0))[0]
    assert float(noise[token]) == seeded_draws.NOISE_MIN and float(noise.min()) == seeded_draws.NOISE_MIN
    assert int(noise.argmin()) == token and float(noise.kthvalue(2).values) > 1e-9
    probs = torch.softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)), dim=-1)
    probs[0, token] = 0.0  # row 0: the entry whose noise is least has probability zero
    probs[0, : vocab // 2] = 0.0  # and half of the row, so that the race over positive entries runs
    free = (probs[0] / torch.where(noise > seeded_draws.NOISE_MIN, noise, 1.0)).argmax()
    for whole_rows in (False, True):
        got = seeded_draws.exponential_race(probs.clone(), keys, whole_rows=whole_rows).tolist()
        assert got == [int(free), token], whole_rows


def _top_p_by_full_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: each row sorted whole, its entries kept while the mass before them is under top_p."""
    expected = probs.clone()
    for row in range(len(probs)):
        sorted_probs, order = torch.sort(probs[row], descending=True)
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= float(top_p[row])
        expected[row, order[drop]] = 0.0
    return expected


@pytest.mark.parametrize(("window", "vocab"), [(64, 2000), (5000, 2000), (16, 1500), (256, 49152), (1499, 1500)])
@pytest.mark.parametrize("kind", ["plain", "ties", "top-k zeros", "near 1"])
def test_top_p_on_a_window_of_the_largest_probabilities_equals_a_full_sort(window, vocab, kind):
    """From a window of each row's largest entries, then (rows whose window's last entry stays) the sorted
    values of the whole row: the tokens a full sort keeps. Where values tie at the cutoff, as many of
    them as the full sort keeps and no other entry (which of the tied ones is unspecified). "near 1":
    tied values and a top-p whose nucleus is the whole row or all but its last few entries, where the
    rounding of the mass before an entry decides."""
    num_rows = 40
    gen = torch.Generator().manual_seed(window + vocab)
    scales = torch.linspace(0.3, 8.0, num_rows).unsqueeze(1)
    logits = torch.randn(num_rows, vocab, generator=gen) * scales
    if kind in ("ties", "near 1"):
        logits = (logits * 2).round() / 2
    if kind == "top-k zeros":
        logits[logits < logits.topk(40, dim=-1).values[:, -1:]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.rand(num_rows, 1, generator=gen) * 0.9 + 0.05
    if kind == "near 1":
        top_p[:] = 0.9999999
    expected = _top_p_by_full_sort(probs, top_p)
    got = probs.clone()
    apply_top_p(got, top_p, window)
    if kind not in ("ties", "near 1"):
        assert torch.equal(got, expected)
    assert torch.equal((got > 0).sum(dim=-1), (expected > 0).sum(dim=-1))
    assert torch.equal(got.sort(dim=-1).values, expected.sort(dim=-1).values)
    assert torch.equal(got[got > 0], probs[got > 0])
    # Every entry above the smallest kept one stays: only tied entries may differ from the reference.
    smallest_kept = got.masked_fill(got == 0, float("inf")).amin(dim=-1, keepdim=True)
    assert not ((probs > smallest_kept) & (got == 0)).any()
    if kind == "plain" and 4 * window <= vocab:
        window_mass = probs.topk(window, dim=-1).values.cumsum(dim=-1)[:, -1]
        num_in_window = int((window_mass >= top_p[:, 0]).sum())
        assert 0 < num_in_window < num_rows, "both the window and the whole rows were meant to run"


def test_top_p_keeps_a_row_of_nans_whole_and_runs_rows_past_two_windows():
    """A NaN row (a model's NaN logits) stays NaN, with no crash and no index out of range; a flat row's
    nucleus outgrows the window and the window 16 times as large."""
    vocab = 49152
    probs = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 0.1, dim=-1)
    probs[1] = float("nan")
    top_p = torch.tensor([[0.9], [0.9], [0.5]])
    expected = _top_p_by_full_sort(probs, top_p)
    got = probs.clone()
    apply_top_p(got, top_p, 64)  # 64, then 1,024, then the whole row
    assert int((got[0] > 0).sum()) > 1024 and int((got[2] > 0).sum()) > 1024
    assert torch.equal(got[[0, 2]], expected[[0, 2]])
    assert got[1].isnan().any()


# Upper 0.1% points of the chi-square distribution by degrees of freedom (scipy is not a dependency).
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


@pytest.mark.parametrize("kernel_backend, num_rows", [("torch", 20_000), ("triton", 1_200)])
def test_batched_draws_follow_the_per_row_reference_distribution_chi_square(kernel_backend, num_rows):
    """``num_rows`` rows of one small distribution, four parameter sets, each unseeded and seeded (a seed
    per row), interleaved in one batch: each group's counts against the reference's filtered
    probabilities (chi-square goodness of fit at the 0.1% level), and no token the reference filters out
    is ever drawn. With the torch backend the unseeded rows draw by the inverse CDF and the seeded ones
    race; with Triton's (under its interpreter here) top-p and min-p are the nucleus kernel's and every
    row races in the race's kernel, the unseeded ones with keys from the generator."""
    probs = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.04, 0.01])
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    logits = torch.empty(8).index_copy_(0, perm, probs.log())
    kinds = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=6, top_p=0.9, min_p=0.1),
        SamplingParams(temperature=0.5, min_p=0.05),
    ]
    groups = [*kinds, *(replace(k, seed=0) for k in kinds)]
    requests = []
    for row in range(num_rows):
        params = groups[row % len(groups)]
        requests.append(_request(params if params.seed is None else replace(params, seed=row)))
    sampler = Sampler(set(), seed=11, kernel_backend=kernel_backend)
    tokens = sampler(logits.expand(num_rows, -1).contiguous(), requests).token_ids
    num_draws = num_rows // len(groups)
    for g, params in enumerate(groups):
        _, target = _reference_row(logits, _request(params), set(), draw=False)
        assert target is not None
        support = [t for t in range(8) if target[t] > 0]
        expected = {t: float(target[t] / target.sum()) * num_draws for t in support}
        assert 2 <= len(support) < 8 and min(expected.values()) >= 5, "a group that tests nothing"
        counts = Counter(tokens[g :: len(groups)])
        assert set(counts) <= set(support), (params, counts)
        chi2 = sum((counts[t] - e) ** 2 / e for t, e in expected.items())
        assert chi2 < CHI2_CRITICAL_0_001[len(support) - 1], (params, chi2, counts)


@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_logprobs_of_a_mixed_batch_are_each_rows_raw_log_softmax_with_its_own_k(chunk_rows, monkeypatch):
    vocab = 100
    if chunk_rows is not None:  # two chunks, logprob rows in both
        monkeypatch.setattr(sampler_module, "CPU_CHUNK_BYTES", 4 * vocab * chunk_rows)
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(4)) * 3
    ks = [None, 0, 3, 20, None, 7]
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, presence_penalty=2.0),
        SamplingParams(temperature=0.9, top_k=10),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
    ]
    reqs = [_request(replace(p, logprobs=k), prompt=(1, 2, 3), output=(4, 4)) for p, k in zip(kinds, ks, strict=True)]
    result = Sampler(set())(logits, reqs)
    for row, k in enumerate(ks):
        lp = result.logprobs[row]
        if k is None:
            assert lp is None
            continue
        raw = torch.log_softmax(logits[row], dim=-1)
        token = result.token_ids[row]
        assert lp is not None and lp.token_id == token
        assert lp.logprob == pytest.approx(float(raw[token]), abs=1e-6)
        top = torch.topk(raw, k) if k else None
        assert [t.token_id for t in lp.top] == ([] if top is None else top.indices.tolist())
        assert [t.logprob for t in lp.top] == pytest.approx([] if top is None else top.values.tolist(), abs=1e-6)


def test_the_race_equals_argmax_of_probs_over_the_whole_rows_noise_for_narrow_wide_and_tied_rows():
    """``exponential_race`` takes logarithms only over the entries of positive probability, all rows at once; each
    row's token equals that of the plain race over the whole row's noise (ties: the lowest id)."""
    vocab, num_rows = 5000, 12
    gen = torch.Generator().manual_seed(8)
    probs = torch.softmax(torch.randn(num_rows, vocab, generator=gen) * 2, dim=-1)
    for row in range(0, num_rows, 2):  # narrow: a few hundred tokens (or one) left
        keep = probs[row].topk(1 if row == 0 else 300).indices
        probs[row] = torch.zeros(vocab).index_copy_(0, keep, probs[row, keep])
    probs[4, :] = 0.0
    probs[4, [7, 900, 901]] = 1 / 3  # ties: equal probabilities
    probs[6, :] = 0.0  # no positive entry
    probs[8, [30, 4000]] = float("nan")  # NaNs beside positive entries
    rows = [r for r in range(num_rows) if r != 5]
    keys = seeded_draws.draw_keys([100 + r for r in rows], [r % 3 for r in rows])
    got = seeded_draws.exponential_race(probs[rows], keys)
    assert torch.equal(seeded_draws.exponential_race(probs[rows], keys, whole_rows=True), got)
    for i, row in enumerate(rows):
        noise = seeded_draws.exponentials(keys[i], torch.arange(vocab))
        assert int(got[i]) == int((probs[row] / noise).argmax()), row
    assert int(got[rows.index(6)]) == 0 and int(got[rows.index(8)]) == 30


def _tied_rows(num_rows: int, vocab: int, levels: int, specials: list[float], seed: int) -> torch.Tensor:
    """``[num_rows, vocab]`` of ``levels`` distinct values (ties across blocks are common), ``specials``
    (NaN, infinities) at random places, and row 0 all -inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (num_rows, vocab), generator=gen).float()
    rows = torch.randint(0, num_rows, (len(specials),), generator=gen).tolist()
    cols = torch.randint(0, vocab, (len(specials),), generator=gen).tolist()
    for value, row, col in zip(specials, rows, cols, strict=True):
        x[row, col] = value
    x[0] = float("-inf")
    return x


@settings(max_examples=200, deadline=None)
@given(
    num_rows=st.integers(20, 40), vocab=st.integers(2048, 3000), levels=st.integers(1, 6),
    specials=st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf")]), max_size=6),
    seed=st.integers(0, 2**31),
)
def test_argmax_rows_picks_torch_argmax_index_with_ties_nans_and_infinities(num_rows, vocab, levels, specials, seed):
    """The CPU's blocked argmax (block maxima, then the first winning block's own argmax) gives the very
    index of ``torch.argmax``: the first maximum, the first NaN, over whole blocks and a shorter last one.
    Few distinct values make ties across blocks common; some rows are all one value or all -inf."""
    x = _tied_rows(num_rows, vocab, levels, specials, seed)
    x[1, -1] = levels  # the maximum in the last (shorter) block
    # The blocked path, not the plain one, for the whole batch and for the chunk.
    assert (num_rows - 3) * vocab >= row_ops.ARGMAX_BLOCKED_MIN_ENTRIES
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[3:]), x[3:].argmax(dim=-1))  # a chunk of rows, as the sampler passes


@settings(max_examples=200, deadline=None)
@given(
    num_rows=st.integers(20, 40), vocab=st.integers(2048, 3000), k=st.integers(1, 64), levels=st.integers(1, 50),
    specials=st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf")]), max_size=6),
    seed=st.integers(0, 2**31),
)
def test_topk_rows_gives_torch_topk_values_with_ties_nans_and_infinities(num_rows, vocab, k, levels, specials, seed):
    """The CPU's blocked top-k (the k blocks of the largest maxima, then ``topk`` over their entries and
    those past the last whole block) gives the very values of ``torch.topk``, largest first, NaN first,
    each from a distinct entry that holds it. Few distinct values make ties across blocks common; the
    largest entries sit in the shorter tail now and then; some rows are all one value or all -inf."""
    x = _tied_rows(num_rows, vocab, levels, specials, seed)
    x[1, -k:] = levels  # the row's largest entries past its last whole block (for most widths)
    x[2] = 3.0
    # The blocked path, not the plain one: blocks of at least the smallest width fit.
    assert k * row_ops.TOPK_MIN_BLOCK * row_ops.TOPK_ROW_PER_CANDIDATE <= vocab
    assert (num_rows - 3) * vocab >= row_ops.ARGMAX_BLOCKED_MIN_ENTRIES  # the chunk's too
    for chunk in (x, x[3:]):  # the whole batch, and a chunk of rows as the sampler passes
        values, indices = topk_rows(chunk, k)
        torch.testing.assert_close(values, chunk.topk(k, dim=-1).values, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(chunk.gather(1, indices), values, rtol=0, atol=0, equal_nan=True)
        assert all(len(set(row)) == k for row in indices.tolist())  # k distinct entries per row


@pytest.mark.parametrize(("kinds", "kernel_backend"), [("plain greedy", "torch"), ("mixed", "torch"), ("mixed", "triton")])
def test_rows_whose_logits_are_not_finite_come_back_as_minus_one_and_leave_the_others_alone(kinds, kernel_backend):
    """A NaN logit, or +inf, in a row (a model's overflow) makes its id -1 on the host, whatever path the
    row takes (greedy argmax, penalties, the seeded races, the unseeded inverse CDF, logprobs; with the
    Triton backend, its kernels, the greedy rows beside the sampled ones); the device's ids stay valid
    token ids (a next step in flight may read them), and every other row samples exactly what it samples
    when no row is broken."""
    vocab = 3000 if kernel_backend == "torch" else 500  # Triton's interpreter is slow
    params = [SamplingParams(temperature=0.0)] if kinds == "plain greedy" else BATCH_KINDS
    num_rows = 2 * len(BATCH_KINDS)
    gen = torch.Generator().manual_seed(7)
    clean = torch.randn(num_rows, vocab, generator=gen) * 3
    broken = clean.clone()
    bad_rows = {1: float("nan"), 4: float("inf"), 9: float("nan"), 10: float("nan"), 12: float("inf")}
    for row, value in bad_rows.items():
        broken[row, 17 * row] = value
    results = {}
    for name, logits in (("clean", clean), ("broken", broken)):
        reqs = [_request(params[row % len(params)], prompt=(5, 6, 7), output=(8, 9)) for row in range(num_rows)]
        sampled = Sampler(eos_token_ids={0}, seed=3, kernel_backend=kernel_backend).sample(logits, reqs)
        assert int(sampled.token_ids.min()) > -1 and int(sampled.token_ids.max()) < vocab
        results[name] = sampled.result()
    got, want = results["broken"].token_ids, results["clean"].token_ids
    assert [row for row, token in enumerate(got) if token == -1] == sorted(bad_rows)
    assert all(got[row] == want[row] for row in range(num_rows) if row not in bad_rows)
    lp_rows = [row for row in range(num_rows) if row not in bad_rows and results["clean"].logprobs[row] is not None]
    assert all(results["broken"].logprobs[row] == results["clean"].logprobs[row] for row in lp_rows)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_whose_logits_turn_nan_fails_with_a_clear_error_and_the_batch_goes_on(engine_factory, async_scheduling):
    """The engine finishes the request whose logits were not finite with an error naming that, frees its
    blocks and keeps serving the others, whose tokens are those of a run without the fault."""
    prompts = {name: list(prompt_ids()[i]) for i, name in enumerate("abc")}
    params = {
        "a": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        "b": SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=10, ignore_eos=True),
        "c": SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True, logprobs=2),
    }
    runs = {}
    for faulty in (None, "b"):
        engine = engine_factory(async_scheduling=async_scheduling)
        sample = engine.sampler.sample

        def sample_with_a_fault(logits, requests, sample=sample, faulty=faulty):
            for row, req in enumerate(requests):
                if req.request_id == faulty and req.num_output_tokens - req.has_placeholder == 3:
                    logits = logits.clone()
                    logits[row, 100] = float("nan")
            return sample(logits, requests)

        engine.sampler.sample = sample_with_a_fault
        errors = {}
        results = {}
        for name in "abc":
            engine.add_request(name, prompts[name], params[name])
        while engine.has_unfinished_requests():
            for out in engine.step():
                results.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason == "error":
                    errors[out.request_id] = out.error
        runs[faulty] = (results, errors)
    (clean, clean_errors), (faulted, errors) = runs[None], runs["b"]
    assert clean_errors == {} and errors == {"b": "the model's logits for this request were not finite (NaN or infinity)"}
    assert faulted["b"] == clean["b"][:3]
    assert faulted["a"] == clean["a"] and faulted["c"] == clean["c"]


def test_unseeded_draws_of_the_race_kernel_change_from_step_to_step_and_follow_the_sampler_s_seed():
    """With the Triton backend an unseeded row's key comes from random draw indices the host picks each
    step: one request's draws over a flat distribution vary from step to step, and two samplers seeded
    alike draw the same sequence."""
    logits = torch.zeros(1, 8)

    def draws(seed: int) -> list[int]:
        sampler = Sampler(set(), seed=seed, kernel_backend="triton")
        req = _request(SamplingParams(temperature=1.0))
        tokens = []
        for _ in range(40):
            tokens.append(sampler(logits, [req]).token_ids[0])
            req.append_output_token(tokens[-1])
        return tokens

    first = draws(3)
    assert len(set(first)) >= 5, first  # 40 draws from 8 equal tokens
    assert draws(3) == first and draws(4) != first


def test_an_engine_on_the_triton_kernels_samples_mixed_parameters_as_on_the_torch_ones(tmp_path, engine_factory):
    """A tiny model's engine on the Triton backend (its interpreter here: the model's kernels and the
    sampler's, greedy rows among sampled ones, the logprob table) against the same engine on the torch
    backend, step after step: greedy and seeded outputs token for token, logprobs to float32's
    rounding."""
    from tests.engine import tiny_models

    folder = tiny_models.build_checkpoint(tiny_models.family_configs()["llama-bias"], tmp_path / "tiny")
    prompts = [tiny_models.prompt_token_ids(n, seed=n) for n in (5, 9, 7, 12)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.4, min_p=0.05, seed=4,
                       max_tokens=6, ignore_eos=True),
    ]
    runs = []
    for backend in ("torch", "triton"):
        engine = engine_factory(model=str(folder), block_size=8, num_blocks=64, kernel_backend=backend,
                                max_model_len=64)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", prompt, p)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        logprobs: dict[str, list[PositionLogprobs]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += out.logprobs or []
        runs.append((tokens, logprobs))
    (torch_tokens, torch_lps), (triton_tokens, triton_lps) = runs
    assert triton_tokens == torch_tokens and all(len(t) == 6 for t in torch_tokens.values())
    assert len(set(torch_tokens["r1"] + torch_tokens["r3"])) > 2, "the sampled rows never moved"
    for rid in ("r0", "r1"):
        assert len(triton_lps[rid]) == len(torch_lps[rid]) == 6
        for got, want in zip(triton_lps[rid], torch_lps[rid], strict=True):
            assert got.token_id == want.token_id and [t.token_id for t in got.top] == [t.token_id for t in want.top]
            assert [got.logprob, *(t.logprob for t in got.top)] == pytest.approx(
                [want.logprob, *(t.logprob for t in want.top)], abs=1e-4)
    assert triton_lps["r2"] == [] and triton_lps["r3"] == []


@pytest.mark.parametrize(("num_rows", "table_rows", "width", "dtype"),
                         [(3, 2, 5, torch.float64), (4, 0, 0, torch.float32), (1, 1, 41, torch.float32), (0, 0, 0, torch.float32)])
def test_step_outputs_are_views_of_one_buffer_each_aligned_and_apart(num_rows, table_rows, width, dtype):
    """The GPU path's ids, row maxima and logprob table in one buffer: each view has its own bytes (a
    write to one leaves the others), starts where its dtype aligns (a float64 table after an odd number
    of float32 maxima), and comes back from the host copy as written."""
    from common.engine.sampler import StepOutputs

    out = StepOutputs(num_rows, torch.device("cpu"), table_rows, width, dtype)
    assert out.ids.dtype == torch.int64 and out.ids.shape == (num_rows,)
    assert out.row_max.dtype == torch.float32 and out.row_max.shape == (num_rows,)
    assert (out.table is None) == (table_rows == 0)
    out.ids.copy_(torch.arange(num_rows) - 1)
    out.row_max.copy_(torch.arange(num_rows) * 0.5 - 7)
    if out.table is not None:
        assert out.table.dtype == dtype and out.table.shape == (table_rows, width)
        out.table.copy_(torch.arange(table_rows * width, dtype=dtype).view(table_rows, width) / 3)
    ids, row_max, table = out.to_host()
    assert ids.tolist() == [i - 1 for i in range(num_rows)]
    assert row_max.tolist() == [i * 0.5 - 7 for i in range(num_rows)]
    if table is not None:
        assert torch.equal(table, torch.arange(table_rows * width, dtype=dtype).view(table_rows, width) / 3)
