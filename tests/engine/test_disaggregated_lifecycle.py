"""The disaggregated request lifecycle inside two engines, the KV copied by hand in between.

Prefill: the request samples its first token, is *held for transfer* (blocks kept, out of the
batch) and hands off its blocks; one ``release_kv`` frees them. Decode: the request *waits for
remote KV* in blocks allocated before the data; ``remote_kv_arrived`` puts it in the batch,
``release_kv`` (a failed transfer) frees them. Output equals one engine doing everything.
"""

from __future__ import annotations

import pytest
import torch

from common.engine.request import RequestStatus
from common.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids


def _drain(engine) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def _prefill(prefill, prompt, params, output_token_ids=None):  # type: ignore[no-untyped-def]
    prefill.add_request("r", list(prompt), params, kv_transfer=True, output_token_ids=output_token_ids)
    while True:
        outs = prefill.step()
        if outs:
            [out] = outs
            assert out.kv_handoff is not None and out.finish_reason is None
            return out


def hand_over(prefill, decode, out, handoff, request_id: str = "r") -> None:  # type: ignore[no-untyped-def]
    """The KV of the prefill's ``out`` into the decode's ``handoff`` blocks, as the transfer layer moves them
    (gathered on one side, scattered on the other), the prefill side released and the decode told it arrived."""
    assert [bytes(h) for h in handoff.block_hashes] == [bytes(h) for h in out.kv_handoff.block_hashes]
    src, dst = torch.tensor(out.kv_handoff.block_ids), torch.tensor(handoff.block_ids)
    decode.runner.kernels.scatter_blocks(decode.runner.kv_cache, dst,
                                         prefill.runner.kernels.gather_blocks(prefill.runner.kv_cache, src))
    assert prefill.release_kv(request_id)
    decode.remote_kv_arrived(request_id)


def _transfer(prefill, decode, prompt, params, output_token_ids=None):  # type: ignore[no-untyped-def]
    """Prefill, hand the KV to ``decode`` by copying the blocks, and release the prefill side."""
    out = _prefill(prefill, prompt, params, output_token_ids)
    assert prefill.scheduler.requests["r"].status == RequestStatus.HELD_FOR_TRANSFER
    assert prefill.num_held_for_transfer == 1 and not prefill.has_unfinished_requests()
    handoff = decode.add_remote_request(
        "r", list(prompt), out.new_token_ids[0], params, output_token_ids=output_token_ids
    )
    assert handoff is not None and handoff.num_tokens == out.kv_handoff.num_tokens
    assert [bytes(h) for h in handoff.block_hashes] == [bytes(h) for h in out.kv_handoff.block_hashes]
    assert decode.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    # As the transfer layer moves them: gathered on one side, scattered on the other (any cache dtype), all but
    # the leading blocks the decode skips (its prefix hits, or those out of a window).
    skip = handoff.num_cached_blocks
    assert skip >= out.kv_handoff.num_released_blocks, "the decode asks for blocks the prefill gave back"
    src, dst = torch.tensor(out.kv_handoff.block_ids[skip:]), torch.tensor(handoff.block_ids[skip:])
    decode.runner.kernels.scatter_blocks(decode.runner.kv_cache, dst,
                                         prefill.runner.kernels.gather_blocks(prefill.runner.kv_cache, src))
    assert prefill.release_kv("r") and not prefill.release_kv("r")
    return out.new_token_ids[0]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
     SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=20, ignore_eos=True)],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("resumed", [0, 5], ids=["fresh", "continued"])
def test_prefill_hand_off_then_decode_equals_one_engine(engine_factory, params, resumed):  # type: ignore[no-untyped-def]
    prompt = prompt_ids()[6]  # several blocks long
    single = engine_factory()
    single.add_request("r", list(prompt), params)
    expected = _drain(single)["r"]

    prefill, decode = engine_factory(), engine_factory()
    earlier = expected[:resumed] or None
    first = _transfer(prefill, decode, prompt, params, earlier)
    decode.remote_kv_arrived("r")
    rest = _drain(decode)["r"]
    assert expected[:resumed] + [first] + rest == expected


def test_a_failed_transfer_frees_both_sides_and_abort_leaves_transfer_blocks_alone(engine_factory):  # type: ignore[no-untyped-def]
    prefill, decode = engine_factory(), engine_factory()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = prompt_ids()[6]
    out = _prefill(prefill, prompt, params)
    handoff = decode.add_remote_request("r", list(prompt), out.new_token_ids[0], params)
    assert handoff is not None
    # An abort while a transfer holds the blocks must not free them: the transfer may write them.
    assert not prefill.abort_request("r") and not decode.abort_request("r")
    assert prefill.kv.pool.num_used_blocks > 0 and decode.kv.pool.num_used_blocks > 0
    with pytest.raises(ValueError, match="duplicate"):
        decode.add_remote_request("r", list(prompt), out.new_token_ids[0], params)
    assert decode.release_kv("r") and prefill.release_kv("r")
    assert "r" not in decode.scheduler.requests and "r" not in prefill.scheduler.requests
    # engine_factory checks every block came back and the pools are sound.


