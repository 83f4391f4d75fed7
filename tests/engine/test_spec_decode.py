"""Speculative decoding with n-gram drafts: greedy output equals transformers' (and the engine's without
drafts) whatever cuts the drafts short (token budget, block boundaries, preemption, stops, max_tokens),
blocks kept by accepted drafts are cached under the right hashes, the companions that do not draft are
unchanged, and the flag refuses what is not built."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client import generate_latest

from common.config import EngineConfig, SpeculativeConfig
from common.engine.engine import EngineStats
from common.engine.request import Request
from common.engine.spec_decode import NgramProposer
from common.metrics import EngineMetrics
from common.sampling_params import SamplingParams
from tests.engine.conftest import MAX_NEW_TOKENS, drain_tokens, hf_greedy, prompt_ids

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def _proposer(k: int = 3, low: int = 2, high: int = 4, max_model_len: int = 1000) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, low, high), max_model_len)


def _lookup(tokens: list[int], **kw: int) -> list[int]:
    k = kw.pop("k", 3)
    return _proposer(k, **kw).lookup(np.array(tokens, dtype=np.int64), k)


def test_lookup_takes_the_latest_occurrence_of_the_longest_suffix() -> None:
    # Suffix [7, 8, 9]: once after 1 (followed by 20 21 22) and, longer ([6, 7, 8, 9]), after 6.
    tokens = [6, 7, 8, 9, 10, 11, 12, 5, 7, 8, 9, 20, 21, 22, 6, 7, 8, 9]
    assert _lookup(tokens) == [10, 11, 12]
    # Equal lengths: the latest occurrence.
    tokens = [1, 2, 3, 4, 5, 1, 2, 30, 40, 1, 2]
    assert _lookup(tokens) == [30, 40, 1]
    # Fewer tokens follow than k: as many as there are (a periodic tail drafts its own continuation).
    assert _lookup([3, 4, 3, 4], k=5) == [3, 4]
    # No suffix of at least prompt_lookup_min tokens recurs: no draft.
    assert _lookup([1, 2, 3, 9, 2, 3, 1, 3], low=2) == []
    assert _lookup([1, 2, 3, 1], low=2) == []
    assert _lookup([1, 2, 3, 1], low=1) == [2, 3, 1]
    assert _lookup([5]) == []
    # The longest match is capped at prompt_lookup_max, then the latest of those wins.
    tokens = [1, 2, 3, 4, 50, 9, 3, 4, 60, 1, 2, 3, 4]
    assert _lookup(tokens, high=2) == [60, 1, 2]
    assert _lookup(tokens, high=4) == [50, 9, 3]


def _brute_force(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    for size in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[len(tokens) - size :]
        for start in range(len(tokens) - size - 1, -1, -1):  # the latest occurrence before the suffix's own
            if tokens[start : start + size] == suffix:
                return tokens[start + size : start + size + k]
    return []


@pytest.mark.parametrize("few", [0, 8, 10**9], ids=["numpy", "mixed", "python"])
def test_lookup_equals_a_brute_force_search_on_either_path(monkeypatch, few) -> None:
    """Candidates are matched in Python when few, with numpy when many: both give the brute force's."""
    import random

    import common.engine.spec_decode as spec_decode

    monkeypatch.setattr(spec_decode, "_FEW", few)
    rng = random.Random(few % 1000)
    for _ in range(400):
        vocab, length = rng.choice([2, 3, 5, 20]), rng.randrange(1, 60)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        low = rng.randrange(1, 4)
        high, k = rng.randrange(low, 6), rng.randrange(1, 6)
        assert _lookup(tokens, k=k, low=low, high=high) == _brute_force(tokens, k, low, high), (tokens, k, low, high)


