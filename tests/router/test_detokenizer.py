"""Incremental detokenization equals a full decode and never splits a character."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, token_pieces
from router.logprobs import TokenRenderer

TEXTS = [
    "Hello, world!",
    "Ça va? Très bien, merci.",
    "你好，世界！这是一个测试。",
    "emoji: 🎉🚀👩‍👩‍👧 and flags 🇫🇷",
    "mixed  spaces\n\nnew lines\ttabs",
    "ﬁ ligature, Ω, ß, ñ, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def sentencepiece_style_tokenizer() -> Any:
    """A tiny Llama-style tokenizer: metaspace, byte fallback, leading space stripped on decode."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "ll", "llo", "é", "▁é"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁", "w"), ("l", "l"), ("ll", "o")]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=["byte-level-bpe", "sentencepiece-style"])
def any_tokenizer(request: pytest.FixtureRequest, tokenizer: Any) -> Any:
    return tokenizer if request.param == "byte-level-bpe" else sentencepiece_style_tokenizer()


def incremental(tokenizer: Any, prompt_ids: list[int], output_ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.push(t) for t in output_ids]
    return [*deltas, detokenizer.flush()]


def expected_text(tokenizer: Any, prompt_ids: list[int], output_ids: list[int]) -> str:
    """What the output adds to the decoded prompt (leading-space rules depend on the context)."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)[len(prompt_text) :]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_splits_a_char(any_tokenizer: Any, text: str) -> None:
    prompt_ids = any_tokenizer.encode("hello", add_special_tokens=False)
    output_ids = any_tokenizer.encode(" " + text, add_special_tokens=False)
    deltas = incremental(any_tokenizer, prompt_ids, output_ids)
    assert "".join(deltas) == expected_text(any_tokenizer, prompt_ids, output_ids)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_multi_byte_char_split_over_tokens_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("你", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits this character
    deltas = incremental(tokenizer, [], ids)
    assert deltas[: len(ids) - 1] == [""] * (len(ids) - 1) and deltas[len(ids) - 1] == "你"


def test_truncated_char_at_the_end_is_flushed(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 你", add_special_tokens=False)[:-1]
    deltas = incremental(tokenizer, [], ids)
    assert REPLACEMENT_CHAR not in "".join(deltas[:-1]) and deltas[-1].endswith(REPLACEMENT_CHAR)


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    ids = tokenizer.encode("Done.", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(incremental(tokenizer, [], ids)) == "Done."


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=40), prompt=st.text(max_size=10))
def test_random_text_round_trips(tokenizer: Any, text: str, prompt: str) -> None:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(incremental(tokenizer, prompt_ids, output_ids)) == expected_text(
        tokenizer, prompt_ids, output_ids
    )


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(any_tokenizer: Any, text: str) -> None:
    renderer = TokenRenderer(any_tokenizer)
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    raw = b"".join(bytes(renderer.render(t)[1]) for t in ids)
    assert raw.decode().lstrip(" ") == text


def test_byte_level_tokens_are_looked_up_and_others_decoded(tokenizer: Any) -> None:
    assert token_pieces(tokenizer, True) is not None
    # Metaspace with a leading space stripped: a token's text depends on what precedes it.
    assert token_pieces(sentencepiece_style_tokenizer(), True) is None


def assert_same_deltas(tokenizer: Any, prompt_ids: list[int], output_ids: list[int]) -> None:
    looked_up = IncrementalDetokenizer(tokenizer, prompt_ids)
    windowed = IncrementalDetokenizer(tokenizer, prompt_ids, use_pieces=False)
    assert looked_up._pieces is not None and windowed._pieces is None
    for token_id in output_ids:
        assert looked_up.push(token_id) == windowed.push(token_id)
    assert looked_up.flush() == windowed.flush()


def test_a_character_begun_in_the_prompt_is_not_looked_up_past(tokenizer: Any) -> None:
    """The prompt ends in the first bytes of a character, a special token (text "") comes, then the
    character's last byte: the lookup must not move the window past the prompt's bytes."""
    first, last = tokenizer.encode("你", add_special_tokens=False)
    assert_same_deltas(tokenizer, [first], [tokenizer.eos_token_id, last])


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_looked_up_pieces_give_the_deltas_of_the_window(tokenizer: Any, data: st.DataObject) -> None:
    """Any ids, bytes that split characters and special tokens included: the same deltas, token by
    token, with the lookup as with two decodes per token."""
    common = tokenizer.encode("Hi, 你好 🎉 ok", add_special_tokens=False) + [tokenizer.eos_token_id, 0, 1, 2]
    some_id = st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(common))
    prompt_ids = data.draw(st.lists(some_id, max_size=6))
    output_ids = data.draw(st.lists(some_id, min_size=1, max_size=30))
    assert_same_deltas(tokenizer, prompt_ids, output_ids)
