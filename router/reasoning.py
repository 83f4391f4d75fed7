"""A reasoning model's thinking, split from its answer: ``reasoning_content`` beside ``content`` in
chat responses and stream deltas (the field DeepSeek's API and vLLM use), with ``--reasoning-parser``.

* ``deepseek_r1`` (DeepSeek-R1 and its distillations, QwQ): the template opens ``<think>`` in the
  prompt, so the answer starts inside the thinking, which ends at ``</think>``; an answer with no
  ``</think>`` (cut by ``max_tokens``) is all thinking. A ``<think>`` the model writes itself at the
  start is dropped.
* ``qwen3`` (Qwen3, which thinks unless ``chat_template_kwargs`` say ``enable_thinking: false``): the
  thinking is what the answer opens with ``<think>`` and closes with ``</think>``; an answer that does
  not start with ``<think>`` is all content, and one whose thinking never closes is all thinking.
* ``deepseek_v3`` (DeepSeek-V3.1 and later, thinking when ``chat_template_kwargs`` say ``thinking: true``),
  ``glm45`` (GLM-4.5 to 5), ``kimi_k2`` (Kimi K2 Thinking), ``minimax_m2`` (MiniMax-M2): the prompt decides. Where its
  text ends with ``<think>`` (the template opened the thinking), as ``deepseek_r1``; else as ``qwen3`` (the model
  opens it, or the template closed it, ``<think></think>``, to turn thinking off).
* ``seed_oss`` (ByteDance's Seed-OSS): as those the prompt decides, its thinking between ``<seed:think>`` and
  ``</seed:think>``.

The whitespace after ``</think>`` belongs to neither. A request whose output a
grammar holds (``response_format``, a forced tool call) is not split: its output is content from
the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN = "<think>"
CLOSE = "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """One answer as it streams: each ``feed`` gives the ``(reasoning, content)`` text that no later
    text can change, ``finish`` the rest. ``thought``: whether the answer had a thinking part."""

    starts_inside: bool  # deepseek_r1: the prompt opened the thinking
    open_tag: str = OPEN
    close_tag: str = CLOSE
    thought: bool = False
    _state: str = "start"  # "start" (not decided yet), "thinking", "after" (its end seen), "answer"
    _buf: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(self.open_tag):
                self._think(head[len(self.open_tag):])
            elif self.open_tag.startswith(head):  # empty, or a piece of the tag: not decided yet
                return "", ""
            elif self.starts_inside:
                self._think(self._buf)
            else:
                self._state = "answer"
        reasoning = ""
        if self._state == "thinking":
            end = self._buf.find(self.close_tag)
            if end < 0:
                keep = len(self._buf) - _partial_suffix(self._buf, self.close_tag)
                reasoning, self._buf = self._buf[:keep], self._buf[keep:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:end], self._buf[end + len(self.close_tag):]
            self._state = "after"
        if self._state == "after":  # the whitespace after the thinking belongs to neither
            self._buf = self._buf.lstrip()
            if not self._buf:
                return reasoning, ""
            self._state = "answer"
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        text, self._buf = self._buf, ""
        if self._state == "start" and self.starts_inside and text:
            self._think("")
        if self._state == "thinking":  # never closed (cut short): all thinking
            return text, ""
        return "", "" if self._state == "after" else text

    def _think(self, rest: str) -> None:
        self._state, self._buf, self.thought = "thinking", rest, True


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool | None  # None: where the prompt opened the thinking (``prompt_opens``)
    open_tag: str = OPEN
    close_tag: str = CLOSE

    @property
    def tags(self) -> tuple[str, ...]:
        """What it must see in the streamed text."""
        return self.open_tag, self.close_tag

    def stream(self, prompt_opens: bool = False) -> ReasoningStream:
        """``prompt_opens``: whether the prompt's text ends with its open tag (for the parsers it decides)."""
        return ReasoningStream(prompt_opens if self.starts_inside is None else self.starts_inside, self.open_tag,
                               self.close_tag)

    def prompt_opens(self, prompt_text_end: str) -> bool:
        """Whether a prompt whose text ends so leaves the answer inside the thinking."""
        return prompt_text_end.rstrip().endswith(self.open_tag)

    def split(self, text: str, prompt_opens: bool = False) -> tuple[str | None, str]:
        """A whole answer's thinking (None when it has none) and content."""
        stream = self.stream(prompt_opens)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning if stream.thought else None), content + more_content


REASONING_PARSERS: dict[str, ReasoningParser] = {
    p.name: p for p in (ReasoningParser("deepseek_r1", starts_inside=True), ReasoningParser("qwen3", starts_inside=False),
                        *(ReasoningParser(name, starts_inside=None)
                          for name in ("deepseek_v3", "glm45", "kimi_k2", "minimax_m2")),
                        ReasoningParser("seed_oss", starts_inside=None, open_tag="<seed:think>", close_tag="</seed:think>"))
}
