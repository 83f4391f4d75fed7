"""OpenAI's Conversations API through the router with the openai client, before fake engines over real ZMQ and
Redis: a conversation made, read, changed and deleted, its items added, listed, read and deleted; a response
that continues it (``conversation``) sees its items in its prompt and adds its own input and output items once it
ends, whole, streamed and in background; another API key finds none of it; what cannot be served is refused by
name."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, fake_stack

KEYS = ["key-a", "key-b"]


@pytest.fixture(scope="module")
def stack(redis_url: str, prompts: Any, tokenizer: Any) -> Iterator[tuple[str, FakeCluster]]:
    reply = list(tokenizer.encode(" one two three", add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001}, api_keys=KEYS,
                    request_timeout_s=5.0) as (server, cluster):
        yield server.url, cluster


def _client(stack: tuple[str, FakeCluster], key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[0]}/v1", api_key=key, max_retries=0, timeout=20)


def _texts(items: Any) -> list[tuple[str, str]]:
    """Each message item's role and text."""
    return [(item.role, "".join(part.text for part in item.content)) for item in items if item.type == "message"]


def test_a_conversation_and_its_items_made_read_changed_and_deleted(stack: tuple[str, FakeCluster]) -> None:
    client = _client(stack)
    made = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hello."}],
                                       metadata={"topic": "greeting"})
    assert made.id.startswith("conv_") and made.object == "conversation" and made.metadata == {"topic": "greeting"}
    assert client.conversations.retrieve(made.id).created_at == made.created_at
    assert client.conversations.update(made.id, metadata={"topic": "farewell"}).metadata == {"topic": "farewell"}

    added = client.conversations.items.create(made.id, items=[
        {"type": "message", "role": "assistant", "content": "Hi."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bye."}]}])
    assert [item.id for item in added.data] == [added.first_id, added.last_id]
    newest_first = client.conversations.items.list(made.id)
    assert _texts(newest_first.data) == [("user", "Bye."), ("assistant", "Hi."), ("user", "Hello.")]
    oldest = client.conversations.items.list(made.id, order="asc", limit=1)
    assert _texts(oldest.data) == [("user", "Hello.")] and oldest.has_more
    rest = client.conversations.items.list(made.id, order="asc", after=oldest.data[0].id)
    assert _texts(rest.data) == [("assistant", "Hi."), ("user", "Bye.")] and not rest.has_more
    hi = added.data[0]
    assert client.conversations.items.retrieve(hi.id, conversation_id=made.id).id == hi.id
    assert client.conversations.items.delete(hi.id, conversation_id=made.id).id == made.id
    assert _texts(client.conversations.items.list(made.id, order="asc").data) == [("user", "Hello."), ("user", "Bye.")]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(hi.id, conversation_id=made.id)

    # Another API key finds none of it.
    other = _client(stack, "key-b")
    with pytest.raises(openai.NotFoundError):
        other.conversations.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.conversations.items.list(made.id)
    with pytest.raises(openai.BadRequestError) as not_theirs:
        other.responses.create(model=SERVED_MODEL, input="Hi", conversation=made.id)
    assert not_theirs.value.code == "conversation_not_found"

    deleted = client.conversations.delete(made.id)
    assert deleted.deleted and deleted.id == made.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(made.id)


def test_responses_continue_a_conversation_and_add_their_items_to_it(stack: tuple[str, FakeCluster],
                                                                     tokenizer: Any) -> None:
    """Whole, streamed and in background, a response sees the conversation's items before its input and, once it
    ends, adds its input and its output (with the output's ids) to it; the next sees them all."""
    client, (_, cluster) = _client(stack), stack
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}])

    def prompt() -> str:
        return str(tokenizer.decode(cluster.requests()[-1].prompt_token_ids))

    first = client.responses.create(model=SERVED_MODEL, input="What is my name?", conversation=conversation.id,
                                    max_output_tokens=8)
    assert first.status == "completed" and first.conversation is not None and first.conversation.id == conversation.id
    assert prompt().index("My name is Ada.") < prompt().index("What is my name?")
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert _texts(items) == [("user", "My name is Ada."), ("user", "What is my name?"), ("assistant", " one two three")]
    assert items[-1].id == first.output[0].id

    with client.responses.stream(model=SERVED_MODEL, input="And again?", conversation={"id": conversation.id},
                                 max_output_tokens=8) as stream:
        streamed = stream.get_final_response()
    assert "What is my name?" in prompt() and " one two three" in prompt() and "And again?" in prompt()
    assert streamed.conversation is not None and streamed.conversation.id == conversation.id

    background = client.responses.create(model=SERVED_MODEL, input="Once more.", conversation=conversation.id,
                                         max_output_tokens=8, background=True)
    deadline = time.monotonic() + 60
    while client.responses.retrieve(background.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response did not end"
        time.sleep(0.05)
    deadline = time.monotonic() + 30  # (its items are added right after its record is saved)
    while len(client.conversations.items.list(conversation.id).data) < 7:
        assert time.monotonic() < deadline, "the background response's items did not reach the conversation"
        time.sleep(0.05)
    assert _texts(client.conversations.items.list(conversation.id, order="asc").data) == [
        ("user", "My name is Ada."), ("user", "What is my name?"), ("assistant", " one two three"),
        ("user", "And again?"), ("assistant", " one two three"), ("user", "Once more."), ("assistant", " one two three")]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/conversations", {"items": [{"type": "message", "role": "robot", "content": "x"}]}, "items.0"),
    ("/conversations", {"items": [{"type": "message", "role": "user", "content": "x"}] * 21}, "items"),
    ("/conversations", {"metadata": {"a": 1}}, "metadata.a"),
    ("/conversations", {"items": [{"type": "reasoning", "content": 5}]}, "items.0"),
    ("/responses", {"model": SERVED_MODEL, "input": "x", "conversation": 7}, "conversation"),
    ("/responses", {"model": SERVED_MODEL, "input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"},
     "conversation"),
    ("/responses", {"model": SERVED_MODEL, "input": "x", "conversation": "conv_none"}, "conversation"),
])
def test_what_cannot_be_served_is_refused_by_name(stack: tuple[str, FakeCluster], path: str, body: dict[str, Any],
                                                  param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _client(stack).post(path, body=body, cast_to=object)
    assert refused.value.param == param


def test_items_asked_for_more_than_is_stored_are_refused(stack: tuple[str, FakeCluster]) -> None:
    """``include`` asks for what is not kept here (log-probabilities, encrypted thinking): a 400 naming it, for a
    conversation's items and a response's input items alike, through the openai client's own query form."""
    client = _client(stack)
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}])
    [item] = client.conversations.items.list(conversation.id).data
    for call in (lambda: client.conversations.items.list(conversation.id, include=["message.output_text.logprobs"]),
                 lambda: client.conversations.items.retrieve(item.id, conversation_id=conversation.id,
                                                             include=["reasoning.encrypted_content"]),
                 lambda: client.conversations.items.create(conversation.id, items=[], include=["x"]),
                 lambda: client.responses.input_items.list("resp_1", include=["message.output_text.logprobs"])):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == "include"
    plain = httpx.get(f"{stack[0]}/v1/conversations/{conversation.id}/items", params={"include": "x"},
                      headers={"Authorization": "Bearer key-a"}, timeout=20)  # (the plain query form)
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "include", plain.text
