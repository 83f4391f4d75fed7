"""One choice of a response: engine outputs in, text deltas out.

Runs the incremental detokenizer and the stop-string checker, keeps each token's logprobs with the
text it produced (a token's logprobs are released once text from it has been released), and
records the request's latency metrics.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from common.protocol import PositionLogprobs, PromptLogprob, RequestOutput
from router.detokenizer import IncrementalDetokenizer
from router.dispatcher import EngineRequest
from router.metrics import RouterMetrics
from router.stop_checker import StopChecker


@dataclass(frozen=True)
class TextOptions:
    """How a choice's tokens become its text (vLLM's names). The token a request stopped on (end of
    sequence, or one of its ``stop_token_ids``) adds no text, as a matched stop string adds none,
    unless ``include_stop``; special tokens add none unless ``skip_special_tokens`` is false."""

    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop: bool = False
    skip_special_tokens: bool = True


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # where each token's text starts
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # so far, including this delta
    prompt_logprobs: list[PromptLogprob | None] | None = None  # with the first token, when asked for
    # The tokens this delta's output added (the one a request stopped on too; none past a stop string).
    token_ids: list[int] = field(default_factory=list)


class EndedInline(Exception):
    """The stream's last output was taken in the receive loop (``router/inline_stream.py``), which
    sent its chunks: the request's task ends the stream (no delta of its own)."""


@dataclass
class _PendingToken:
    logprobs: PositionLogprobs
    offset: int


class ChoiceStream:
    """Iterate ``deltas()`` once; ``close()`` aborts the engine request if it has not finished."""

    __slots__ = (
        "_arrival", "_detokenizer", "_emitted_len", "_last_output_time", "_metrics", "_pending", "_raw_len", "_stop",
        "_stop_token_ids", "engine_request", "index", "num_cached_tokens", "num_output_tokens",
    )

    def __init__(
        self,
        index: int,
        engine_request: EngineRequest,
        tokenizer: Any,
        prompt_token_ids: list[int],
        options: TextOptions,
        metrics: RouterMetrics,
        arrival: float | None = None,
    ) -> None:
        """``arrival``: when the client's request came (``time.monotonic``), if before now."""
        self.index = index
        self.engine_request = engine_request
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, options.skip_special_tokens)
        self._stop = StopChecker(options.stop, options.include_stop)
        # The tokens whose text a stop on them leaves out (none when it is kept).
        self._stop_token_ids = frozenset() if options.include_stop else options.stop_token_ids
        self._metrics = metrics
        self._pending: list[_PendingToken] = []
        self._raw_len = 0  # characters the detokenizer produced
        self._emitted_len = 0  # characters released to the client
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self._arrival = time.monotonic() if arrival is None else arrival
        self._last_output_time: float | None = None

    def close(self) -> None:
        self.engine_request.close()

    async def deltas(self) -> AsyncGenerator[ChoiceDelta, None]:
        try:
            async for output in self.engine_request.outputs():
                delta = self.process(output)
                yield delta
                if delta.finish_reason is not None:
                    return
        except EndedInline:
            return
        finally:
            self.close()

    def process(self, output: RequestOutput) -> ChoiceDelta:
        """The delta of one output (the stream's next), its text detokenized and stop-checked."""
        self.observe_timing(output, time.monotonic())
        if output.num_cached_tokens:
            self.num_cached_tokens = output.num_cached_tokens
        text = ""
        logprobs = output.logprobs or []
        last = len(output.new_token_ids) - 1
        taken = len(output.new_token_ids)
        for k, token_id in enumerate(output.new_token_ids):
            self.num_output_tokens += 1
            if k == last and output.finish_reason == "stop" and token_id in self._stop_token_ids:
                piece = ""  # the token it stopped on
            else:
                piece = self._detokenizer.push(token_id)
            if k < len(logprobs):  # only tokens with logprobs wait for their text (the rest have nothing to release)
                self._pending.append(_PendingToken(logprobs[k], self._raw_len))
            self._raw_len += len(piece)
            text += self._stop.push(piece)
            if self._stop.stopped:
                taken = k + 1
                break
        finish_reason = "stop" if self._stop.stopped else output.finish_reason
        if finish_reason is not None and not self._stop.stopped:
            text += self._stop.push(self._detokenizer.flush())
            text += self._stop.flush()
            if self._stop.stopped:
                finish_reason = "stop"
        self._emitted_len += len(text)
        released = self._release_tokens(everything=finish_reason is not None and not self._stop.stopped)
        if finish_reason is not None:
            self._observe_finish(finish_reason)
        return ChoiceDelta(
            index=self.index,
            text=text,
            logprobs=[t.logprobs for t in released],
            text_offsets=[t.offset for t in released],
            finish_reason=finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens,
            prompt_logprobs=output.prompt_logprobs,
            token_ids=output.new_token_ids[:taken],
        )

    def process_plain(self, output: RequestOutput) -> str | ChoiceDelta:
        """``process`` for a plain token output (no logprobs, no finish), lighter: its text; or,
        when a stop string hits in it, the stream's last delta. Its timing is the caller's to observe
        (``observe_timing``), once the tokens that came with it are sent too."""
        if output.num_cached_tokens:
            self.num_cached_tokens = output.num_cached_tokens
        text = ""
        detokenizer, stop = self._detokenizer, self._stop
        for token_id in output.new_token_ids:
            self.num_output_tokens += 1
            piece = detokenizer.push(token_id)
            self._raw_len += len(piece)
            text += stop.push(piece)
            if stop.stopped:
                break
        self._emitted_len += len(text)
        if not stop.stopped:
            return text
        self._pending = []
        self._observe_finish("stop")
        return ChoiceDelta(index=self.index, text=text, finish_reason="stop",
                           num_cached_tokens=self.num_cached_tokens, num_output_tokens=self.num_output_tokens)

    def _release_tokens(self, everything: bool) -> list[_PendingToken]:
        """Tokens whose text has (at least partly) been released; on a stop, the rest is dropped."""
        if not self._pending:
            return []
        cut = len(self._pending)
        if not everything:
            cut = next((i for i, t in enumerate(self._pending) if t.offset >= self._emitted_len), cut)
        released, self._pending = self._pending[:cut], self._pending[cut:]
        if self._stop.stopped:
            self._pending = []
        return released

    def observe_timing(self, output: RequestOutput, now: float) -> None:
        """Time to first token or inter-token latency, for ``output`` handed on at ``now``."""
        if not output.new_token_ids:
            return
        if self._last_output_time is None:
            self._metrics.time_to_first_token.observe(now - self._arrival)
        else:
            self._metrics.inter_token_latency.observe(
                (now - self._last_output_time) / len(output.new_token_ids)
            )
        self._last_output_time = now

    def _observe_finish(self, finish_reason: str) -> None:
        m = self._metrics
        m.e2e_latency.observe(time.monotonic() - self._arrival)
        m.request_success.labels(finished_reason=finish_reason).inc()
        m.generation_tokens.inc(self.num_output_tokens)
        m.request_generation_tokens.observe(self.num_output_tokens)
        m.cached_prompt_tokens.inc(self.num_cached_tokens)