def _request(params: SamplingParams, prompt: list[int], output: list[int] | None = None) -> Request:
    req = Request("r", prompt, params, block_size=16, model_id="m", output_token_ids=output)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def test_only_decoding_plain_greedy_requests_draft_and_never_past_their_budget() -> None:
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    proposer = _proposer(k=4, max_model_len=40)
    req = _request(SamplingParams(temperature=0.0, max_tokens=20), prompt)
    proposer.propose([req])
    assert req.spec_token_ids == [3, 4, 1, 2]
    # Two output tokens left: the step surely gives one, so one draft at most.
    req = _request(SamplingParams(temperature=0.0, max_tokens=4), prompt, [3, 4])
    assert proposer.num_drafts(req) == 1
    # The positions left: 40 - 12 tokens, the last of them the step's own.
    req = _request(SamplingParams(temperature=0.0, max_tokens=100), prompt, [3] * 28)
    assert proposer.num_drafts(req) == 1
    # A prompt being prefilled does not draft; nor does a request whose sampling reads its output.
    req = _request(SamplingParams(temperature=0.0, max_tokens=20), prompt)
    req.num_computed_tokens = 4
    assert proposer.num_drafts(req) == 0
    for params in (
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, max_tokens=20, presence_penalty=0.5),
        SamplingParams(temperature=0.7, max_tokens=20, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=20, bad_words_token_ids=[[7]]),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=3),
    ):
        req = _request(params, prompt)
        req.spec_token_ids = [9]  # stale drafts of an earlier step are cleared
        proposer.propose([req])
        assert req.spec_token_ids == [], params
    # Sampled, seeded, with logprobs, biased, or past its min_tokens: it drafts.
    for params in (
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20), SamplingParams(temperature=0.7, seed=3, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2), SamplingParams(temperature=0.0, max_tokens=20,
                                                                                   logit_bias={5: 2.0}),
    ):
        req = _request(params, prompt)
        proposer.propose([req])
        assert req.spec_token_ids == [3, 4, 1, 2], params
    req = _request(SamplingParams(temperature=0.0, max_tokens=20, min_tokens=3), prompt, [3, 4, 1])
    assert proposer.num_drafts(req) == 4
    # The mirrored tokens follow the request as it grows.
    req = _request(SamplingParams(temperature=0.0, max_tokens=20), [5, 6, 7])
    proposer.propose([req])
    assert req.spec_token_ids == []
    for token in (5, 6):
        req.append_output_token(token)
    req.num_computed_tokens = req.num_tokens - 1
    proposer.propose([req])
    assert req.spec_token_ids == [7, 5, 6]


def _run(engine, prompts, params=GREEDY):  # type: ignore[no-untyped-def]
    return [choices[0] for choices in engine.generate([list(p) for p in prompts], params)]


# Budget 12 with every prompt running cuts drafts short (and some decodes have none); 64 and 32-token
# blocks, drafts that cross block boundaries; 512, every draft.
@pytest.mark.parametrize(("budget", "block_size"), [(12, 16), (64, 32), (512, 16)])
def test_greedy_with_drafts_equals_transformers(engine_factory, budget, block_size):
    engine = engine_factory(block_size=block_size, max_num_batched_tokens=budget, num_blocks=8192 // block_size,
                            speculative_config=NGRAM)
    got = _run(engine, prompt_ids())
    assert got == [list(hf_greedy(p)) for p in prompt_ids()]
    # Drafts were checked, some kept and some not: the test exercised both ends of the check.
    assert engine.spec_num_drafts > 0
    assert 0 < engine.spec_num_accepted_tokens < engine.spec_num_draft_tokens
    # Kept drafts lead a step's drafts: each position keeps no more than the one before it.
    per_pos = engine.spec_accepted_per_pos
    assert sum(per_pos) == engine.spec_num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    assert engine.stats().extra["spec_decode_num_accepted_tokens_per_pos:0"] == per_pos[0] > 0


def test_drafts_under_preemption_keep_greedy_output(engine_factory):
    engine = engine_factory(block_size=16, num_blocks=24, max_num_batched_tokens=64, speculative_config=NGRAM)
    prompts = [p for p in prompt_ids() if len(p) < 60][:8]
    got = _run(engine, prompts)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert engine.spec_num_accepted_tokens > 0
    assert got == [list(hf_greedy(p)) for p in prompts]


def test_blocks_filled_by_accepted_drafts_are_cached_under_their_tokens(engine_factory):
    """A prompt that is an earlier request's prompt and output hits the blocks that request filled (most
    through kept drafts), and its greedy output is transformers' for that prompt: a block cached under
    a rejected draft's hash would change it."""
    engine = engine_factory(block_size=16, max_num_batched_tokens=512, speculative_config=NGRAM)
    prompt = list(prompt_ids()[12])  # repetitive: most of its output comes through kept drafts
    (first,) = _run(engine, [prompt])
    assert engine.spec_num_accepted_tokens > len(first) // 2
    extended = prompt + first
    hits_before = engine.kv.prefix_cache_hits
    (second,) = _run(engine, [extended], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert engine.kv.prefix_cache_hits - hits_before >= (len(extended) - 1) // 16 * 16 - 16
    assert second == list(hf_greedy(tuple(extended), 16))


def test_a_stop_token_or_max_tokens_inside_the_drafts_ends_the_output_there(engine_factory):
    engine = engine_factory(speculative_config=NGRAM)
    prompt = list(prompt_ids()[6])  # "The quick brown fox..." six times: its output repeats it
    expected = list(hf_greedy(tuple(prompt)))
    stop = expected[20]
    cut = expected[: expected.index(stop) + 1]
    params = {
        "stop": SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, stop_token_ids=[stop]),
        "length": SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
    }
    for name, p in params.items():
        engine.add_request(name, prompt, p)
    tokens, reasons = drain_tokens(engine)
    assert engine.spec_num_accepted_tokens > 0
    assert tokens["stop"] == cut and reasons["stop"] == "stop"
    assert tokens["length"] == expected[:23] and reasons["length"] == "length"


