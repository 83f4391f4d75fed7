"""Per-request sampling parameters: one typed struct used by the engine and on the wire."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries; OpenAI's own limit
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_ALLOWED_TOKEN_IDS = 1 << 16  # about 200 KB on the wire at most
MAX_BAD_WORDS = 256  # token sequences (a word may give two: with and without a space before it)
MAX_BAD_WORD_TOKENS = 64
# A JSON schema, regex or list of choices as it travels to the engines (one message is at most
# ``MAX_MESSAGE_BYTES``, which leaves 1 MiB beside the token ids).
MAX_STRUCTURED_OUTPUT_CHARS = 1 << 16

StructuredOutputKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]


class StructuredOutput(msgspec.Struct, kw_only=True, frozen=True):
    """What the output must match: ``json_object`` (any JSON object; ``spec`` is empty),
    ``json_schema`` (``spec`` is the schema as JSON text), ``regex`` (``spec`` is the pattern) or
    ``choice`` (``spec`` is a JSON list of the allowed strings) or ``grammar`` (``spec`` is an EBNF
    grammar in xgrammar's dialect, GBNF's: ``name ::= ...`` rules from ``root``) or ``structural_tag`` (``spec`` is
    a structural tag as JSON text, in xgrammar's form: ``{"type": "structural_tag", "format": {...}}``). Hashable:
    engines cache the compiled grammar under it."""

    kind: StructuredOutputKind
    spec: Annotated[str, msgspec.Meta(max_length=MAX_STRUCTURED_OUTPUT_CHARS)] = ""


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives, 0..MAX_LOGPROBS
    # Logprobs of the prompt's tokens (each given the ones before it) with this many top alternatives,
    # 0..MAX_LOGPROBS; computed by the instance that runs the prompt, sent with the first token.
    prompt_logprobs: int | None = None
    # Added to the raw logits before anything else (greedy too); token id -> bias in [-100, 100].
    logit_bias: Annotated[dict[int, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = msgspec.field(
        default_factory=dict
    )
    structured_output: StructuredOutput | None = None
    # vLLM's: only these tokens may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's ``bad_words`` as token sequences (the router tokenizes them): a sequence's last token is
    # banned wherever the output so far ends with the rest of it (a one-token sequence, everywhere).
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    # How the engine schedules it, not how it samples (here because it travels with the request the
    # same way): under ``--scheduling-policy priority``, lower first; must be 0 otherwise.
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), lt=2**31)] = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field; does nothing for valid params."""
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens, got {self.min_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be valid token ids")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {token_id}")
            if not -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not 1 <= len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} ids, got {len(allowed)}")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in allowed):
                raise ValueError(f"allowed_token_ids must be token ids in [0, {vocab_size})")
            if self.min_tokens > 0 and set(allowed) <= set(self.stop_token_ids):
                raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens bans: no token is left")
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words gives at most {MAX_BAD_WORDS} token sequences, got {len(self.bad_words_token_ids)}")
        for word in self.bad_words_token_ids:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad_words must each be 1 to {MAX_BAD_WORD_TOKENS} tokens, got {len(word)}")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in word):
                raise ValueError(f"bad_words token ids must be in [0, {vocab_size})")
        so = self.structured_output
        if so is not None and len(so.spec) > MAX_STRUCTURED_OUTPUT_CHARS:
            raise ValueError(f"structured_output spec holds at most {MAX_STRUCTURED_OUTPUT_CHARS} characters")
