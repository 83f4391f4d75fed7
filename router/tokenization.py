"""Prompt handling: the model's tokenizer, its chat template, and the context window.

Tokenizing is the one piece of a request's work that grows with the prompt (a few seconds for a few
million characters), so it runs in worker threads, never on the event loop that streams every other
response; the tokenizer's native ``encode`` releases the GIL while it works. Long texts have their
own threads, so a burst of them queues behind itself, not ahead of everyone's short prompts. Texts
under ``INLINE_TEXT_CHARS`` are the exception: tokenizing one costs less than the hop to a thread.
Before a text is tokenized, its length in characters is held against the context window: a text
too long to fit whatever its tokens is refused at once (see ``router/token_bound.py``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import pathlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from router.errors import bad_request
from router.openai_models import ChatRender, PromptInput
from router.token_bound import token_bound

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048
MAX_PROMPT_CHARS = 4 << 20
MAX_BAD_WORD_CHARS = 256
DEFAULT_TOKENIZER_THREADS = min(4, os.cpu_count() or 1)  # per lane: short texts, long texts
LONG_TEXT_CHARS = 64 << 10  # from here on a text takes tens of milliseconds or more to tokenize
# Below this a text is tokenized on the event loop: the hop to a worker thread and back costs the
# router about 100 us of CPU, as much as tokenizing such a text (80-150 us on the 2-core host).
INLINE_TEXT_CHARS = 256

T = TypeVar("T")


def _config_max_len(model_dir: pathlib.Path) -> int | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    # An image-text checkpoint's language model says it in its own config (Gemma 3, Mistral 3, Qwen-VL).
    for fields in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
            if isinstance(fields.get(key), int) and fields[key] > 0:
                return int(fields[key])
    return None


def _model_eos_token_ids(model_dir: pathlib.Path) -> list[int]:
    """The end-of-sequence tokens the model's ``config.json`` and ``generation_config.json`` name (an engine
    stops on each: gpt-oss's ``<|call|>``, Llama 3's ``<|eot_id|>`` where the tokenizer's is another)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            config = json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(config, dict):
            continue
        text_config = config.get("text_config")  # an image-text checkpoint's language model's
        for eos in (config.get("eos_token_id"), text_config.get("eos_token_id") if isinstance(text_config, dict) else None):
            for token in eos if isinstance(eos, list) else [eos]:
                if isinstance(token, int) and not isinstance(token, bool) and token not in ids:
                    ids.append(token)
    return ids


_PLAIN = ChatRender()


def _num_chat_chars(messages: list[dict[str, Any]], render: ChatRender) -> int:
    """About the length of a conversation's text (the template adds little): to choose its thread."""
    num_chars = sum(len(str(m.get("content") or "")) for m in messages)
    if render.tools or render.kwargs or render.documents:
        num_chars += len(json.dumps([render.tools, render.kwargs, render.documents], default=str))
    return num_chars


# Chat templates shipped with the router, by the name ``--chat-template`` takes.
CHAT_TEMPLATES_DIR = pathlib.Path(__file__).parent / "chat_templates"


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's path, or the name of one shipped (``chat_templates/NAME.jinja``),
    read; None leaves the tokenizer's own. ``ValueError`` naming what it looked for otherwise."""
    if value is None:
        return None
    for path in (pathlib.Path(value), CHAT_TEMPLATES_DIR / f"{value}.jinja"):
        if path.is_file():
            return path.read_text()
    shipped = sorted(p.stem for p in CHAT_TEMPLATES_DIR.glob("*.jinja"))
    raise ValueError(f"chat template {value!r} is neither a file nor one shipped ({', '.join(shipped)})")


