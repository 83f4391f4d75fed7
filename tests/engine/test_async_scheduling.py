"""Async scheduling (``EngineConfig.async_scheduling``) gives exactly what synchronous steps give.

With it, step N+1 is scheduled and its forward queued before step N's tokens reach the host; its
input ids for those tokens are read from N's sampled ids on the device. On the CPU nothing runs
concurrently, but every piece of the pipeline does: placeholders, the device-side gather of the
ids, rows of requests that finished in the step before (forwarded, not sampled), requests that sit a
step out, aborts and preemptions while a step is in flight. Each test runs the same requests both
ways and compares tokens, logprobs and finish reasons; ``engine_factory`` checks after each test
that every block is back and the pool is sound.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.engine.engine import EngineOutput, LLMEngine
from common.sampling_params import SamplingParams, StructuredOutput
from tests.engine.conftest import hf_greedy, prompt_ids

Run = dict[str, tuple[list[int], list[object], str | None]]


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
         abort_after: dict[str, int] | None = None) -> Run:
    """Every request's tokens, logprobs and finish reason; ``abort_after``: abort a request once that
    many of its tokens came out."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out: Run = {}
    abort_after = dict(abort_after or {})
    num_steps = 0
    while engine.has_unfinished_requests():
        num_steps += 1
        assert num_steps < 2000, "the engine stopped making progress"
        outputs: list[EngineOutput] = engine.step()
        for o in outputs:
            assert o.error is None, o.error
            tokens, logprobs, _ = out.setdefault(o.request_id, ([], [], None))
            tokens += o.new_token_ids
            logprobs += o.logprobs or []
            out[o.request_id] = (tokens, logprobs, o.finish_reason)
        for rid, count in list(abort_after.items()):
            if rid in out and len(out[rid][0]) >= count:
                assert engine.abort_request(rid)
                del abort_after[rid]
    return out


def _tokens(run: Run) -> dict[str, tuple[list[int], str | None]]:
    return {rid: (tokens, reason) for rid, (tokens, _, reason) in run.items()}


def _both(engine_factory, requests, **config) -> tuple[Run, Run]:  # type: ignore[no-untyped-def]
    sync = _run(engine_factory(**config), requests)
    engine = engine_factory(async_scheduling=True, **config)
    return sync, _run(engine, requests)


