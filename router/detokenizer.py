"""Incremental detokenization that never splits a character across deltas.

Byte-level BPE and sentencepiece byte-fallback tokens can end in the middle of a UTF-8 character,
and some tokenizers change how a token renders depending on its left neighbour. So each step
decodes a small window: ``ids[prefix:read]`` (already emitted, kept only as context) and
``ids[prefix:]``; the delta is what the longer text adds, and it is held back while the window
ends in U+FFFD (an incomplete character). A few prompt tokens seed the window so the first output
token renders as it would after the prompt.

A byte-level BPE tokenizer (GPT-2's decoder: a text is its tokens' bytes, concatenated, read as
UTF-8, invalid bytes replaced) needs no window for most tokens. When no character is held back and
a token's own bytes are whole characters, the token adds exactly its own text, provided the text
before it ends on a whole character (a byte left over, say the prompt's, would join the bytes after
it). So ``push`` looks it up (``TokenPieces``, filled as tokens first appear) instead of decoding
twice.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed token ids as they arrive; ``push`` returns the text they complete (possibly "")."""

    __slots__ = ("_fast_decode", "_ids", "_pieces", "_prefix", "_read", "_skip_special", "_tokenizer", "_whole")

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
        use_pieces: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._fast_decode = fast_decoder(tokenizer)
        self._ids: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix = 0  # start of the context window
        self._read = len(self._ids)  # first id whose text has not been emitted yet
        self._pieces = token_pieces(tokenizer, skip_special_tokens) if use_pieces else None
        # Whether the text so far (the prompt's, at first) ends on a whole character: a byte left
        # over may join the bytes of tokens to come, so their own texts would not add up.
        self._whole = self._pieces is not None and not self._decode(self._ids).endswith(REPLACEMENT_CHAR)

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, self._skip_special)
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._whole and self._read == len(self._ids) - 1:  # no character held back
            assert self._pieces is not None
            piece = self._pieces.get(token_id)
            if piece is not None:
                self._prefix, self._read = self._read, len(self._ids)
                return piece
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
        self._whole = self._pieces is not None and not window.endswith(REPLACEMENT_CHAR)
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


class TokenPieces:
    """Each token's own text under a byte-level decoder, or None for a token whose bytes are not
    whole characters (or whose text has a U+FFFD of its own); computed as tokens first appear."""

    def __init__(self, decode: Callable[[list[int], bool], str], skip_special_tokens: bool) -> None:
        self._decode = decode
        self._skip_special = skip_special_tokens
        self._pieces: dict[int, str | None] = {}

    def get(self, token_id: int) -> str | None:
        try:
            return self._pieces[token_id]
        except KeyError:
            text = self._decode([token_id], self._skip_special)
            piece = self._pieces[token_id] = None if REPLACEMENT_CHAR in text else text
            return piece


_PIECES: weakref.WeakKeyDictionary[Any, dict[bool, TokenPieces]] = weakref.WeakKeyDictionary()


def token_pieces(tokenizer: Any, skip_special_tokens: bool) -> TokenPieces | None:
    """The tokenizer's ``TokenPieces`` (one per tokenizer, shared by its streams) when its decode is
    a byte-level one with nothing after it (``fast_decoder``); None otherwise."""
    by_skip = _PIECES.get(tokenizer)
    if by_skip is None:
        import tokenizers.decoders

        decode = fast_decoder(tokenizer)
        by_skip = _PIECES[tokenizer] = (
            {skip: TokenPieces(decode, skip) for skip in (False, True)}
            if decode is not None and isinstance(tokenizer._tokenizer.decoder, tokenizers.decoders.ByteLevel)
            else {}
        )
    return by_skip.get(skip_special_tokens)
