"""The fewest tokens a text can have: what lets a prompt's length in characters refuse it without
tokenizing it.

A tokenizer that never merges input characters covers every character it keeps with its tokens,
so a text of ``c`` kept characters has at least ``c / max_chars_per_token`` tokens. That holds
when each stage keeps every character:

- the normalizer only ever lengthens text (prepending, replacing a string by one no shorter,
  lowercasing, decomposing); NFC/NFKC composition, stripping and regex replacements can shorten
  it, so they get no bound;
- the pre-tokenizer splits without removing anything (byte-level, metaspace, digits, punctuation,
  splits that keep their delimiters); whitespace splitters drop the spaces;
- the model is BPE, whose tokens are strings of the (pre-tokenized) text. A byte-level BPE token is
  written one character per byte, and a character is at least one byte, so its written length
  bounds the text it stands for;
- no added token strips the whitespace around it (``lstrip``/``rstrip`` swallow any amount).

BPE silently drops a character that is not in its vocabulary when it has no unknown token. A
byte-level vocabulary may lack a few of the 256 bytes (the default model lacks some ASCII control
characters): those characters are not counted. A multi-byte character keeps a token as long as
every continuation byte is in the vocabulary. Without byte-level encoding any character may be
missing, so BPE needs an unknown token or a full byte fallback. A fused unknown token could
swallow any run of characters, so ``fuse_unk`` is only trusted with a full byte fallback.

Anything else gets no bound (``None``): the prompt is measured by tokenizing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_LENGTHENING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD", "ByteLevel"})
_LOSSLESS_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation"})
_CONTINUATION_BYTES = range(0x80, 0xC0)


@dataclass(frozen=True)
class TokenBound:
    max_chars_per_token: int
    dropped_chars: tuple[str, ...] = ()  # characters the tokenizer drops without a token

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text`` (without special tokens)."""
        num_kept = len(text) - sum(text.count(char) for char in self.dropped_chars)
        return -(-num_kept // self.max_chars_per_token)


def token_bound(tokenizer: Any) -> TokenBound | None:
    """The bound for ``tokenizer`` (a Hugging Face fast tokenizer), or None when its pipeline may
    merge characters or drop ones it cannot name."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow tokenizer: its pipeline is Python code we cannot inspect
    normalizer, pre_tokenizer = _state(backend.normalizer), _state(backend.pre_tokenizer)
    model = backend.model
    if not (
        _normalizer_keeps_length(normalizer)
        and _pre_tokenizer_keeps_chars(pre_tokenizer)
        and type(model).__name__ == "BPE"
    ):
        return None
    if any(token.lstrip or token.rstrip for token in backend.get_added_tokens_decoder().values()):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    max_chars = max((len(token) for token in vocab), default=0)
    if not max_chars:
        return None
    if _has_byte_level(pre_tokenizer, "pretokenizers") or _has_byte_level(normalizer, "normalizers"):
        return _byte_level_bound(vocab, max_chars)
    if model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return TokenBound(max_chars)  # every character has tokens: its own, or its bytes'
    if model.unk_token is not None and not model.fuse_unk:
        return TokenBound(max_chars)  # an unknown character becomes one unknown token
    return None


def _state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's settings, as in tokenizer.json."""
    return None if component is None else dict(json.loads(component.__getstate__()))


def _byte_level_bound(vocab: dict[str, int], max_chars: int) -> TokenBound | None:
    from tokenizers.pre_tokenizers import ByteLevel

    byte_chars = _gpt2_byte_chars()
    if set(byte_chars) != set(ByteLevel.alphabet()):
        return None  # not the byte map this reads the vocabulary with
    missing = [b for b, char in enumerate(byte_chars) if char not in vocab]
    if any(b in _CONTINUATION_BYTES for b in missing):
        return None  # a multi-byte character might lose all its bytes
    return TokenBound(max_chars, tuple(chr(b) for b in missing if b < 0x80))


def _gpt2_byte_chars() -> list[str]:
    """The character byte-level BPE writes for each byte value, indexed by the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, num_shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + num_shifted))
            num_shifted += 1
    return chars


def _has_byte_level(spec: dict[str, Any] | None, children: str) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(child, children) for child in spec.get(children) or [])


def _normalizer_keeps_length(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_length(part) for part in spec.get("normalizers") or [])
    if kind == "Replace":
        pattern = spec.get("pattern") or {}
        return "String" in pattern and len(spec.get("content", "")) >= len(pattern["String"])
    return kind in _LENGTHENING_NORMALIZERS


def _pre_tokenizer_keeps_chars(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_chars(part) for part in spec.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return str(spec.get("behavior", "Isolated")).lower() != "removed"
    return kind in _LOSSLESS_PRE_TOKENIZERS