class PromptProcessor:
    """Turns request prompts into token ids; errors in user input become 400s.

    The ``tokenize_*`` coroutines do the tokenizing in worker threads (short texts at once); the
    other methods run where they are called (``chat_prompt`` and ``encode`` block for as long as
    the text takes)."""

    def __init__(
        self, tokenizer: Any, max_model_len: int | None = None, num_threads: int = DEFAULT_TOKENIZER_THREADS,
        chat_template: str | None = None, model_eos_token_ids: Sequence[int] = (),
    ) -> None:
        """``model_eos_token_ids``: the ends of sequence the model's configs name beside the tokenizer's."""
        self.tokenizer = tokenizer
        # The template given on the command line (``--chat-template``), else the tokenizer's own (None).
        self.chat_template = chat_template
        self._renders_tools: bool | None = None
        self.vocab_size = len(tokenizer)
        # Every token an engine ends a sequence on (the tokenizer's and the model's configs'): what a request stops
        # on unless it ignores them, and a stop whose token's text the answer leaves out.
        # (One past the tokenizer's vocabulary is no request's to name.)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            token for token in [tokenizer.eos_token_id, *model_eos_token_ids]
            if isinstance(token, int) and 0 <= token < self.vocab_size))
        limit = getattr(tokenizer, "model_max_length", None)
        fallback = limit if isinstance(limit, int) and 0 < limit < 10_000_000 else DEFAULT_MAX_MODEL_LEN
        self.max_model_len = max_model_len or fallback
        self.token_bound = token_bound(tokenizer)
        if self.token_bound is None:
            logger.info(
                "this tokenizer may drop or merge characters: prompts are measured by tokenizing them"
            )
        # Threads of its own: tokenizing must not queue the default executor's work (Redis calls).
        num_threads = max(1, num_threads)
        self._short_lane = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer-short")
        self._long_lane = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer-long")

    @classmethod
    def from_model_dir(cls, model_dir: pathlib.Path, chat_template: str | None = None) -> PromptProcessor:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(tokenizer, _config_max_len(model_dir), chat_template=chat_template,
                   model_eos_token_ids=_model_eos_token_ids(model_dir))

    @functools.cached_property
    def _vocab(self) -> dict[str, int]:
        return dict(self.tokenizer.get_vocab())

    def is_token(self, token: str | int) -> bool:
        """Whether ``token`` (a token's string or id) is one token of this tokenizer's."""
        return 0 <= token < self.vocab_size if isinstance(token, int) else token in self._vocab

    def lost_in_text(self, tags: tuple[str, ...]) -> list[str]:
        """Those of ``tags`` that streamed text leaves out: the tokenizer marks them special tokens,
        which detokenizing skips, so a parser looking for them would never see them."""
        return [tag for tag in tags
                if tag not in self.tokenizer.decode(self.tokenizer.encode(tag, add_special_tokens=False),
                                                    skip_special_tokens=True)]

    def template_text(self) -> str | None:
        """The chat template's source (all of them, where the tokenizer has several by name)."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            return "\n".join(str(t) for t in template.values())
        return template if isinstance(template, str) else None

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the model the ``tools`` it is given: a template that
        leaves them out would have the model answer without knowing them."""
        if self._renders_tools is None:
            probe = "pdserve_probe_function_5e1f"
            parameters = {"type": "object", "properties": {"x": {"type": "string", "description": "x"}},
                          "required": ["x"]}
            tools = [{"type": "function", "function": {"name": probe, "description": "A probe", "parameters": parameters}}]
            try:
                text = self._render([{"role": "user", "content": "hi"}], ChatRender(tools))
            except Exception:
                text = ""
            self._renders_tools = probe in text
        return self._renders_tools

    def _render(self, messages: list[dict[str, Any]], render: ChatRender) -> str:
        text = str(self.tokenizer.apply_chat_template(
            messages, tools=render.tools, documents=render.documents, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=render.add_generation_prompt, continue_final_message=render.continue_final_message,
            **render.kwargs,
        ))
        return text

    def _rendered(self, messages: list[dict[str, Any]], render: ChatRender) -> str:
        """``_render``, a 400 where the template raises; then the images' text expanded (``ChatRender.image_text``,
        its own 400s)."""
        try:
            text = self._render(messages, render)
        except Exception as exc:  # jinja raises its own errors for unsupported conversations
            raise bad_request(f"could not apply the chat template: {exc}", param="messages") from None
        return text if render.image_text is None else render.image_text(text)

    def check_length(self, text: str, max_model_len: int | None, param: str = "prompt") -> None:
        """A 400 for a text over ``MAX_PROMPT_CHARS``, or with so many characters that its tokens
        cannot fit ``max_model_len`` (None: no context check). Never refuses a text that would fit:
        the token bound is a lower bound on the tokens of any text."""
        if len(text) > MAX_PROMPT_CHARS:
            raise bad_request(f"{param} exceeds {MAX_PROMPT_CHARS} characters", param=param)
        bound = self.token_bound
        if (
            bound is None
            or max_model_len is None
            or len(text) <= (max_model_len - 1) * bound.max_chars_per_token
        ):
            return  # (the common case, decided without counting anything)
        min_num_tokens = bound.min_num_tokens(text)
        if min_num_tokens < max_model_len:
            return
        raise bad_request(
            f"the prompt has {len(text)} characters, so at least {min_num_tokens} tokens (a token of this "
            f"model stands for at most {bound.max_chars_per_token} characters), but this model's maximum "
            f"context length is {max_model_len} tokens",
            param=param,
            code="context_length_exceeded",
        )

    def encode(
        self, text: str, param: str = "prompt", max_model_len: int | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        if not text:
            raise bad_request("prompt must not be empty", param=param)
        self.check_length(text, max_model_len, param)
        token_ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if not token_ids:  # every character was one the tokenizer drops
            raise bad_request("prompt has no tokens", param=param)
        return token_ids

    @functools.cached_property
    def spaces_special_tokens(self) -> bool:
        """Whether this tokenizer's decode puts anything between adjacent special tokens (a
        sentencepiece-style decoder may space them apart): then ``spaces_between_special_tokens:
        false``, which asks for their texts side by side, would need a text of its own."""
        special = list(getattr(self.tokenizer, "all_special_ids", None) or [])[:2]
        if not special:
            return False
        ids = [special[0], special[-1], special[0]]
        text = str(self.tokenizer.decode(ids, skip_special_tokens=False))
        return text != "".join(self.tokenizer.convert_ids_to_tokens(ids))

    def check_special_token_spacing(self, spaces_between_special_tokens: bool) -> None:
        """A 400 for ``spaces_between_special_tokens: false`` where the tokenizer spaces special
        tokens apart; elsewhere false asks for the text the detokenizer writes anyway."""
        if not spaces_between_special_tokens and self.spaces_special_tokens:
            raise bad_request("spaces_between_special_tokens: false is not implemented for this model's "
                              "tokenizer, which spaces special tokens apart", param="spaces_between_special_tokens")

    def bad_word_sequences(self, words: list[str] | None) -> list[list[int]]:
        """The token sequences ``bad_words`` ban (vLLM's rule): each word as it starts a text, and
        again after a space where that makes other tokens of the same number (the word in the middle
        of a text); leading whitespace of a word is dropped. Short texts: tokenized where called."""
        sequences: list[list[int]] = []
        for word in words or ():
            word = word.lstrip()
            if not word or len(word) > MAX_BAD_WORD_CHARS:
                raise bad_request(f"each of bad_words must be 1 to {MAX_BAD_WORD_CHARS} characters (leading "
                                  "whitespace dropped)", param="bad_words")
            alone = list(self.tokenizer.encode(word, add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word, add_special_tokens=False))
            if not alone:
                raise bad_request(f"bad word {word!r} has no tokens", param="bad_words")
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return sequences

    def check_token_ids(self, token_ids: Sequence[int], param: str = "prompt") -> list[int]:
        if not token_ids:
            raise bad_request("prompt must not be empty", param=param)
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:  # builtins: fast on long lists
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size})", param=param)
        return list(token_ids)

    async def tokenize_completion(
        self, prompt: PromptInput, max_model_len: int | None, add_special_tokens: bool = True, field: str = "prompt"
    ) -> list[list[int]]:
        """One token list per prompt of a (possibly batched) completions ``prompt``. Every check
        that needs no tokenizer runs first, so a bad request is refused before any text is
        tokenized; then all texts are tokenized in one worker job. ``max_model_len`` None: no
        context check. ``add_special_tokens`` (vLLM's): the tokenizer's BOS and the like around each
        text (token ids are taken as they are). ``field``: the request's name for ``prompt``, in errors."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
            params = [field]
        elif prompt and isinstance(prompt[0], int):
            items, params = [prompt], [field]
        else:
            items, params = list(prompt), [f"{field}.{i}" for i in range(len(prompt))]

        def check_all() -> list[str | list[int]]:
            checked: list[str | list[int]] = []  # texts still to tokenize, or checked token ids
            for item, param in zip(items, params, strict=True):
                if isinstance(item, str):
                    if not item:
                        raise bad_request(f"{field} must not be empty", param=param)
                    self.check_length(item, max_model_len, param)
                    checked.append(item)
                elif isinstance(item, list) and all(isinstance(t, int) for t in item[:1]):
                    checked.append(self.check_token_ids(item, param=param))
                else:
                    raise bad_request(f"{field} must be a string, a list of strings or token ids", param=field)
            return checked

        # A long prompt list takes a while to check: off the event loop, which serves the others.
        checked = await asyncio.to_thread(check_all) if len(items) > 256 else check_all()
        texts = [(item, param) for item, param in zip(checked, params, strict=True) if isinstance(item, str)]
        if not texts:
            return checked  # type: ignore[return-value]  # token ids only

        def encode_all() -> list[list[int]]:
            return [self.encode(text, param, add_special_tokens=add_special_tokens) for text, param in texts]

        encoded = iter(await self._off_loop(encode_all, sum(len(text) for text, _ in texts)))
        return [next(encoded) if isinstance(item, str) else item for item in checked]

    async def tokenize_pairs(
        self, pairs: list[tuple[str, str]], max_model_len: int, params: tuple[str, str],
        truncate: int | None = None, join: bool = False,
    ) -> list[list[int]]:
        """Each pair's token ids as the tokenizer encodes a text with its ``text_pair`` (a cross-encoder's
        input: its special tokens around and between them, as transformers' tokenizer call gives), or with
        ``join`` the two texts joined into one, in one worker job. ``truncate``: at most that many tokens,
        the longer text cut first (the tokenizer's ``longest_first``, as sentence-transformers'
        cross-encoders truncate; a joined text loses its end); else a pair too long for ``max_model_len`` is
        refused. ``params``: the two sides' names, in errors."""
        for i, pair in enumerate(pairs):
            for text, param in zip(pair, params, strict=True):
                self.check_length(text, None if truncate is not None else max_model_len, f"{param} (pair {i})")

        def encode_all() -> list[list[int]]:
            options: dict[str, Any] = {} if truncate is None else {"truncation": True, "max_length": truncate}
            if join:
                return [list(self.tokenizer(first + second, **options)["input_ids"]) for first, second in pairs]
            return [list(self.tokenizer(first, text_pair=second, **options)["input_ids"]) for first, second in pairs]

        return await self._off_loop(encode_all, sum(len(a) + len(b) for a, b in pairs))

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], max_model_len: int | None, render: ChatRender = _PLAIN,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """``chat_prompt``, in a worker thread unless the messages are short."""
        return await self._off_loop(lambda: self.chat_prompt(messages, max_model_len, render, add_special_tokens),
                                    _num_chat_chars(messages, render))

    def chat_prompt(
        self, messages: list[dict[str, Any]], max_model_len: int | None = None, render: ChatRender = _PLAIN,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The chat template as ``render`` says (by default with the generation prompt), tokenized
        without extra BOS (``add_special_tokens``, vLLM's chat extra: with the tokenizer's BOS and the
        like on top of the template's). The length check holds the rendered text: a template may
        leave parts of messages out."""
        text = self._rendered(messages, render)
        self.check_length(text, max_model_len, "messages")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def tokenize_for_count(
        self, text: str | None, messages: list[dict[str, Any]] | None, *, add_special_tokens: bool,
        render: ChatRender = _PLAIN,
    ) -> list[int]:
        """The token ids of ``text``, or of ``messages`` rendered by the chat template, in a worker
        thread unless short; no context-length check (``/tokenize`` is how a client finds the
        length out)."""
        if text is not None:
            self.check_length(text, None)
            return await self._off_loop(
                lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)), len(text)
            )

        def render_and_encode() -> list[int]:
            rendered = self._rendered(messages or [], render)
            self.check_length(rendered, None, "messages")
            return list(self.tokenizer.encode(rendered, add_special_tokens=add_special_tokens))

        return await self._off_loop(render_and_encode, _num_chat_chars(messages or [], render))

    async def detokenize(self, token_ids: list[int], param: str = "tokens") -> str:
        """The text of ``token_ids`` (special tokens kept), in a worker thread unless few; 400 for ids
        out of range."""
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):
            raise bad_request(f"token ids must be in [0, {self.vocab_size})", param=param)
        return await self._off_loop(lambda: str(self.tokenizer.decode(token_ids)), 4 * len(token_ids))

    async def _off_loop(self, work: Callable[[], T], num_chars: int) -> T:
        """``work`` on ``num_chars`` of text: in a worker thread (the tokenizer releases the GIL
        while it encodes, so the loop serves the others meanwhile), or at once under
        ``INLINE_TEXT_CHARS``."""
        if num_chars < INLINE_TEXT_CHARS:
            return work()
        lane = self._long_lane if num_chars >= LONG_TEXT_CHARS else self._short_lane
        return await asyncio.get_running_loop().run_in_executor(lane, work)
