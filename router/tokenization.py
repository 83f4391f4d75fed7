"""Prompt handling: the model's tokenizer, its chat template, and the context window."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Sequence
from typing import Any

from router.errors import bad_request

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048
MAX_PROMPT_CHARS = 4 << 20


def _config_max_len(model_dir: pathlib.Path) -> int | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    return None


class PromptProcessor:
    """Turns request prompts into token ids; errors in user input become 400s."""

    def __init__(self, tokenizer: Any, max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_id: int | None = tokenizer.eos_token_id
        limit = getattr(tokenizer, "model_max_length", None)
        fallback = limit if isinstance(limit, int) and 0 < limit < 10_000_000 else DEFAULT_MAX_MODEL_LEN
        self.max_model_len = max_model_len or fallback

    @classmethod
    def from_model_dir(cls, model_dir: pathlib.Path) -> PromptProcessor:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(tokenizer, _config_max_len(model_dir))

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        if not text:
            raise bad_request("prompt must not be empty", param=param)
        if len(text) > MAX_PROMPT_CHARS:
            raise bad_request(f"prompt exceeds {MAX_PROMPT_CHARS} characters", param=param)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def check_token_ids(self, token_ids: Sequence[int], param: str = "prompt") -> list[int]:
        if not token_ids:
            raise bad_request("prompt must not be empty", param=param)
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size})", param=param)
        return list(token_ids)

    def completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
        """One token list per prompt of a (possibly batched) completions ``prompt``."""
        if isinstance(prompt, str):
            return [self.encode(prompt)]
        if all(isinstance(p, int) for p in prompt):
            return [self.check_token_ids(prompt)]  # type: ignore[arg-type]
        result = []
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                result.append(self.encode(item, param=f"prompt.{i}"))
            elif isinstance(item, list):
                result.append(self.check_token_ids(item, param=f"prompt.{i}"))
            else:
                raise bad_request("prompt must be a string, a list of strings or token ids", param="prompt")
        return result

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The model's own chat template with the generation prompt, tokenized without extra BOS."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raises its own errors for unsupported conversations
            raise bad_request(f"could not apply the chat template: {exc}", param="messages") from None
        if len(text) > MAX_PROMPT_CHARS:
            raise bad_request(f"messages exceed {MAX_PROMPT_CHARS} characters", param="messages")
        return list(self.tokenizer.encode(text, add_special_tokens=False))
