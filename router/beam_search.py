"""Beam search (vLLM's ``use_beam_search``), run by the router over the engines' log-probabilities.

The search runs as vLLM's OpenAI server runs it, one token at a time: each step sends every live beam
to the engines as a prompt of its own (the request's prompt and the beam's tokens) for one greedy token
with its ``2 * width`` most likely alternatives (``max(2 * width, logprobs)`` when the request asks
for more), from the model's raw log-probabilities. Each alternative extends its beam by its
log-probability. An alternative that is one of the request's stop tokens (end of sequence unless
``ignore_eos``, and ``stop_token_ids``) completes its beam; the ``width`` best of the others, by
``cumulative logprob / length ** length_penalty`` (the length counts the prompt, not a stop token),
go on. After ``max_tokens`` steps the live beams join the completed ones, and the ``width`` best of
all are the choices, best first. The engines' prefix caches hold each beam's earlier blocks, so a
step computes little more than a beam's last block.

One departure from vLLM, which changes no answer: the search ends before ``max_tokens`` once
``width`` completed beams each score above the best that any continuation of a live beam could
reach (its log-probability can only fall; its length lies between its own and the longest allowed),
so a chat without ``max_tokens`` does not run to the end of the context.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from common.protocol import PositionLogprobs, PromptLogprob, RequestOutput
from common.sampling_params import SamplingParams
from router.admission import CLIENT_KEY
from router.choice_stream import ChoiceDelta, ChoiceStream
from router.dispatcher import EngineRequestError

if TYPE_CHECKING:
    from router.serving import DisconnectWaiter, GenerationPlan
    from router.state import RouterState

T = TypeVar("T")


@dataclass(frozen=True)
class BeamSearch:
    """What a request asks of its search beside its ``SamplingParams`` (``n`` is the width)."""

    length_penalty: float = 1.0


@dataclass
class Beam:
    """A hypothesis: the tokens after the prompt, each one's logprobs, and their sum."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    stopped: bool = False  # ended on a stop token (the last of ``token_ids``)

    def length(self, num_prompt_tokens: int) -> int:
        """Its length as the score counts it: the prompt's tokens and its own, less a stop token."""
        return num_prompt_tokens + len(self.token_ids) - int(self.stopped)


def score(beam: Beam, num_prompt_tokens: int, length_penalty: float) -> float:
    """vLLM's (and transformers') length-penalized score."""
    return beam.cum_logprob / (max(beam.length(num_prompt_tokens), 1) ** length_penalty)


def extend(
    live: Sequence[Beam], positions: Sequence[PositionLogprobs], width: int, stop_token_ids: frozenset[int],
    num_logprobs: int | None,
) -> tuple[list[Beam], list[Beam]]:
    """One step: each live beam's ``2 * width`` most likely next tokens (``positions[i].top``, most likely
    first), in order, as (the beams that go on, unranked; the beams that ended on a stop token).
    ``num_logprobs``: how many alternatives each kept position reports (the request's; None: none)."""
    going: list[Beam] = []
    ended: list[Beam] = []
    for beam, position in zip(live, positions, strict=True):
        for alternative in position.top[: 2 * width]:
            token_id, logprob = alternative.token_id, alternative.logprob
            kept = PositionLogprobs(token_id, logprob, position.top[: num_logprobs or 0])
            child = Beam([*beam.token_ids, token_id], [*beam.logprobs, kept], beam.cum_logprob + logprob)
            if token_id in stop_token_ids:
                child.stopped = True
                ended.append(child)
            else:
                going.append(child)
    return going, ended


def best(beams: list[Beam], width: int, num_prompt_tokens: int, length_penalty: float) -> list[Beam]:
    """The ``width`` best, best first; equal scores keep their order (Python's sort is stable)."""
    return sorted(beams, key=lambda b: score(b, num_prompt_tokens, length_penalty), reverse=True)[:width]


