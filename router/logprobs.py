"""Token strings and bytes for logprobs, and the OpenAI logprobs shapes of both endpoints."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from common.protocol import PositionLogprobs, PromptLogprob
from router.openai_responses import (
    ChatLogprobEntry,
    ChatLogprobs,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprobEntry,
    PromptLogprobs,
)

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_METASPACE = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    """The reversible byte <-> printable-char table byte-level BPE vocabularies are written in:
    printable Latin-1 bytes stand for themselves, the others are shifted above 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


def _uses_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return "ByteLevel" in repr(decoder)


class TokenRenderer:
    """The raw bytes and a printable string of single tokens (cached; a token may be half a char).

    ``as_token_ids`` (vLLM's ``return_tokens_as_token_ids``): each token is ``"token_id:<id>"`` (and its
    bytes that text's), which names a token even where its text is not one whole character."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_token_ids = as_token_ids
        self._byte_level = _uses_byte_level(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def render(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token; bytes that are not a whole UTF-8 character are shown escaped."""
        cached = self._cache.get(token_id)
        if cached is None:
            raw = f"token_id:{token_id}".encode() if self._as_token_ids else self._bytes(token_id)
            cached = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
            self._cache[token_id] = cached
        return cached

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if piece in self._special:
            return piece.encode("utf-8")
        if self._byte_level and all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace(_METASPACE, " ").encode("utf-8")


def chat_logprobs(renderer: TokenRenderer, positions: Sequence[PositionLogprobs]) -> ChatLogprobs:
    content = []
    for pos in positions:
        text, raw = renderer.render(pos.token_id)
        tops = []
        for alt in pos.top:
            alt_text, alt_raw = renderer.render(alt.token_id)
            tops.append(ChatTopLogprob(token=alt_text, logprob=alt.logprob, bytes=alt_raw))
        content.append(ChatLogprobEntry(token=text, logprob=pos.logprob, bytes=raw, top_logprobs=tops))
    return ChatLogprobs(content=content)


def prompt_logprobs(renderer: TokenRenderer, entries: Sequence[PromptLogprob | None]) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, its entry and its top alternatives' (ranks 1..k),
    keyed by token id; the prompt's token keeps its own rank when it is also among the top."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        by_id = {
            str(alt.token_id): PromptLogprobEntry(
                logprob=alt.logprob, rank=rank, decoded_token=renderer.render(alt.token_id)[0]
            )
            for rank, alt in enumerate(entry.top, start=1)
        }
        by_id[str(entry.token_id)] = PromptLogprobEntry(
            logprob=entry.logprob, rank=entry.rank, decoded_token=renderer.render(entry.token_id)[0]
        )
        out.append(by_id)
    return out


def echo_logprobs(
    renderer: TokenRenderer, prompt_ids: Sequence[int], entries: Sequence[PromptLogprob | None]
) -> CompletionLogprobs:
    """The legacy completions logprobs of an echoed prompt: its tokens, their logprobs (None for the
    first) and top alternatives, and where each token's text starts in the prompt's text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for token_id, entry in zip(prompt_ids, entries, strict=True):
        text = renderer.render(token_id)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(entry.logprob if entry is not None else None)
        top_logprobs.append(
            {renderer.render(alt.token_id)[0]: alt.logprob for alt in entry.top} if entry is not None else None
        )
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=offsets)


def completion_logprobs(
    renderer: TokenRenderer, positions: Sequence[PositionLogprobs], text_offsets: Sequence[int]
) -> CompletionLogprobs:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for pos in positions:
        tokens.append(renderer.render(pos.token_id)[0])
        token_logprobs.append(pos.logprob)
        top_logprobs.append({renderer.render(alt.token_id)[0]: alt.logprob for alt in pos.top})
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=list(text_offsets),
    )
