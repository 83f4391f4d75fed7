"""The prefix cache's host tier (vLLM's ``--kv-offloading-size``) through real engines on the default model.

A prompt's cached blocks, taken back by the KV cache for other prompts, are copied to host memory first; the same
prompt later finds them there, loads them into new blocks, and answers as it did: its blocks' bytes equal the ones
it first computed, and its tokens too. The same engine without a host tier computes the prompt again. A decode
taking blocks for a KV transfer saves what they held before the transfer writes them.
"""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids
from tests.engine.test_disaggregated_lifecycle import _prefill, hand_over

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
NUM_BLOCKS = 24  # a few prompts' worth: the ones after the first take its blocks back
OFFLOAD_GIB = 0.05  # some 70 blocks of the default model in float32


def _run(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """``prompt`` alone, greedy: its tokens and the prompt tokens it found cached."""
    engine.add_request(request_id, prompt, GREEDY)
    tokens: list[int] = []
    cached = -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
    return tokens, cached


def _others() -> list[list[int]]:
    """Prompts sharing no block with prompt 12 or with each other, enough to fill the pool three times over."""
    base = list(prompt_ids()[6])
    return [[1000 + k, *base, *base] for k in range(8)]


def cached_kv(engine: LLMEngine, prompt: list[int], num_blocks: int | None = None) -> torch.Tensor:
    """The KV of ``prompt``'s first ``num_blocks`` full blocks (all by default) as the device cache holds them under
    their hashes, every rank's share (the transfer cache: the KV cache itself for one rank)."""
    from common.engine.request import Request

    req = Request("probe", prompt, GREEDY, block_size=engine.block_size, model_id=engine.model_id)
    ids = []
    for block_hash in req.block_hashes[:num_blocks]:
        block = engine.kv.pool.get_cached_block(block_hash)
        assert block is not None, "a block of the prompt is not on the device"
        ids.append(block.block_id)
    cache = engine.runner.transfer_cache
    assert cache is not None
    return cache[:, :, ids].clone()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prompt_whose_blocks_the_cache_took_back_loads_them_from_the_host_tier(engine_factory, async_scheduling):
    prompt = list(prompt_ids()[12])
    num_full = (len(prompt) - 1) // 16
    assert num_full >= 6
    engine = engine_factory(num_blocks=NUM_BLOCKS, kv_offloading_size=OFFLOAD_GIB, async_scheduling=async_scheduling)
    assert engine.kv.host is not None and engine.kv.host.num_slots > 2 * NUM_BLOCKS
    first, cached = _run(engine, "a", prompt)
    assert cached == 0
    computed = cached_kv(engine, prompt, num_full)
    for k, other in enumerate(_others()):
        _run(engine, f"o{k}", other)
    hashes = engine.kv.pool.cached
    from common.engine.request import Request

    probe = Request("probe", prompt, GREEDY, block_size=16, model_id=engine.model_id)
    assert not any(h in hashes for h in probe.block_hashes[:num_full]), "the prompt's blocks are still on the device"
    assert all(h in engine.kv.host for h in probe.block_hashes[:num_full])
    # The prefix index still lists them: the engine answers them from host memory.
    assert set(probe.block_hashes[:num_full]) <= set(engine.cached_block_hashes())
    loaded = engine.kv.host.num_loaded

    again, cached = _run(engine, "a2", prompt)
    assert cached == num_full * 16
    assert engine.kv.host.num_loaded - loaded == num_full
    assert torch.equal(cached_kv(engine, prompt, num_full), computed), "the loaded KV is not what was computed"
    assert again == first
    stats = engine.stats().extra
    assert stats["kv_offload_loaded_blocks"] == engine.kv.host.num_loaded > 0
    assert stats["kv_offload_saved_blocks"] >= num_full


def test_without_a_host_tier_the_same_prompt_is_computed_again(engine_factory):
    """The baseline of the test above: the blocks the cache took back are gone."""
    prompt = list(prompt_ids()[12])
    engine = engine_factory(num_blocks=NUM_BLOCKS)
    assert engine.kv.host is None
    first, _ = _run(engine, "a", prompt)
    for k, other in enumerate(_others()):
        _run(engine, f"o{k}", other)
    again, cached = _run(engine, "a2", prompt)
    assert cached == 0 and again == first


def test_a_decode_saves_the_blocks_a_transfer_takes_before_the_transfer_writes_them(engine_factory):
    """The decode's pool holds only the cached blocks of a prompt it ran; a request from a prefill takes them all
    for its KV. They reach the host tier before the hand-over overwrites them, so the prompt run again finds its
    own KV there (``LLMEngine._copy_host_now``), not the transfer's."""
    mine = list(prompt_ids()[12])
    theirs = _others()[0][: len(mine)]
    decode = engine_factory(num_blocks=(len(mine) + GREEDY.max_tokens + 15) // 16, kv_offloading_size=OFFLOAD_GIB)
    prefill = engine_factory(num_blocks=64)
    first, _ = _run(decode, "mine", mine)
    num_full = (len(mine) - 1) // 16
    computed = cached_kv(decode, mine, num_full)

    out = _prefill(prefill, theirs, GREEDY)
    handoff = decode.add_remote_request("r", list(theirs), out.new_token_ids[0], GREEDY)
    assert handoff is not None and handoff.num_cached_blocks == 0
    hand_over(prefill, decode, out, handoff)
    while decode.has_unfinished_requests():
        decode.step()

    again, cached = _run(decode, "mine2", mine)
    assert cached == num_full * 16
    assert torch.equal(cached_kv(decode, mine, num_full), computed), "the host tier kept the transfer's KV"
    assert again == first


def test_copies_of_a_step_whose_requests_all_left_it_are_done_all_the_same(engine_factory, monkeypatch):
    """A step whose requests all leave it before the forward (an image that fails to encode fails its request
    there) still runs the host tier's copies its scheduling queued: the blocks it loaded stay cached under their
    hashes, and the next prompt that finds them reads the KV that was computed."""
    from common.engine.request import RequestStatus

    prompt = list(prompt_ids()[12])
    num_full = (len(prompt) - 1) // 16
    engine = engine_factory(num_blocks=NUM_BLOCKS, kv_offloading_size=OFFLOAD_GIB)
    first, _ = _run(engine, "a", prompt)
    computed = cached_kv(engine, prompt, num_full)
    for k, other in enumerate(_others()):
        _run(engine, f"o{k}", other)
    schedule = engine.scheduler.schedule

    def leave(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = schedule(*args, **kwargs)
        for s in out.scheduled:
            engine.scheduler.finish(s.request, RequestStatus.FINISHED_ERROR)
        out.scheduled = []
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", leave)
    engine.add_request("left", prompt, GREEDY)
    engine.step()
    assert not engine.has_unfinished_requests()
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    assert torch.equal(cached_kv(engine, prompt, num_full), computed), "a load queued for the step was dropped"
    again, cached = _run(engine, "a2", prompt)
    assert cached == num_full * 16 and again == first


def test_the_prefix_index_hears_of_a_block_only_once_both_tiers_gave_it_up(engine_factory):
    prompt = list(prompt_ids()[12])
    engine = engine_factory(num_blocks=NUM_BLOCKS, kv_offloading_size=OFFLOAD_GIB)
    _run(engine, "a", prompt)
    stored, removed = engine.drain_prefix_events()
    assert stored and not removed
    for k, other in enumerate(_others()):
        _run(engine, f"o{k}", other)
    _, removed = engine.drain_prefix_events()
    assert not removed, "blocks the host tier holds were reported gone"
    assert engine.kv.reset_prefix_cache()
    _, removed = engine.drain_prefix_events()
    assert set(stored) <= set(removed) and not engine.cached_block_hashes()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"kv_offloading_size": 1.0, "enable_prefix_caching": False}, "needs prefix caching"),
    ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, "'lmcache' is not implemented"),
    ({"kv_offloading_size": -1.0}, "kv_offloading_size must be"),
    ({"kv_offloading_size": float("nan")}, "kv_offloading_size must be"),
])
def test_offloading_settings_it_does_not_implement_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


def test_a_host_tier_too_small_for_one_block_is_refused_naming_a_block_s_bytes(engine_factory):
    with pytest.raises(ValueError, match=r"holds no KV block: one takes 737280 bytes"):
        engine_factory(num_blocks=8, kv_offloading_size=1e-6)


def test_a_host_tier_larger_than_the_host_s_available_memory_is_refused(engine_factory, monkeypatch):
    import common.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner, "available_host_memory", lambda: 10 << 20)
    with pytest.raises(ValueError, match=r"exceed the 0.01 GiB of memory the host has available"):
        engine_factory(num_blocks=8, kv_offloading_size=0.05)