def can_stop_early(
    completed: list[Beam], live: list[Beam], width: int, num_prompt_tokens: int, max_tokens: int,
    length_penalty: float, max_step_logprob: float,
) -> bool:
    """Whether no continuation of a live beam (nor the beam as it is) can enter the ``width`` best of
    ``completed``: the search's answer is then ``best(completed)`` whatever the remaining steps bring.

    A continuation's log-probability is at most the beam's plus ``max_step_logprob`` (0 unless an
    engine rounded a logprob above 0) per step left, and its length lies between the beam's and the
    prompt's plus ``max_tokens``; the score is largest at whichever end makes ``length ** penalty``
    largest (the sum is negative)."""
    if len(completed) < width or not live:
        return not live
    kth = score(best(completed, width, num_prompt_tokens, length_penalty)[-1], num_prompt_tokens, length_penalty)
    longest = num_prompt_tokens + max_tokens
    for beam in live:
        steps_left = max_tokens - len(beam.token_ids)
        ceiling = min(beam.cum_logprob + max(max_step_logprob, 0.0) * steps_left, 0.0)
        shortest = max(beam.length(num_prompt_tokens), 1)
        bound = ceiling / max(shortest**length_penalty, longest**length_penalty)
        if not kth > bound:
            return False
    return True


async def _all_or_none(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """``asyncio.gather`` whose first failure (or a cancellation) cancels the rest before it is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


@dataclass
class _Search:
    """One prompt's search."""

    state: RouterState
    request_id: str
    prompt: list[int]
    params: SamplingParams
    options: BeamSearch
    cache_salt: str | None
    lora_name: str | None
    images: Any
    num_cached_tokens: int = 0
    # The prompt's logprobs (``prompt_logprobs``, or an echo's with ``logprobs``), from the first step.
    prompt_logprobs: list[PromptLogprob | None] | None = None

    def step_params(self) -> SamplingParams:
        """One greedy token with the alternatives the search (and the request's logprobs) need, from the
        raw log-probabilities: no stop token (a stop token is a candidate like any other)."""
        width = self.params.n
        return SamplingParams(
            n=1, max_tokens=1, temperature=0.0, logprobs=max(2 * width, self.params.logprobs or 0),
            ignore_eos=True, priority=self.params.priority,
        )

    async def _next_position(self, beam: Beam, step: int, index: int, params: SamplingParams) -> PositionLogprobs:
        (engine_request,) = await self.state.dispatcher.submit(
            f"{self.request_id}-s{step}b{index}", [*self.prompt, *beam.token_ids], params, self.cache_salt,
            self.lora_name, self.images,
        )
        position: PositionLogprobs | None = None
        try:
            async for output in engine_request.outputs():
                if step == 0:
                    self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
                    self.prompt_logprobs = output.prompt_logprobs or self.prompt_logprobs
                if output.logprobs:
                    position = output.logprobs[0]
        finally:
            engine_request.close()
        if position is None or not position.top:
            raise EngineRequestError("beam search: an engine answered a step without its logprobs", status=500)
        return position

    async def run(self) -> list[Beam]:
        step_params = self.step_params()
        # The first step (one beam: the prompt alone) also brings the prompt's logprobs, when asked for.
        first_params = msgspec.structs.replace(step_params, prompt_logprobs=self.params.prompt_logprobs)

        async def next_positions(live: list[Beam], step: int) -> list[PositionLogprobs]:
            params = first_params if step == 0 else step_params
            return await _all_or_none([self._next_position(beam, step, i, params) for i, beam in enumerate(live)])

        beams, _ = await run_search(next_positions, len(self.prompt), self.params, self.options)
        return beams


async def run_search(
    next_positions: Callable[[list[Beam], int], Awaitable[list[PositionLogprobs]]], num_prompt_tokens: int,
    params: SamplingParams, options: BeamSearch,
) -> tuple[list[Beam], int]:
    """The search of one prompt of ``num_prompt_tokens``, ``next_positions(live beams, step)`` giving each
    live beam's next position (most likely alternatives first): its ``params.n`` best beams, best first,
    and the number of steps it ran."""
    width, length_penalty = params.n, options.length_penalty
    stops = frozenset(params.stop_token_ids)
    live, completed = [Beam()], []
    max_step_logprob = 0.0
    for step in range(params.max_tokens):
        positions = await next_positions(live, step)
        max_step_logprob = max(max_step_logprob, *(t.logprob for p in positions for t in p.top))
        going, ended = extend(live, positions, width, stops, params.logprobs)
        completed += ended
        live = best(going, width, num_prompt_tokens, length_penalty)
        if step + 1 < params.max_tokens and can_stop_early(
            completed, live, width, num_prompt_tokens, params.max_tokens, length_penalty, max_step_logprob
        ):
            return best(completed, width, num_prompt_tokens, length_penalty), step + 1
    return best(completed + live, width, num_prompt_tokens, length_penalty), params.max_tokens


class _Done:
    """The engine request a finished beam's ``ChoiceStream`` stands for: nothing left to abort."""

    def close(self) -> None:
        pass


def _choice_delta(
    state: RouterState, plan: GenerationPlan, p: int, index: int, beam: Beam, run: _Search, started: float
) -> ChoiceDelta:
    """A finished beam as one delta of its choice: detokenized, stop token and logprobs as any choice's; its
    first token, as the client sees it, comes at the end of the search that ``started`` then."""
    prompt = plan.prompts[p]
    stream = ChoiceStream(index, _Done(), state.prompts.tokenizer, prompt, plan.text, state.metrics,  # type: ignore[arg-type]
                          arrival=started)
    output = RequestOutput(
        request_id=f"{plan.engine_request_id}-{index}", new_token_ids=beam.token_ids,
        logprobs=beam.logprobs if plan.params[p].logprobs is not None else None,
        finish_reason="stop" if beam.stopped else "length", num_prompt_tokens=len(prompt),
        num_cached_tokens=run.num_cached_tokens, prompt_logprobs=run.prompt_logprobs,
    )
    return stream.process(output)


async def search(
    state: RouterState, plan: GenerationPlan, wait_disconnect: DisconnectWaiter | None
) -> list[ChoiceDelta]:
    """Every prompt's search (each prompt's ``n`` best beams as choices ``p * n + i``), each prompt holding
    one admission slot while it runs; raises ``ClientDisconnected`` (its engine requests aborted) when the
    client goes first, ``EngineRequestError`` when a step fails."""
    from router.serving import ClientDisconnected  # the serving module imports this one

    options = plan.beam_search
    assert options is not None
    started = time.monotonic()
    lane = state.admission.enter(CLIENT_KEY.get() or "-", [len(p) for p in plan.prompts], plan.params[0].priority)

    async def one(p: int) -> list[ChoiceDelta]:
        slot = await lane.next_slot()
        try:
            prompt = plan.prompts[p]
            state.metrics.prompt_tokens.inc(len(prompt))
            state.metrics.request_prompt_tokens.observe(len(prompt))
            run = _Search(state, f"{plan.engine_request_id}-{p}", prompt, plan.params[p], options, plan.cache_salt,
                          plan.lora_name, plan.images[p] if plan.images else None)
            beams = await run.run()
            n = plan.params[p].n
            return [_choice_delta(state, plan, p, p * n + i, beam, run, started)
                    for i, beam in enumerate(beams)]
        finally:
            slot.release()

    everything = asyncio.ensure_future(_all_or_none([one(p) for p in range(len(plan.prompts))]))
    gone = asyncio.ensure_future(wait_disconnect()) if wait_disconnect is not None else None
    try:
        await asyncio.wait([t for t in (everything, gone) if t is not None], return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():
            raise ClientDisconnected()
        return [delta for deltas in everything.result() for delta in deltas]
    finally:
        for task in (everything, gone):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        lane.close()  # the slots taken are released by their searches; those granted, not taken, here


async def replay(deltas: list[ChoiceDelta]) -> AsyncGenerator[ChoiceDelta, None]:
    """A finished search's choices as a stream's deltas (its answer comes whole, at the end, as vLLM's)."""
    for delta in deltas:
        yield delta

