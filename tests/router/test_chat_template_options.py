"""vLLM's chat-template extras, through ``/tokenize`` (the rendered prompt's exact ids) and chat
completions: ``chat_template_kwargs`` reach the template, ``add_generation_prompt`` and
``continue_final_message`` change how the conversation ends, and what the template cannot take is a
400 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from router.tokenization import PromptProcessor
from tests.router.router_harness import SERVED_MODEL, RouterServer, make_state

# ChatML, with a variable of its own and the generation prompt as HF's templates write it.
TEMPLATE = (
    "{% for d in documents or [] %}<|im_start|>system\nSource {{ d.title }}: {{ d.text }}<|im_end|>\n{% endfor %}"
    "{% if style is defined %}<|im_start|>system\nAnswer in a {{ style }} style.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}{{ '\\n' }}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tokenizer: Any) -> Iterator[RouterServer]:
    prompts = PromptProcessor(tokenizer, max_model_len=2048, chat_template=TEMPLATE)
    with RouterServer(make_state(prompts, redis_url=None)) as running:
        yield running


def _rendered(server: RouterServer, tokenizer: Any, **body: Any) -> str:
    response = httpx.post(f"{server.url}/tokenize", json={"model": SERVED_MODEL, **body}, timeout=10)
    assert response.status_code == 200, response.text
    return str(tokenizer.decode(response.json()["tokens"]))


def test_template_kwargs_and_the_conversations_end(server: RouterServer, tokenizer: Any) -> None:
    plain = _rendered(server, tokenizer, messages=MESSAGES)
    assert plain == "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    styled = _rendered(server, tokenizer, messages=MESSAGES, chat_template_kwargs={"style": "terse"})
    assert styled == "<|im_start|>system\nAnswer in a terse style.<|im_end|>\n" + plain
    documents = [{"title": "Paint", "text": "Blue is a colour."}]
    sourced = _rendered(server, tokenizer, messages=MESSAGES, documents=documents)
    assert sourced == "<|im_start|>system\nSource Paint: Blue is a colour.<|im_end|>\n" + plain
    assert _rendered(server, tokenizer, messages=MESSAGES, add_generation_prompt=False) == (
        "<|im_start|>user\nName a colour.<|im_end|>\n")
    named = [{"role": "user", "content": "Hi", "name": "ann"},
             {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."}]
    assert _rendered(server, tokenizer, messages=named, add_generation_prompt=False) == (
        "<|im_start|>user (ann)\nHi<|im_end|>\n<|im_start|>assistant\n<think>Greet back.</think>Hello.<|im_end|>\n")
    started = [*MESSAGES, {"role": "assistant", "content": "My favourite is"}]
    continued = _rendered(server, tokenizer, messages=started, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nMy favourite is")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
        ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # last: user
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": ["style"]}, "chat_template_kwargs"),
    ],
)
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_what_the_template_cannot_take_is_a_400(server: RouterServer, path: str, body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{server.url}{path}", json={"model": SERVED_MODEL, "messages": MESSAGES, **body}, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(
    ("field", "value"),
    [("functions", [{"name": "f"}]), ("function_call", "auto"), ("chat_template", "{{ 7 * 7 }}")],
)
def test_chat_fields_not_served_are_refused_not_ignored(server: RouterServer, field: str, value: Any) -> None:
    body = {"model": SERVED_MODEL, "messages": MESSAGES, field: value}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
