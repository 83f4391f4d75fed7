"""/tokenize, /detokenize, /version and /v1/models' max_model_len over real HTTP, shaped as vLLM's."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, make_state

KEY = {"authorization": "Bearer secret"}


@pytest.fixture(scope="module")
def server(prompts: Any) -> Iterator[RouterServer]:
    state = make_state(prompts, redis_url=None, api_keys=["secret"])
    with RouterServer(state) as running:
        yield running


def _post(server: RouterServer, path: str, body: Any, headers: dict[str, str] | None = KEY) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=10)


def test_tokenize_a_prompt_gives_the_tokenizers_ids_count_and_context(server: RouterServer, tokenizer: Any) -> None:
    text = "The capital of France is"
    response = _post(server, "/tokenize", {"model": SERVED_MODEL, "prompt": text, "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = list(tokenizer.encode(text, add_special_tokens=True))
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == server.state.max_model_len() == 256
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    plain = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == list(tokenizer.encode(text, add_special_tokens=False)) and plain["token_strs"] is None


def test_tokenize_messages_renders_the_chat_template(server: RouterServer, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    body = _post(server, "/tokenize", {"messages": messages}).json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert body["tokens"] == list(tokenizer.encode(text, add_special_tokens=False))
    without = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < body["count"]


def test_tokenize_counts_a_prompt_longer_than_the_context_instead_of_refusing_it(server: RouterServer) -> None:
    body = _post(server, "/tokenize", {"prompt": "hello world " * 400}).json()
    assert body["count"] > body["max_model_len"]


def test_detokenize_round_trips(server: RouterServer, tokenizer: Any) -> None:
    ids = list(tokenizer.encode("Ça va? 你好 🎉", add_special_tokens=False))
    response = _post(server, "/detokenize", {"model": SERVED_MODEL, "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(
    server: RouterServer, path: str, body: Any, status: int, param: str
) -> None:
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_and_detokenize_need_the_api_key_and_version_does_not(server: RouterServer) -> None:
    assert _post(server, "/tokenize", {"prompt": "a"}, headers=None).status_code == 401
    assert _post(server, "/detokenize", {"tokens": [1]}, headers=None).status_code == 401
    version = httpx.get(f"{server.url}/version")
    assert version.status_code == 200 and version.json()["version"]


def test_models_report_the_engines_max_model_len(redis_url: str, tokenizer: Any) -> None:
    from router.tokenization import PromptProcessor

    namespace = f"models-{uuid.uuid4().hex[:8]}"
    # The tokenizer's own limit is larger: the context the engines report (256) wins.
    prompts = PromptProcessor(tokenizer, max_model_len=4096)
    with FakeCluster(redis_url, namespace, [1, 2, 3]):
        state = make_state(prompts, redis_url=redis_url, namespace=namespace)
        with RouterServer(state) as running:
            running.wait_ready()
            cards = httpx.get(f"{running.url}/v1/models").json()["data"]
            assert [(c["id"], c["max_model_len"]) for c in cards] == [(SERVED_MODEL, 256)]
            assert _post(running, "/tokenize", {"prompt": "hi"}).json()["max_model_len"] == 256
