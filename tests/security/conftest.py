"""The router tests' tokenizer fixtures, for the security tests that run a real router."""

from tests.router.conftest import prompts, tokenizer, tokenizer_dir

__all__ = ["prompts", "tokenizer", "tokenizer_dir"]