def test_remote_request_reuses_cached_blocks_and_defers_when_the_pool_is_full(engine_factory):  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = list(prompt_ids()[12])  # many blocks
    decode = engine_factory(num_blocks=40)
    decode.add_request("warm", prompt, params)  # caches the prompt's full blocks
    _drain(decode)
    handoff = decode.add_remote_request("r", prompt, 11, params)
    assert handoff is not None
    assert handoff.num_cached_blocks == len(handoff.block_hashes) > 0  # every full block was cached
    assert decode.scheduler.requests["r"].num_computed_tokens == handoff.num_cached_blocks * decode.block_size
    # A second request that cannot get blocks now holds nothing and may be offered again later.
    before = decode.kv.pool.num_used_blocks
    assert decode.add_remote_request("s", [7] * 600, 11, params) is None
    assert decode.kv.pool.num_used_blocks == before and "s" not in decode.scheduler.requests
    assert decode.release_kv("r")


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3),
     SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=12, ignore_eos=True, n=3)],
    ids=["greedy", "seeded"],
)
def test_n_choices_transfer_once_and_fork_on_decode_equal_one_engine(engine_factory, params):  # type: ignore[no-untyped-def]
    """n > 1 disaggregated: the prefill samples every choice's first token and sends the prompt's
    KV once; the decode forks the choices from it (shared blocks) and each choice equals the one
    engine's fork, seeded choices included."""
    prompt = prompt_ids()[6]
    single = engine_factory()
    single.add_request("r", list(prompt), params)
    expected = _drain(single)
    assert set(expected) == {"r", "r#1", "r#2"}

    prefill, decode = engine_factory(), engine_factory()
    prefill.add_request("r", list(prompt), params, kv_transfer=True)
    firsts: dict[str, int] = {}
    handoff_out = None
    while not firsts:
        for out in prefill.step():
            assert out.finish_reason is None and len(out.new_token_ids) == 1
            firsts[out.request_id] = out.new_token_ids[0]
            if out.kv_handoff is not None:
                handoff_out = out
    assert set(firsts) == {"r", "r#1", "r#2"} and handoff_out is not None
    choice_tokens = handoff_out.kv_handoff.choice_token_ids
    assert choice_tokens == [firsts["r"], firsts["r#1"], firsts["r#2"]]
    assert prefill.num_held_for_transfer == 1 and not prefill.has_unfinished_requests()

    handoff = decode.add_remote_request("r", list(prompt), firsts["r"], params, choice_token_ids=choice_tokens)
    assert handoff is not None
    decode.runner.kv_cache[:, :, handoff.block_ids] = prefill.runner.kv_cache[:, :, handoff_out.kv_handoff.block_ids]
    assert prefill.release_kv("r")
    prompt_blocks = len(handoff.block_ids)
    decode.remote_kv_arrived("r")
    # The three choices share the prompt's blocks: at most one copied (partial) block each.
    assert decode.num_blocks_in_use <= prompt_blocks + 2
    rest = _drain(decode)
    for choice_id in ("r", "r#1", "r#2"):
        assert [firsts[choice_id], *rest[choice_id]] == expected[choice_id], choice_id
    assert decode.num_blocks_in_use == 0 and prefill.num_blocks_in_use == 0
    decode.check_integrity()


def test_a_choice_aborted_while_its_kv_lands_never_forks_and_first_token_stops_apply(engine_factory):  # type: ignore[no-untyped-def]
    prompt = prompt_ids()[6]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3, stop_token_ids=[7])
    decode = engine_factory()
    handoff = decode.add_remote_request("r", list(prompt), 5, params, choice_token_ids=[5, 7, 9])
    assert handoff is not None
    assert decode.abort_request("r#2")
    assert decode.kv_still_wanted("r")
    decode.remote_kv_arrived("r")
    outs = _drain(decode)
    assert "r#2" not in outs
    assert outs["r#1"] == []  # its first token (7) is a stop token: finished with nothing new
    assert len(outs["r"]) == 5
    assert decode.num_blocks_in_use == 0
    with pytest.raises(ValueError, match="first token of each"):
        decode.add_remote_request("q", list(prompt), 5, params, choice_token_ids=[5, 6])
