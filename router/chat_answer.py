"""How a chat answer's text becomes its message: the thinking split off first (``--reasoning-parser``,
``router/reasoning.py``), then tool calls read out of the rest (``router/tools.py``), for a whole
response or as it streams."""

from __future__ import annotations

from dataclasses import dataclass

from router.openai_responses import ChatMessageOut, DeltaToolCall
from router.reasoning import ReasoningParser, ReasoningStream
from router.tool_parsers import ToolCallParser
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

    @property
    def plain(self) -> bool:
        """Whether the answer's text is its content, as it comes."""
        return self.tools is None and self.reasoning is None

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessageOut, str | None]:
        """A whole answer's message and finish reason."""
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        reasoning = reasoning if self.include_reasoning else None
        if self.tools is None:
            return ChatMessageOut(content=content, reasoning_content=reasoning), finish_reason
        answer, calls = self.tools.extract(content, self.tool_parser)
        tool_calls = tool_calls_out(calls, self.tool_parser) or None
        message = ChatMessageOut(content=answer, reasoning_content=reasoning, tool_calls=tool_calls)
        return message, self.tools.finish_reason(finish_reason, bool(calls))

    def stream(self) -> AnswerStream:
        return AnswerStream(
            self,
            self.reasoning.stream() if self.reasoning is not None else None,
            ToolDeltas.start(self.tools, self.tool_parser) if self.tools is not None else None,
        )


@dataclass
class AnswerStream:
    """One streamed answer: each piece of text as the thinking, content and tool-call deltas that
    no later text can change."""

    reader: AnswerReader
    reasoning: ReasoningStream | None
    tools: ToolDeltas | None

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """``(reasoning, content, calls)`` of ``text``, all that is left when ``finished``."""
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

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if self.reader.tools is None or self.tools is None:
            return finish_reason
        return self.reader.tools.finish_reason(finish_reason, self.tools.num_calls > 0)
