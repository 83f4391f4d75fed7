"""vLLM's ``add_special_tokens`` (completions: on by default; chat: off, the template writes its own),
``spaces_between_special_tokens`` and ``cache_salt`` (a request's own salt under its API key's)."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest

from router.auth import cache_salt_for, with_request_salt
from router.errors import APIError
from router.tokenization import PromptProcessor


@pytest.fixture(scope="module")
def with_bos(tokenizer_dir: pathlib.Path) -> PromptProcessor:
    """The default model's tokenizer, made to add a BOS (``<|endoftext|>``, id 0) as many do."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    return PromptProcessor(tok, max_model_len=256)


def test_completions_add_special_tokens_unless_told_not_to(with_bos: PromptProcessor) -> None:
    [on] = asyncio.run(with_bos.tokenize_completion("Hello there", None))
    [off] = asyncio.run(with_bos.tokenize_completion("Hello there", None, add_special_tokens=False))
    assert on[0] == 0 and on[1:] == off and off[0] != 0
    [ids] = asyncio.run(with_bos.tokenize_completion([5, 6], None, add_special_tokens=True))
    assert ids == [5, 6]  # token ids go as they are


def test_chat_adds_none_beyond_its_template_unless_told(with_bos: PromptProcessor) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    plain = with_bos.chat_prompt(messages)
    added = with_bos.chat_prompt(messages, add_special_tokens=True)
    assert plain[0] != 0 and added == [0, *plain]


def test_spaces_between_special_tokens_false_is_refused_only_where_the_tokenizer_spaces_them(
    prompts: PromptProcessor, tokenizer_dir: pathlib.Path
) -> None:
    import tokenizers.decoders
    from transformers import AutoTokenizer

    # The default model's byte-level decoder writes special tokens side by side: false asks for that.
    assert not prompts.spaces_special_tokens
    prompts.check_special_token_spacing(False)
    # A WordPiece decoder (BERT's) joins every token with a space: false would need a text of its own.
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.backend_tokenizer.decoder = tokenizers.decoders.WordPiece()
    assert tok.decode([1, 2], skip_special_tokens=False) == "<|im_start|> <|im_end|>"
    spaced = PromptProcessor(tok, max_model_len=256)
    assert spaced.spaces_special_tokens
    spaced.check_special_token_spacing(True)
    with pytest.raises(APIError) as refused:
        spaced.check_special_token_spacing(False)
    assert refused.value.status == 400 and refused.value.param == "spaces_between_special_tokens"


def test_a_request_salt_separates_requests_under_one_key_and_without_keys() -> None:
    key = cache_salt_for("key-a")
    assert with_request_salt(key, None) == key and with_request_salt(None, None) is None
    salts = {with_request_salt(k, s) for k in (key, cache_salt_for("key-b"), None) for s in ("x", "y")}
    assert len(salts) == 6 and key not in salts
    assert with_request_salt(key, "x") == with_request_salt(key, "x")
