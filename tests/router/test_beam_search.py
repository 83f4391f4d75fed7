"""The beam search's steps against vLLM's search written out, over a made-up model of many shapes.

``run_search`` ends early once no live beam can catch up; the reference runs every step. Their answers
must be the same beams in the same order, whatever the width, length penalty and stop tokens."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections.abc import Callable

import pytest

from common.protocol import PositionLogprobs, TokenLogprob
from common.sampling_params import SamplingParams
from router.beam_search import Beam, BeamSearch, can_stop_early, run_search

VOCAB = 9
STOP = 0


def _logprobs(context: tuple[int, ...], seed: int, stop_bias: float) -> list[float]:
    """A made-up model: log-softmax of logits drawn from a hash of the context; the stop token's raised
    by ``stop_bias`` (so beams of many lengths end)."""
    digest = hashlib.sha256(repr((seed, context)).encode()).digest()
    logits = [digest[i] / 32.0 for i in range(VOCAB)]
    logits[STOP] += stop_bias
    top = max(logits)
    total = math.log(sum(math.exp(x - top) for x in logits)) + top
    return [x - total for x in logits]


def _oracle(prompt: tuple[int, ...], seed: int, stop_bias: float):  # type: ignore[no-untyped-def]
    async def next_positions(live: list[Beam], step: int) -> list[PositionLogprobs]:
        out = []
        for beam in live:
            lps = _logprobs((*prompt, *beam.token_ids), seed, stop_bias)
            order = sorted(range(VOCAB), key=lambda t: -lps[t])
            out.append(PositionLogprobs(order[0], lps[order[0]], [TokenLogprob(t, lps[t]) for t in order]))
        return out

    return next_positions


def vllm_beam_search(
    alternatives: Callable[[list[int]], list[tuple[int, float]]], num_prompt_tokens: int, width: int, max_tokens: int,
    length_penalty: float, stop_ids: frozenset[int],
) -> list[tuple[list[int], float, bool]]:
    """vLLM's loop, every step run: ``alternatives(tokens after the prompt)`` gives the next tokens and their
    logprobs, most likely first, of which a beam takes ``2 * width``; a stop token ends its beam. The ``width``
    best as (tokens, cumulative logprob, ended on a stop token), best first."""
    def key(beam: tuple[list[int], float, bool]) -> float:
        tokens, cum, stopped = beam
        return cum / ((num_prompt_tokens + len(tokens) - int(stopped)) ** length_penalty)

    live: list[tuple[list[int], float, bool]] = [([], 0.0, False)]
    completed: list[tuple[list[int], float, bool]] = []
    for _ in range(max_tokens):
        going = []
        for tokens, cum, _ in live:
            for t, lp in alternatives(tokens)[: 2 * width]:
                (completed if t in stop_ids else going).append(([*tokens, t], cum + lp, t in stop_ids))
        live = sorted(going, key=key, reverse=True)[:width]
    return sorted(completed + live, key=key, reverse=True)[:width]


def _reference(prompt: tuple[int, ...], seed: int, stop_bias: float, width: int, max_tokens: int,
               length_penalty: float) -> list[list[int]]:
    def alternatives(tokens: list[int]) -> list[tuple[int, float]]:
        lps = _logprobs((*prompt, *tokens), seed, stop_bias)
        return [(t, lps[t]) for t in sorted(range(VOCAB), key=lambda t: -lps[t])]

    beams = vllm_beam_search(alternatives, len(prompt), width, max_tokens, length_penalty, frozenset([STOP]))
    return [tokens for tokens, _, _ in beams]


def test_the_search_equals_vllm_s_over_many_shapes_and_ends_early_in_some() -> None:
    rng = random.Random(7)
    ended_early = 0
    for case in range(400):
        prompt = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6)))
        width = rng.randint(1, 4)
        max_tokens = rng.randint(1, 9)
        length_penalty = rng.choice([-2.0, 0.0, 0.5, 1.0, 2.0, 10.0])
        stop_bias = rng.choice([0.0, 2.0, 5.0])
        params = SamplingParams(n=width, max_tokens=max_tokens, stop_token_ids=[STOP], temperature=0.0)
        beams, steps = asyncio.run(run_search(_oracle(prompt, case, stop_bias), len(prompt), params,
                                              BeamSearch(length_penalty)))
        want = _reference(prompt, case, stop_bias, width, max_tokens, length_penalty)
        assert [b.token_ids for b in beams] == want, (case, prompt, width, max_tokens, length_penalty)
        assert all(b.stopped == (b.token_ids[-1] == STOP) for b in beams)
        ended_early += steps < max_tokens
    assert ended_early >= 40, f"only {ended_early} of 400 searches ended early: the test would not see a bad bound"


@pytest.mark.parametrize("length_penalty", [-1.0, 0.0, 1.0, 4.0])
def test_no_early_end_while_a_live_beam_could_still_win(length_penalty: float) -> None:
    """The bound at each end of the lengths a live beam can reach: a completed beam just below what the
    live one would score at its best length keeps the search going."""
    prompt_len, max_tokens = 4, 6
    completed = [Beam([1, STOP], cum_logprob=-3.0, stopped=True)]
    live = Beam([2, 3], cum_logprob=-2.0)
    # The live beam's best: as it is (one token longer at most once a stop follows), or at the longest.
    best_length = max(prompt_len + 2, prompt_len + max_tokens, key=lambda n: n**length_penalty)
    best_score = -2.0 / best_length**length_penalty
    completed[0].cum_logprob = best_score * (prompt_len + 1) ** length_penalty * 1.0001  # just below it
    assert not can_stop_early(completed, [live], 1, prompt_len, max_tokens, length_penalty, 0.0)
    completed[0].cum_logprob = best_score * (prompt_len + 1) ** length_penalty * 0.9999  # just above it
    assert can_stop_early(completed, [live], 1, prompt_len, max_tokens, length_penalty, 0.0)
    # An engine's logprob rounded above 0 lifts the ceiling: no early end on it.
    assert not can_stop_early(completed, [live], 1, prompt_len, max_tokens, length_penalty, 1.0)
