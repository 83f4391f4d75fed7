"""Bad requests fail alone, at once, with an error naming the field; the engine keeps serving.

Every way a request can end (rejected, aborted while running, aborted with n > 1) leaves the pool
with all its blocks free.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from common.engine.engine import EngineOutput, LLMEngine
from common.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from tests.engine.conftest import hf_greedy, prompt_ids

GOOD = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
VOCAB = 49152
MAX_MODEL_LEN = 256

# (case id, prompt, params, a word the error message must contain)
BAD_REQUESTS = [
    ("empty prompt", [], GOOD, "prompt"),
    ("prompt longer than max_model_len", [5] * (MAX_MODEL_LEN + 10), GOOD, "max_model_len"),
    ("prompt leaves no room to generate", [5] * MAX_MODEL_LEN, GOOD, "max_model_len"),
    ("token id = vocab size", [5, VOCAB, 6], GOOD, "token ids"),
    ("negative token id", [5, -1], GOOD, "token ids"),
    ("non-integer token id", [5, 2.5], GOOD, "token ids"),
    ("integral float token id", [5.0, 6], GOOD, "token ids"),
    ("string token id", [5, "7"], GOOD, "token ids"),
    ("None token id", [None], GOOD, "token ids"),
    ("numpy token id", [5, np.int64(6)], GOOD, "token ids"),
    ("huge token id", [5, 2**70], GOOD, "token ids"),
    ("bool token id", [5, True], GOOD, "token ids"),
    ("max_tokens=0", [5], SamplingParams(max_tokens=0), "max_tokens"),
    ("max_tokens<0", [5], SamplingParams(max_tokens=-3), "max_tokens"),
    ("temperature<0", [5], SamplingParams(temperature=-0.1), "temperature"),
    ("temperature=nan", [5], SamplingParams(temperature=float("nan")), "temperature"),
    ("top_p=0", [5], SamplingParams(top_p=0.0), "top_p"),
    ("top_p=1.5", [5], SamplingParams(top_p=1.5), "top_p"),
    ("n above limit", [5], SamplingParams(n=MAX_N + 1), "n must"),
    ("n=0", [5], SamplingParams(n=0), "n must"),
    ("logprobs>20", [5], SamplingParams(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    ("min_tokens>max_tokens", [5], SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
    ("top_k<-1", [5], SamplingParams(top_k=-2), "top_k"),
    ("stop token outside vocab", [5], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ("presence_penalty>2", [5], SamplingParams(presence_penalty=2.5), "presence_penalty"),
    ("repetition_penalty=0", [5], SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
]


@pytest.fixture(scope="module")
def small_engine():  # type: ignore[no-untyped-def]
    """One engine for the validation-only cases (nothing runs on it), checked when the module ends."""
    from tests.engine.conftest import make_engine

    engine = make_engine(max_model_len=MAX_MODEL_LEN, num_blocks=32)
    yield engine
    engine.check_integrity()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def _drain(engine: LLMEngine, outputs: list[EngineOutput] | None = None) -> dict[str, tuple[list[int], str | None]]:
    """Step until every request finished: (token ids, finish_reason) per request, ``outputs`` first."""
    outputs = list(outputs or [])
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    results: dict[str, tuple[list[int], str | None]] = {}
    for out in outputs:
        tokens, _ = results.get(out.request_id, ([], None))
        results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    return results


@pytest.mark.parametrize(("prompt", "params", "field"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_rejected_with_a_message_naming_the_field(small_engine, prompt, params, field):
    assert small_engine.vocab_size == VOCAB and small_engine.max_model_len == MAX_MODEL_LEN
    with pytest.raises(ValueError, match=field):
        small_engine.validate(prompt, params)
    with pytest.raises(ValueError, match=field):
        small_engine.add_request("bad", prompt, params)
    assert not small_engine.scheduler.requests and not small_engine.has_unfinished_requests(), "a bad request was queued"


@pytest.mark.parametrize("outputs", [[5, VOCAB], [-2], [5, 1.0], [True]], ids=["= vocab", "negative", "float", "bool"])
def test_a_resumed_request_s_output_token_ids_are_checked_as_its_prompt_s(small_engine, outputs):
    with pytest.raises(ValueError, match="output token ids"):
        small_engine.validate([5, 6], GOOD, outputs)
    small_engine.validate([5, 6], GOOD, [0, VOCAB - 1])  # the range's ends are valid


def test_engine_keeps_serving_a_valid_request_queued_before_the_bad_ones(engine_factory):
    engine = engine_factory(max_model_len=MAX_MODEL_LEN)
    prompt = list(prompt_ids()[3])
    engine.add_request("good", prompt, GOOD)
    first = engine.step()  # already running when the bad ones arrive
    for i, (_, bad_prompt, params, field) in enumerate(BAD_REQUESTS):
        with pytest.raises(ValueError, match=field):
            engine.add_request(f"bad-{i}", bad_prompt, params)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("good", prompt, GOOD)
    assert list(engine.scheduler.requests) == ["good"]
    engine.add_request("after", list(prompt_ids()[0]), GOOD)
    results = _drain(engine, first)
    assert set(results) == {"good", "after"}
    assert results["good"][0] == list(hf_greedy(tuple(prompt), 16)) and results["good"][1] == "length"
    assert results["after"][0] == list(hf_greedy(prompt_ids()[0], 16))


def test_a_request_that_could_never_fit_in_the_pool_fails_at_once(engine_factory):
    engine = engine_factory(num_blocks=4, block_size=16)  # 64 slots
    prompt = list(prompt_ids()[12][:50])
    with pytest.raises(ValueError, match="KV blocks") as err:
        engine.add_request("huge", prompt, SamplingParams(temperature=0.0, max_tokens=150))
    assert "max_tokens" in str(err.value)
    assert not engine.has_unfinished_requests()
    # Exactly the pool's size still fits, and runs.
    small = list(prompt_ids()[0])
    engine.add_request("fits", small, SamplingParams(temperature=0.0, max_tokens=64 - len(small), ignore_eos=True))
    assert _drain(engine)["fits"][0] == list(hf_greedy(tuple(small), 64 - len(small)))


def test_n2_in_a_pool_that_holds_one_choice_at_a_time_still_finishes(engine_factory):
    engine = engine_factory(num_blocks=4, block_size=16, max_num_batched_tokens=64)
    prompt = list(prompt_ids()[9])  # 13 tokens; each choice needs all 4 blocks at its longest
    params = SamplingParams(temperature=0.0, max_tokens=64 - len(prompt), ignore_eos=True, n=2)
    engine.add_request("r", prompt, params)
    results = _drain(engine)
    expected = list(hf_greedy(tuple(prompt), 64 - len(prompt)))
    assert results["r"][0] == results["r#1"][0] == expected
    assert engine.scheduler.num_preemptions > 0


def _step_until(engine: LLMEngine, done: Callable[[], bool], max_steps: int = 200) -> list[EngineOutput]:
    """Step until ``done()``; the outputs on the way."""
    outputs: list[EngineOutput] = []
    for _ in range(max_steps):
        if done():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError("condition never reached")


def test_abort_of_a_running_request_frees_its_blocks(engine_factory):
    engine = engine_factory()
    prompt = list(prompt_ids()[12])
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    _step_until(engine, lambda: "r" in engine.kv.req_blocks and engine.scheduler.requests["r"].num_output_tokens >= 3)
    assert engine.kv.pool.num_used_blocks >= len(prompt) // 16
    assert engine.abort_request("r")
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    engine.check_integrity()
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("r", "abort")]
    assert not engine.has_unfinished_requests()
    assert not engine.abort_request("r"), "a second abort finds nothing"
    # The engine keeps serving, and the aborted request's cached prefix does not change the output.
    engine.add_request("next", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert _drain(engine)["next"][0] == list(hf_greedy(tuple(prompt), 8))


def test_abort_of_an_n2_request_frees_both_choices(engine_factory):
    """After the fork each choice is aborted on its own (the router ends choices one by one, e.g.
    at a stop string): aborting one leaves the other running, aborting both frees everything."""
    engine = engine_factory()
    prompt = list(prompt_ids()[6])
    engine.add_request("r", prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, n=2))
    engine.add_request("other", list(prompt_ids()[1]), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    before = _step_until(
        engine, lambda: "r#1" in engine.kv.req_blocks and engine.scheduler.requests["r#1"].num_output_tokens >= 3
    )
    assert engine.abort_request("r")
    assert set(engine.kv.req_blocks) == {"r#1", "other"}
    engine.check_integrity()
    assert engine.abort_request("r#1")
    assert set(engine.kv.req_blocks) == {"other"}
    engine.check_integrity()
    results = _drain(engine, before)
    assert results["r"][1] == results["r#1"][1] == "abort"
    assert len(results["r#1"][0]) >= 3
    assert results["other"][0] == list(hf_greedy(prompt_ids()[1], 30))
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_a_model_whose_logits_turn_nan_fails_that_request_alone_and_its_blocks_serve_the_next(tmp_path):
    """A checkpoint whose embedding of one token is NaN (an overflow, as a real model's fp16 might
    give): a request holding that token fails with an error saying its logits were not finite; its
    blocks are zeroed and forgotten by the prefix cache before they go back, so the request beside it,
    which takes one of them as it grows (the torch attention reads a block's slots past the sequence's
    length, weighted 0, and 0 times NaN is NaN), and a request after it get transformers' tokens."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    from common.config import EngineConfig
    from common.engine.engine import NOT_FINITE_ERROR
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint, prompt_token_ids
    from tests.engine.tiny_models import hf_greedy as tiny_greedy

    folder = build_checkpoint(LlamaConfig(**TINY_DIMS, tie_word_embeddings=False), tmp_path / "llama")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"][77] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    clean = [t for t in prompt_token_ids(21, seed=3) if t != 77]
    poisoned = [t if i != 9 else 77 for i, t in enumerate(prompt_token_ids(21, seed=4))]
    # One pool block size short of holding both: the next request takes the poisoned one's blocks.
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", block_size=8,
                                    num_blocks=8, max_num_batched_tokens=64))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs: dict[str, list[EngineOutput]] = {}

    def run() -> None:
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)

    engine.add_request("poisoned", poisoned, params)
    engine.add_request("clean", clean, params)
    while "poisoned" not in outputs:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    # Its KV held NaN from token 9 on (without the scrub, the clean request reads them below and fails).
    assert not torch.isnan(engine.runner.kv_cache).any(), "the failed request's blocks were meant to be zeroed"
    cached = [block.block_id for block in engine.kv.pool.cached.values()]
    assert cached and all(engine.runner.kv_cache[:, :, block_id].any() for block_id in cached), (
        "a zeroed block stayed in the prefix cache"
    )
    run()
    assert [o.finish_reason for o in outputs["poisoned"]] == ["error"]
    assert outputs["poisoned"][0].error == NOT_FINITE_ERROR and outputs["poisoned"][0].new_token_ids == []
    assert [t for o in outputs["clean"] for t in o.new_token_ids] == tiny_greedy(folder, clean, 8)
    after = prompt_token_ids(19, seed=5)
    after = [t for t in after if t != 77]
    engine.add_request("after", after, params)
    run()
    assert [t for o in outputs["after"] for t in o.new_token_ids] == tiny_greedy(folder, after, 8)
    engine.check_integrity()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_async_a_request_aborted_while_its_nan_step_is_in_flight_leaves_no_nan_to_the_next_holder(tmp_path):
    """Async scheduling: the request whose step turns its KV to NaN is aborted before that step's tokens
    reach the host, so its blocks go back to the pool unscrubbed. When the step resolves, its token says
    the logits were not finite: the blocks it held and nobody took since are zeroed and forgotten by the
    prefix cache. The request beside it, which takes its last block as it grows (the torch attention
    reads that block's slots past its length, weighted 0, and 0 times NaN is NaN), gets transformers'
    tokens rather than an error."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    from common.config import EngineConfig
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint, prompt_token_ids
    from tests.engine.tiny_models import hf_greedy as tiny_greedy

    folder = build_checkpoint(LlamaConfig(**TINY_DIMS, tie_word_embeddings=False), tmp_path / "llama")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"][77] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    poisoned = [t if i != 9 else 77 for i, t in enumerate(prompt_token_ids(21, seed=4))]
    clean = [t for t in prompt_token_ids(20, seed=3) if t != 77][:14]
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", block_size=8,
                                    num_blocks=8, max_num_batched_tokens=64, async_scheduling=True))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs: dict[str, list[EngineOutput]] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)

    engine.add_request("clean", clean, params)
    step()  # the clean prefill, positions 0-13, in flight
    engine.add_request("poisoned", poisoned, params)
    step()  # the poisoned prefill (its KV NaN from position 9 on: 3 blocks) and the clean position 14
    poisoned_blocks = engine.kv.block_ids("poisoned")
    assert len(poisoned_blocks) == 3 and "poisoned" not in outputs
    assert engine.abort_request("poisoned")
    assert "poisoned" not in engine.kv.req_blocks, "the abort was meant to free its blocks at once"
    step()  # resolves the poisoned step; the clean position 15 in its second block
    assert [o.finish_reason for o in outputs["poisoned"]] == ["abort"]
    assert not torch.isnan(engine.runner.kv_cache).any(), "the aborted request's free blocks were meant to be zeroed"
    cached = [block.block_id for block in engine.kv.pool.cached.values()]
    assert all(engine.runner.kv_cache[:, :, block_id].any() for block_id in cached), "a zeroed block stayed cached"
    while engine.has_unfinished_requests():
        step()
    # Position 16 opened a third block: the poisoned request's last one, which NaN filled up to slot 4.
    assert engine.kv.num_cow_copies == 0
    assert [o.error for o in outputs["clean"]] == [None] * len(outputs["clean"])
    assert [t for o in outputs["clean"] for t in o.new_token_ids] == tiny_greedy(folder, clean, 6)
    engine.check_integrity()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_eos_ids_outside_the_vocabulary_are_ignored_so_min_tokens_bans_stay_in_range(tmp_path, caplog):
    """A checkpoint whose config lists an EOS id past its vocabulary (such an id can never be sampled):
    the engine names and ignores it, and a request with ``min_tokens`` (whose ban indexes the logits
    by every EOS id) gets its tokens instead of an index error, or on a GPU a device-side assert."""
    from transformers import LlamaConfig

    from common.config import EngineConfig
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint, prompt_token_ids

    config = LlamaConfig(**TINY_DIMS)
    config.eos_token_id = [2, config.vocab_size + 5]
    folder = build_checkpoint(config, tmp_path / "llama")
    with caplog.at_level("WARNING"):
        engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", num_blocks=16))
    assert engine.eos_token_ids == {2}
    assert f"[{config.vocab_size + 5}]" in caplog.text and "outside its vocabulary" in caplog.text
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=4, min_tokens=3)
    engine.add_request("r", prompt_token_ids(9, seed=1), params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            tokens += out.new_token_ids
    assert len(tokens) >= 3
