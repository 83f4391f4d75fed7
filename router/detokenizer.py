"""Incremental detokenization that never splits a character across deltas.

Byte-level BPE and sentencepiece byte-fallback tokens can end in the middle of a UTF-8 character,
and some tokenizers change how a token renders depending on its left neighbour. So each step
decodes a small window: ``ids[prefix:read]`` (already emitted, kept only as context) and
``ids[prefix:]``; the delta is what the longer text adds, and it is held back while the window
ends in U+FFFD (an incomplete character). A few prompt tokens seed the window so the first output
token renders as it would after the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed token ids as they arrive; ``push`` returns the text they complete (possibly "")."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._fast_decode = fast_decoder(tokenizer)
        self._ids: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix = 0  # start of the context window
        self._read = len(self._ids)  # first id whose text has not been emitted yet

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, self._skip_special)
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end); call once at finish."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if len(window) <= len(context) or (window.endswith(REPLACEMENT_CHAR) and not final):
            if final:
                self._read = len(self._ids)
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(context) :]


def fast_decoder(tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """The Rust ``tokenizers`` decode that ``tokenizer.decode`` ends in, when calling it directly
    gives the same text (a fast tokenizer without clean-up of tokenization spaces and without its
    own decode); it skips a third of the per-token cost. None otherwise."""
    try:
        import tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (
        not isinstance(backend, tokenizers.Tokenizer)
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
        or getattr(cls, "decode", None) is not PreTrainedTokenizerFast.decode
        or getattr(cls, "_decode", None) is not PreTrainedTokenizerFast._decode
    ):
        return None
    return backend.decode  # type: ignore[no-any-return]
