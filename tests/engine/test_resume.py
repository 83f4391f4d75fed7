"""A request continued after its instance was lost (``output_token_ids``) ends as the uninterrupted run.

This is what the router's migration relies on: the new instance recomputes prompt + earlier output
and goes on, with ``max_tokens``, ``min_tokens``, penalties and a seed's draws counting the earlier
tokens, so the continuation is token for token the rest of the original output.
"""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids


def _run(engine, prompt, params, output_token_ids=None):  # type: ignore[no-untyped-def]
    engine.add_request("r", list(prompt), params, output_token_ids=output_token_ids)
    tokens: list[int] = []
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
    return tokens, reason


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True),
    ],
    ids=["greedy", "greedy-penalties", "seeded-sampled"],
)
@pytest.mark.parametrize("cut", [1, 7, 17])
def test_continuing_after_k_tokens_gives_the_rest_of_the_uninterrupted_output(engine_factory, params, cut):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    prompt = prompt_ids()[0]
    full, reason = _run(engine, prompt, params)
    assert len(full) == 24 and reason == "length"
    rest, reason = _run(engine, prompt, params, output_token_ids=full[:cut])
    assert full[:cut] + rest == full
    assert reason == "length"


def test_min_tokens_counts_the_earlier_output(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    prompt = list(prompt_ids()[1])
    full, _ = _run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    third = full[2]
    # With two earlier tokens, min_tokens=3 still bans the stop token the model wants next ...
    held, _ = _run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, ignore_eos=True,
                                                  stop_token_ids=[third]), output_token_ids=full[:2])
    assert held[0] != third
    # ... and min_tokens=2 is already met by them, so that token stops the request at once.
    stopped, reason = _run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2,
                                                          ignore_eos=True, stop_token_ids=[third]),
                           output_token_ids=full[:2])
    assert stopped == [third] and reason == "stop"


def test_a_continued_request_that_already_reached_max_tokens_is_refused(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("r", list(prompt_ids()[0]), SamplingParams(max_tokens=2), output_token_ids=[5, 6])
    with pytest.raises(ValueError, match="output token ids"):
        engine.add_request("r", list(prompt_ids()[0]), SamplingParams(max_tokens=9), output_token_ids=[-1])