def test_greedy_equals_transformers_and_sync_while_requests_come_and_go(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """Four sequences at a time over 16 prompts of different output lengths: requests finish in the
    middle of the batch (their next row is forwarded for nothing) and waiting ones take their place."""
    prompts = [list(p) for p in prompt_ids()]
    requests = [
        (f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=8 + 5 * (i % 7), ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    sync, asyn = _both(engine_factory, requests, max_num_seqs=4)
    assert asyn == sync
    for rid, prompt, params in requests:
        assert tuple(asyn[rid][0]) == hf_greedy(tuple(prompt))[: params.max_tokens], rid
        assert asyn[rid][2] == "length"


def test_async_steps_leave_one_step_in_flight(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """The first step returns nothing (its tokens are on their way); each step after returns the
    tokens of the one before, and the last call returns the last tokens with nothing left running."""
    engine = engine_factory(async_scheduling=True)
    engine.add_request("a", list(prompt_ids()[0]), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []
    assert engine.has_unfinished_requests()
    counts = []
    while engine.has_unfinished_requests():
        counts.append([len(o.new_token_ids) for o in engine.step()])
    assert counts == [[1], [1], [1]]
    assert engine.scheduler.running == []


def test_stop_tokens_mixed_sampling_logprobs_and_seeds_match_sync(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """Stops the host only learns of after the next step was queued, and every part of the sampler
    that reads the tokens so far (penalties, min_tokens bans, seeded draws by output position, a
    grammar's mask) see the same tokens as in synchronous steps. Unseeded draws are left out: with
    async scheduling a waiting request may join a step later, which changes the batch a shared
    generator draws for."""
    prompts = [list(p) for p in prompt_ids()[:8]]
    reference = _run(engine_factory(), [("probe", prompts[0], SamplingParams(temperature=0.0, max_tokens=12))])
    stop_at = reference["probe"][0][6]  # a token greedy decoding reaches at its seventh step
    variants = [
        SamplingParams(temperature=0.0, stop_token_ids=[stop_at], max_tokens=24),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, logprobs=3, max_tokens=20),
        SamplingParams(temperature=0.7, top_k=40, repetition_penalty=1.3, seed=5, max_tokens=18),
        SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.4, seed=7, min_tokens=6,
                       max_tokens=16),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=14),
        SamplingParams(temperature=0.8, min_p=0.05, seed=3, n=3, max_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=40, structured_output=StructuredOutput(
            kind="choice", spec=json.dumps(["Paris", "London", "Rome"]))),
        SamplingParams(temperature=0.0, stop_token_ids=[stop_at], max_tokens=9),
    ]
    requests = [(f"m{i}", prompts[i % len(prompts)], p) for i, p in enumerate(variants)]
    sync, asyn = _both(engine_factory, requests, max_num_seqs=6)
    assert _tokens(asyn) == _tokens(sync)
    # Logprobs to float32 rounding: the forward's batches differ (a finished request's wasted row, a
    # waiting one joining a step later), and a matrix product's sums depend on the rows it holds.
    for rid, (_, logprobs, _) in sync.items():
        assert len(asyn[rid][1]) == len(logprobs), rid
        for a, s in zip(asyn[rid][1], logprobs, strict=True):
            assert a.token_id == s.token_id and [t.token_id for t in a.top] == [t.token_id for t in s.top]
            assert a.logprob == pytest.approx(s.logprob, abs=1e-4)
            assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in s.top], abs=1e-4)
    assert sync["m0"][2] == "stop" and sync["m0"][0][-1] == stop_at
    assert sync["m6"][2] == "stop"
    assert {f"m5#{i}" for i in (1, 2)} <= set(sync)


def test_preemption_while_a_step_is_in_flight_matches_sync(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """A pool too small for the batch: the scheduler preempts requests whose token is still on its
    way; they resume from it by recompute, and every output equals transformers."""
    prompts = [list(p) for p in prompt_ids()[:6]]
    requests = [(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
                for i, p in enumerate(prompts)]
    sync_engine = engine_factory(num_blocks=12, max_num_seqs=6)
    sync = _run(sync_engine, requests)
    async_engine = engine_factory(num_blocks=12, max_num_seqs=6, async_scheduling=True)
    asyn = _run(async_engine, requests)
    assert async_engine.scheduler.num_preemptions > 0
    assert asyn == sync
    for rid, prompt, _ in requests:
        assert tuple(asyn[rid][0]) == hf_greedy(tuple(prompt))[:40], rid


def test_abort_while_in_flight_drops_the_token_and_frees_the_blocks(engine_factory) -> None:  # type: ignore[no-untyped-def]
    prompts = [list(p) for p in prompt_ids()[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine = engine_factory(async_scheduling=True)
    out = _run(engine, [(f"a{i}", p, params) for i, p in enumerate(prompts)], abort_after={"a1": 5})
    # Aborted with a step in flight whose token was never sent; the others ran on untouched.
    assert out["a1"][2] == "abort"
    assert 5 <= len(out["a1"][0]) < 30
    assert out["a1"][0] == list(hf_greedy(tuple(prompts[1]))[: len(out["a1"][0])])
    for i in (0, 2):
        assert tuple(out[f"a{i}"][0]) == hf_greedy(tuple(prompts[i]))[:30]


def test_a_block_filled_by_a_token_in_flight_is_cached(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """A decode token that fills a block is known on the host only after the next step was queued;
    the block is still cached under its hash, so a later request extending that output hits it."""
    prompt = list(prompt_ids()[0])
    hits = []
    for async_scheduling in (False, True):
        engine = engine_factory(async_scheduling=async_scheduling)
        first = _run(engine, [("first", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))])
        follow = prompt + first["first"][0][:36]
        engine.add_request("second", follow, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        hits.append(engine.kv.prefix_cache_hits)
    assert hits[0] == hits[1] >= (len(prompt) + 32) // 16 * 16


def test_async_scheduling_is_an_engine_flag_of_every_service() -> None:
    import argparse

    from common.service import add_service_args
    from decode_svc.service import DecodeService
    from prefill_svc.service import PrefillService

    def args(role: str, *flags: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_service_args(parser, role)
        return parser.parse_args(list(flags))

    assert not DecodeService.engine_config(args("decode")).async_scheduling
    assert DecodeService.engine_config(args("decode", "--async-scheduling")).async_scheduling
    assert PrefillService.engine_config(args("prefill", "--async-scheduling")).async_scheduling


class _EchoModel:
    """A model without weights whose logits depend on nothing but the input token and its position: a
    fixed random row per (token, position) pair, most of the mass on ids below 64 (stop tokens and EOS
    come up often). A request's outputs are then a function of its own history, whatever shares its
    batches, so async and synchronous steps must give exactly the same tokens and logprobs however the
    batches differ."""

    num_rows = 4093

    def __init__(self, vocab: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(1)
        self.table = torch.randn(self.num_rows, vocab, generator=gen)
        self.table[:, :64] += 5.0

    def __call__(self, input_ids, positions, meta, kv_cache):  # type: ignore[no-untyped-def]
        placeholders = int((input_ids < 0).sum())  # the runner must have read their tokens on the device
        assert placeholders == 0, f"{placeholders} placeholder ids reached the model"
        return ((input_ids * 7919 + positions * 104729) % self.num_rows).unsqueeze(1)

    def compute_logits(self, hidden):  # type: ignore[no-untyped-def]
        return self.table[hidden[:, 0]]


def _echo_engine(async_scheduling: bool, num_blocks: int) -> LLMEngine:
    from unittest import mock

    import torch

    import common.engine.engine as engine_module
    from common.config import EngineConfig
    from ops.bench.overhead import NullModelRunner, PhaseClock

    config = EngineConfig(num_blocks=num_blocks, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                          async_scheduling=async_scheduling, seed=0)
    runner = NullModelRunner(config, torch.empty(0), PhaseClock())
    runner.model = _EchoModel(runner.vocab_size)  # type: ignore[assignment]
    runner.kv_cache = torch.zeros(1, 2, num_blocks, 8, 1, 1)  # what copy-on-write copies (n > 1)
    with mock.patch.object(engine_module, "ModelRunner", lambda _config: runner):
        return LLMEngine(config)


def _random_workload(seed: int) -> list[tuple[int, str, list[int], SamplingParams, bool, int | None]]:
    """(arrival step, id, prompt, params, prefill only, abort at step) for 30 requests."""
    import random

    rng = random.Random(seed)
    work = []
    for i in range(30):
        sampled = rng.random() < 0.5
        params = SamplingParams(
            temperature=0.8 if sampled else 0.0, seed=rng.randrange(1000) if sampled else None,
            top_p=rng.choice([1.0, 0.9]), max_tokens=(max_tokens := rng.randint(1, 24)),
            stop_token_ids=rng.sample(range(64), 2), ignore_eos=rng.random() < 0.5,
            min_tokens=min(max_tokens, rng.choice([0, 0, 3])), logprobs=rng.choice([None, None, 2]),
            repetition_penalty=rng.choice([1.0, 1.0, 1.2]), presence_penalty=rng.choice([0.0, 0.5]),
            n=2 if sampled and rng.random() < 0.3 else 1,
        )
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 40))]
        prefill_only = params.n == 1 and rng.random() < 0.15
        abort_at = rng.randint(1, 30) if rng.random() < 0.25 else None
        work.append((rng.randint(0, 20), f"w{i}", prompt, params, prefill_only, abort_at))
    return work


def _run_workload(engine: LLMEngine, work) -> tuple[Run, set[str]]:  # type: ignore[no-untyped-def]
    """Every request's tokens, logprobs and finish reason; a prefill-only request's KV is released two
    steps after its hand-off. Returns the ids aborted."""
    out: Run = {}
    releases: dict[int, list[str]] = {}
    aborted: set[str] = set()
    step = 0
    while step <= 31 or engine.has_unfinished_requests() or releases:
        for at, rid, prompt, params, prefill_only, abort_at in work:
            if at == step:
                engine.add_request(rid, prompt, params, kv_transfer=prefill_only)
            if abort_at == step and engine.abort_request(rid):
                aborted.add(rid)
        for rid in releases.pop(step, []):
            assert engine.release_kv(rid)
        for o in engine.step():
            assert o.error is None, o.error
            tokens, logprobs, _ = out.setdefault(o.request_id, ([], [], None))
            tokens += o.new_token_ids
            logprobs += o.logprobs or []
            out[o.request_id] = (tokens, logprobs, o.finish_reason)
            if o.kv_handoff is not None:
                releases.setdefault(step + 2, []).append(o.request_id)
        step += 1
        assert step < 3000, "the engine stopped making progress"
    engine.check_integrity()
    assert engine.num_blocks_in_use == 0 and not engine.scheduler.requests
    return out, aborted


@pytest.mark.parametrize("seed", range(10))
def test_random_workloads_give_what_synchronous_steps_give(seed: int) -> None:
    """Random arrivals, lengths, stop tokens, EOS, sampling with seeds and penalties, logprobs, n = 2,
    prefill-only requests held for a transfer and released, aborts, and a pool small enough to preempt,
    on a model whose outputs depend on each request's own history only: every request that was not
    aborted gets the same tokens, logprobs and finish reason both ways; an aborted one's output is a
    prefix of the other mode's. No placeholder reaches the model, and every block comes back."""
    work = _random_workload(seed)
    sync, sync_aborted = _run_workload(_echo_engine(False, num_blocks=20), work)
    asyn_engine = _echo_engine(True, num_blocks=20)
    asyn, asyn_aborted = _run_workload(asyn_engine, work)
    aborted = {rid for rid in sync_aborted | asyn_aborted}
    aborted |= {f"{rid}#1" for rid in aborted}
    # An aborted n = 2 request may not have forked yet in one mode: its second choice never shows.
    assert set(sync) - aborted == set(asyn) - aborted
    for rid in set(sync) & set(asyn):
        if rid.split("#")[0] in aborted:
            shorter, longer = sorted((sync[rid][0], asyn[rid][0]), key=len)
            assert longer[: len(shorter)] == shorter, rid
        else:
            assert asyn[rid] == sync[rid], rid
    reasons = {reason for _, _, reason in sync.values()}
    assert {"stop", "length"} <= reasons  # the workload reaches both ends


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_kv_handoff_is_ready_after_the_step_that_wrote_it_not_the_one_queued_since(
    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """On a GPU a transfer's gathers wait for ``KVHandoff.ready``: the event of the step that sampled
    the request (its forward wrote the KV). With async scheduling the hand-off is built while the
    next step is already queued; an event recorded then (as the sender records by default) would make
    the gathers wait for that step too. Each step's event is a marker here (the CPU records none)."""
    from common.engine.sampler import SampledTokens

    steps: list[SampledTokens] = []
    original_init = SampledTokens.__init__

    def init(self: SampledTokens, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        steps.append(self)

    monkeypatch.setattr(SampledTokens, "__init__", init)
    monkeypatch.setattr(SampledTokens, "event", property(lambda self: ("event of step", steps.index(self))))
    engine = _echo_engine(async_scheduling, num_blocks=40)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("decoding", [5, 6, 7], params)
    for _ in range(3):
        engine.step()
    engine.add_request("prefill-only", [9] * 20, params, kv_transfer=True)
    handoffs = []
    while not handoffs:
        sampled_before = len(steps)
        handoffs = [(o.kv_handoff, sampled_before) for o in engine.step() if o.kv_handoff is not None]
        assert len(steps) < 50
    [(handoff, sampled_before)] = handoffs
    # The step that sampled it: the last one before this call (async: this call queued another since).
    assert handoff.ready == ("event of step", sampled_before - 1 if async_scheduling else sampled_before)
    assert len(steps) == sampled_before + 1
    assert engine.release_kv("prefill-only")


def test_the_prefill_service_hands_the_sender_the_handoff_s_ready_event() -> None:
    """``PrefillService._send_kv`` passes ``KVHandoff.ready`` on as the gathers' ``after`` (the sender
    records one of its own only when it gets none)."""
    from types import SimpleNamespace

    from common.engine.engine import EngineOutput, KVHandoff
    from common.protocol import DecodeTarget, GenerateRequest
    from prefill_svc.service import PrefillService

    sent: list[dict[str, Any]] = []
    service = SimpleNamespace(sender=SimpleNamespace(send=lambda *args, **kwargs: sent.append(kwargs)))
    msg = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(),
                          reply_to="tcp://127.0.0.1:1", decode_target=DecodeTarget(instance_id="d", kv_address="tcp://127.0.0.1:2"))
    marker = object()
    handoff = KVHandoff(block_ids=[4], block_hashes=[], num_tokens=3, ready=marker)
    PrefillService._send_kv(service, msg, EngineOutput("r", [7]), handoff)  # type: ignore[arg-type]
    assert [kwargs["after"] for kwargs in sent] == [marker]