def _outputs(engine, work):  # type: ignore[no-untyped-def]
    """Each request's tokens and logprobs (token, logprob, top ids), by id, run together."""
    for name, (prompt, p) in work.items():
        engine.add_request(name, list(prompt), p)
    got: dict[str, list[tuple[int, float | None, list[int]]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            lps = out.logprobs or [None] * len(out.new_token_ids)
            got.setdefault(out.request_id, []).extend(
                (t, None if lp is None else lp.logprob, [] if lp is None else [a.token_id for a in lp.top])
                for t, lp in zip(out.new_token_ids, lps, strict=True)
            )
    return got


def test_seeded_sampled_requests_give_the_same_tokens_and_logprobs_with_drafts(engine_factory):
    """A seeded row's draw is a function of its seed, its position and its probabilities: with drafts it
    samples the tokens it samples a step at a time, top-p, top-k, min-p, n > 1 and logprobs too; the
    requests whose sampling reads their output (penalties) decode beside them unchanged."""
    prompts = prompt_ids()
    work = {
        "greedy": (prompts[6], GREEDY),
        "seeded": (prompts[12], SamplingParams(temperature=0.3, top_p=0.9, seed=5, max_tokens=32, ignore_eos=True)),
        "top-k-logprobs": (prompts[6], SamplingParams(temperature=0.5, top_k=20, seed=11, max_tokens=32, logprobs=2,
                                                      ignore_eos=True)),
        "min-p-n2": (prompts[15], SamplingParams(temperature=0.4, min_p=0.05, seed=7, max_tokens=24, n=2,
                                                 ignore_eos=True)),
        "penalty": (prompts[9], SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3,
                                               ignore_eos=True)),
    }
    without = _outputs(engine_factory(), work)
    engine = engine_factory(speculative_config=NGRAM)
    with_drafts = _outputs(engine, work)
    assert engine.spec_num_accepted_tokens > 0
    assert set(with_drafts) == {"greedy", "seeded", "top-k-logprobs", "min-p-n2", "min-p-n2#1", "penalty"}
    for name, tokens in without.items():
        assert [t for t, _, _ in with_drafts[name]] == [t for t, _, _ in tokens], name
        for (_, lp, top), (_, want_lp, want_top) in zip(with_drafts[name], tokens, strict=True):
            assert top == want_top and (lp is None) == (want_lp is None), name
            assert lp is None or lp == pytest.approx(want_lp, abs=1e-4), name


def test_an_unseeded_sampled_request_drafts_and_keeps_some(engine_factory):
    """Drafts of a sampled request are kept where its row samples them: at a low temperature over a
    repetitive prompt, often."""
    engine = engine_factory(speculative_config=NGRAM)
    params = SamplingParams(temperature=0.2, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    (got,) = _run(engine, [prompt_ids()[6]], params)
    assert len(got) == MAX_NEW_TOKENS
    assert engine.spec_num_accepted_tokens >= MAX_NEW_TOKENS // 4


def test_a_draft_whose_kv_is_not_finite_is_recomputed_without_drafts(tmp_path, monkeypatch):
    """A checkpoint whose embedding of one token is NaN, and a draft of that token (forced: a draft is a
    token of the request's own, whose KV was finite where it stood before). The torch attention weighs
    the slots a row may not see by 0, and 0 times NaN is NaN: every row of the step turns NaN, the
    request's own last token's too. Its blocks are scrubbed and it is recomputed without drafts: it
    gets transformers' tokens, where failing it would have failed a request that never asked for the
    draft, and no NaN is left in the cache."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    from common.engine.engine import LLMEngine
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint, prompt_token_ids
    from tests.engine.tiny_models import hf_greedy as tiny_greedy

    folder = build_checkpoint(LlamaConfig(**TINY_DIMS, tie_word_embeddings=False), tmp_path / "llama")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"][77] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompt = [t for t in prompt_token_ids(21, seed=3) if t != 77]
    expected = tiny_greedy(folder, prompt, 8)
    assert expected[1] != 77
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", block_size=8, num_blocks=8,
                                    max_num_batched_tokens=64, speculative_config=NGRAM))
    forced: list[list[int]] = []

    def lookup(tokens: np.ndarray, k: int) -> list[int]:
        # The first decode step's drafts: the NaN token, then one that attends to it. It would propose them
        # again: the request must draft no more (else it would be recomputed for ever).
        assert not forced, "the request drafted again after its drafts broke its step"
        forced.append([77, int(tokens[0])])
        return forced[0]

    monkeypatch.setattr(engine.proposer, "lookup", lookup)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokens, reasons = drain_tokens(engine)
    assert forced and engine.spec_num_draft_tokens == 2 and engine.spec_num_accepted_tokens == 0
    assert engine.scheduler.num_preemptions == 1  # the recompute
    assert tokens["r"] == expected and reasons["r"] == "length"
    assert not torch.isnan(engine.runner.kv_cache).any()
    engine.check_integrity()


def test_no_drafts_while_the_batch_holds_disable_by_batch_size_requests(engine_factory):
    """vLLM's ``disable_by_batch_size``: three requests running, none drafts; once one is left (the others
    asked for fewer tokens), it drafts. The outputs are transformers' either way."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2, "disable_by_batch_size": 2})
    engine = engine_factory(speculative_config=spec)
    prompts = prompt_ids()
    work = {"long": (prompts[6], 40), "short-a": (prompts[12], 8), "short-b": (prompts[1], 8)}
    for name, (prompt, max_tokens) in work.items():
        engine.add_request(name, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    drafted_with: list[int] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        before = engine.spec_num_drafts
        running = len(engine.scheduler.running)
        for out in engine.step():
            assert out.error is None
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if engine.spec_num_drafts > before:
            drafted_with.append(running)
    assert drafted_with and max(drafted_with) == 1
    assert engine.spec_num_accepted_tokens > 0
    assert tokens == {name: list(hf_greedy(prompt, n)) for name, (prompt, n) in work.items()}


def test_drafts_through_the_triton_kernels_give_transformers_tokens(tmp_path, engine_factory):
    """A GPU's path, through Triton's interpreter: the prefill attention over each decode's last token and
    its drafts, the rows at every draft, the sampler's; a repeating prompt, so the first decode drafts."""
    from tests.engine import tiny_models

    folder = tiny_models.build_checkpoint(tiny_models.family_configs()["llama-bias"], tmp_path / "tiny")
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5]
    engine = engine_factory(model=str(folder), block_size=8, num_blocks=64, kernel_backend="triton",
                            max_model_len=64, speculative_config=NGRAM)
    got = [c[0] for c in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    assert engine.spec_num_draft_tokens > 0
    assert got == [tiny_models.hf_greedy(folder, p, 12) for p in prompts]


def test_speculative_config_refusals() -> None:
    def refused(config: object, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=config if isinstance(config, str) else json.dumps(config))

    refused({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not implemented")
    refused({"num_speculative_tokens": 3}, "needs \"method\": \"ngram\"")
    refused({"method": "ngram"}, "needs num_speculative_tokens")
    refused({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "model not implemented")
    refused({"method": "ngram", "num_speculative_tokens": 0}, "positive integer")
    refused({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "positive integer")
    refused({"method": "ngram", "num_speculative_tokens": 17}, "exceeds 16")
    refused({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "prompt_lookup_min 5 exceeds prompt_lookup_max 3")
    refused("{not json", "JSON object")
    with pytest.raises(ValueError, match="with --async-scheduling is not implemented"):
        EngineConfig(speculative_config=NGRAM, async_scheduling=True)
    # One bound given, the other takes it; neither, both 5 (vLLM's).
    assert EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4}').speculative == SpeculativeConfig("ngram", 3, 4, 4)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig("ngram", 3)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": None,
                                    "prompt_lookup_max": 2}) == SpeculativeConfig("ngram", 3, 2, 2)


def test_spec_decode_counters_are_exported_only_by_an_engine_that_drafts() -> None:
    metrics = EngineMetrics("decode", "decode-0", "m")
    metrics.update(EngineStats(1, 0, 0.5, 100, 50, 0, 0, 0))
    assert "pdserve:spec_decode_num_drafts_total{" not in generate_latest(metrics.registry).decode()
    for drafts, tokens, accepted in ((3, 12, 5), (7, 28, 11)):
        metrics.update(EngineStats(1, 0, 0.5, 100, 50, 0, 0, 0, extra={
            "spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
            "spec_decode_num_accepted_tokens": accepted, "spec_decode_num_accepted_tokens_per_pos:0": drafts - 1,
            "spec_decode_num_accepted_tokens_per_pos:1": accepted - drafts + 1}))
    text = generate_latest(metrics.registry).decode()
    labels = '{instance="decode-0",model_name="m",role="decode"}'
    assert f"pdserve:spec_decode_num_drafts_total{labels} 7.0" in text
    assert f"pdserve:spec_decode_num_draft_tokens_total{labels} 28.0" in text
    assert f"pdserve:spec_decode_num_accepted_tokens_total{labels} 11.0" in text
    at = 'pdserve:spec_decode_num_accepted_tokens_per_pos_total{instance="decode-0",model_name="m",position="%d",role="decode"}'
    assert f"{at % 0} 6.0" in text and f"{at % 1} 5.0" in text
