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
        (CHAT, "guided_grammar", "root ::= 'a'"),
        (CHAT, "structured_outputs", {"json": {"type": "object"}}),
    ],
)
def test_unimplemented_fields_get_400_naming_them(server: RouterServer, path: str, field: str, value: Any) -> None:
    body: dict[str, Any] = {"model": SERVED_MODEL, field: value, "max_tokens": 4}
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": "Hi"})
    response = httpx.post(f"{server.url}{path}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
