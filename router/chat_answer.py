"""How a chat answer's text becomes its message: the thinking split off first (``--reasoning-parser``,
``router/reasoning.py``), then tool calls read out of the rest (``router/tools.py``), for a whole
response or as it streams. An answer in gpt-oss's harmony format is read by its messages' channels instead
(``router/harmony.py``): thinking, content and calls at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.call_readers import ArgumentsPiece, CallStart, PieceEvent
from router.harmony import HarmonyEvent, HarmonyStream, Thinking, read_harmony
from router.openai_responses import ChatMessageOut, DeltaToolCall
from router.reasoning import ReasoningParser, ReasoningStream
from router.tool_parsers import ToolCall, ToolCallParser
from router.tools import ToolDeltas, ToolPlan, tool_calls_out


@dataclass(frozen=True)
class AnswerReader:
    """One request's way of reading its answers; ``tools`` None unless they are read for calls."""

    tools: ToolPlan | None
    tool_parser: ToolCallParser | None
    reasoning: ReasoningParser | None
    # Whether the text must keep special tokens: a parser reads tags the tokenizer marks special
    # (Mistral's [TOOL_CALLS], some models' <tool_call> or <think>), which detokenizing would drop.
    needs_special_tokens: bool = False
    # vLLM's ``include_reasoning``: false leaves the thinking split off the content out of the answer.
    include_reasoning: bool = True
    # The answer is in gpt-oss's harmony format: its messages' channels say what is thinking, content and calls
    # (``reasoning`` and ``tool_parser`` unused).
    harmony: bool = False
    # Whether the prompt opened the thinking (its text ends with ``<think>``), for the parsers the prompt decides.
    prompt_opens: bool = False

    @property
    def plain(self) -> bool:
        """Whether the answer's text is its content, as it comes."""
        return self.tools is None and self.reasoning is None and not self.harmony

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessageOut, str | None]:
        """A whole answer's message and finish reason."""
        if self.harmony:
            return self._harmony_message(read_harmony(text, self.tools.max_calls if self.tools else None),
                                         finish_reason)
        reasoning, content = self.reasoning.split(text, self.prompt_opens) if self.reasoning is not None else (None, text)
        reasoning = reasoning if self.include_reasoning else None
        if self.tools is None:
            return ChatMessageOut(content=content, reasoning_content=reasoning), finish_reason
        answer, calls = self.tools.extract(content, self.tool_parser)
        tool_calls = tool_calls_out(calls, self.tool_parser) or None
        message = ChatMessageOut(content=answer, reasoning_content=reasoning, tool_calls=tool_calls)
        return message, self.tools.finish_reason(finish_reason, bool(calls))

    def _harmony_message(self, events: list[HarmonyEvent], finish_reason: str | None) -> tuple[ChatMessageOut, str | None]:
        thinking = [e.text for e in events if isinstance(e, Thinking)]
        calls: list[ToolCall] = []
        content = ""
        for event in events:
            if isinstance(event, CallStart):
                calls.append(ToolCall(event.name, ""))
            elif isinstance(event, ArgumentsPiece):
                calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + event.text)
            elif isinstance(event, str):
                content += event
        if self.tools is None:
            content, calls = _offered_nothing(events), []
        message = ChatMessageOut(content=content or None,
                                 reasoning_content="".join(thinking) if thinking and self.include_reasoning else None,
                                 tool_calls=tool_calls_out(calls, None) or None)
        return message, self.tools.finish_reason(finish_reason, bool(calls)) if self.tools else finish_reason

    def stream(self) -> AnswerStream:
        if self.harmony:
            return AnswerStream(self, None, ToolDeltas.start(self.tools, None) if self.tools is not None else None,
                                HarmonyStream(self.tools.max_calls if self.tools else None))
        return AnswerStream(
            self,
            self.reasoning.stream(self.prompt_opens) if self.reasoning is not None else None,
            ToolDeltas.start(self.tools, self.tool_parser) if self.tools is not None else None,
        )


@dataclass
class AnswerStream:
    """One streamed answer: each piece of text as the thinking, content and tool-call deltas that
    no later text can change."""

    reader: AnswerReader
    reasoning: ReasoningStream | None
    tools: ToolDeltas | None
    harmony: HarmonyStream | None = None

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """``(reasoning, content, calls)`` of ``text``, all that is left when ``finished``."""
        if self.harmony is not None:
            return self._harmony(self.harmony.feed(text) + (self.harmony.finish() if finished else []))
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if finished:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
            if not self.reader.include_reasoning:
                reasoning = ""
        calls: list[DeltaToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                more_content, more_calls = self.tools.finish()
                content, calls = content + more_content, calls + more_calls
        return reasoning, content, calls

    def _harmony(self, events: list[HarmonyEvent]) -> tuple[str, str, list[DeltaToolCall]]:
        reasoning = "".join(e.text for e in events if isinstance(e, Thinking)) if self.reader.include_reasoning else ""
        rest: list[PieceEvent] = [e for e in events if not isinstance(e, Thinking)]
        if self.tools is None:
            return reasoning, _offered_nothing(rest), []
        content, calls = self.tools.pieces_out(rest)
        return reasoning, content, calls

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if self.reader.tools is None or self.tools is None:
            return finish_reason
        return self.reader.tools.finish_reason(finish_reason, self.tools.num_calls > 0)


def _offered_nothing(events: Sequence[HarmonyEvent]) -> str:
    """The content of a harmony answer to a request that offered no tools: calls' arguments stay content, as written."""
    return "".join(e.text if isinstance(e, ArgumentsPiece) else e for e in events if isinstance(e, (str, ArgumentsPiece)))
