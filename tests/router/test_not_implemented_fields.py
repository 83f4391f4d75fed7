"""Request fields the engine does not implement get a 400 naming them, never a silent ignore."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.router.router_harness import SERVED_MODEL, RouterServer, make_state

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(prompts: Any) -> Iterator[RouterServer]:
    with RouterServer(make_state(prompts, redis_url=None)) as running:
        yield running


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (COMPLETIONS, "logits_processors", ["x"]),
        (COMPLETIONS, "length_penalty", 0.5),
        (COMPLETIONS, "mm_processor_kwargs", {"a": 1}),  # a chat's are its images' (test_mm_processor_kwargs.py)
        (CHAT, "guided_whitespace_pattern", " "),
        (CHAT, "kv_transfer_params", {"do_remote_decode": True}),
        (CHAT, "vllm_xargs", {"a": 1}),
        (CHAT, "prediction", {"type": "content", "content": "x"}),
        (CHAT, "audio", {"voice": "alloy"}),
        (CHAT, "guided_decoding_backend", "outlines"),
        (CHAT, "modalities", ["text", "audio"]),
    ],
)
def test_unimplemented_fields_get_400_naming_them(server: RouterServer, path: str, field: str, value: Any) -> None:
    body: dict[str, Any] = {"model": SERVED_MODEL, field: value, "max_tokens": 4}
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": "Hi"})
    response = httpx.post(f"{server.url}{path}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_the_values_that_ask_for_nothing_are_accepted(server: RouterServer) -> None:
    # Past validation, with no engine to run them: a 503, not a 400.
    body = {"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 4, "use_beam_search": False, "length_penalty": 1.0,
            "spaces_between_special_tokens": True, "priority": 0, "return_tokens_as_token_ids": False,
            "guided_decoding_backend": "xgrammar", "modalities": ["text"]}
    response = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=10)
    assert response.status_code == 503, response.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p"), ({"stop": ["."]}, "stop"),
     ({"n": 11}, "n"), ({"min_tokens": 2}, "min_tokens"), ({"guided_choice": ["a", "b"]}, "guided_choice"),
     ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"top_k": 5}, "top_k"),
     ({"logit_bias": {"5": 1.0}}, "logit_bias"),
     ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty")],
)
def test_beam_search_refuses_what_it_does_not_take(server: RouterServer, extra: dict[str, Any], param: str) -> None:
    """Whatever would change the log-probabilities the search ranks, or draw from them, is refused by name."""
    body = {"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 4, "use_beam_search": True, **extra}
    response = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_beam_search_of_what_it_takes_passes_validation(server: RouterServer) -> None:
    body = {"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 4, "use_beam_search": True, "n": 10,
            "temperature": 0, "top_k": -1, "seed": 3, "length_penalty": -0.5, "logprobs": 20, "echo": True}
    response = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=10)
    assert response.status_code == 503, response.text  # past validation, with no engine to run it


def test_a_beam_search_refuses_a_forced_tool_call(server: RouterServer) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 4, "use_beam_search": True, "tools": [tool],
            "tool_choice": "required"}
    response = httpx.post(f"{server.url}{CHAT}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tool_choice"
