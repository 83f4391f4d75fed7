"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``,
``.../input_items``) through the router with the openai client, before fake engines and a real
Redis: a conversation continued whole and streamed, what each API key may see, another router
process on the same Redis, a store that goes down and comes back, the TTL, and records tampered
with in Redis under a cluster key."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import redis

from common.cluster_key import ClusterKey
from router.response_store import ResponseStore, StoredResponse
from tests.conftest import RedisServer
from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, fake_stack, make_state, wait_until

REPLY = " one two three"
TTL_S = 600


def _client(server: RouterServer, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def stack(redis_url: str, prompts: Any, tokenizer: Any) -> Iterator[tuple[RouterServer, FakeCluster]]:
    reply = list(tokenizer.encode(REPLY, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001}, request_timeout_s=5.0,
                    api_keys=["key-a", "key-b"], response_ttl_s=TTL_S) as (server, cluster):
        yield server, cluster


def _prompt(cluster: FakeCluster, tokenizer: Any) -> str:
    return str(tokenizer.decode(cluster.requests()[-1].prompt_token_ids))


def test_a_conversation_goes_on_from_a_stored_response_whole_and_streamed(
    stack: tuple[RouterServer, FakeCluster], tokenizer: Any,
) -> None:
    server, cluster = stack
    client = _client(server)
    first = client.responses.create(model=SERVED_MODEL, instructions="FIRST-RULES", input="My name is Ada.",
                                    max_output_tokens=10)
    assert first.store is True and first.output_text == REPLY and first.previous_response_id is None
    with client.responses.stream(model=SERVED_MODEL, instructions="SECOND-RULES", input="What is my name?",
                                 previous_response_id=first.id, max_output_tokens=10) as stream:
        events = list(stream)
        second = stream.get_final_response()
    assert events[0].response.store is True and second.store is True  # type: ignore[union-attr]
    assert second.previous_response_id == first.id
    prompt = _prompt(cluster, tokenizer)
    # The earlier turn, its answer, then this one; the earlier instructions are not carried over.
    assert prompt.index("My name is Ada.") < prompt.index(REPLY) < prompt.index("What is my name?"), prompt
    assert "SECOND-RULES" in prompt and "FIRST-RULES" not in prompt
    # The streamed response was stored before its last event: it can be continued at once.
    third = client.responses.create(model=SERVED_MODEL, input="And again?", previous_response_id=second.id,
                                    max_output_tokens=10)
    prompt = _prompt(cluster, tokenizer)
    assert prompt.index("My name is Ada.") < prompt.index("What is my name?") < prompt.index("And again?")
    assert prompt.count(REPLY) == 2
    stored = client.responses.retrieve(third.id)
    assert stored.model_dump() == third.model_dump()
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_input_items_are_listed_by_page_in_either_order(stack: tuple[RouterServer, FakeCluster]) -> None:
    server, _ = stack
    client = _client(server)
    first = client.responses.create(model=SERVED_MODEL, input="One.", max_output_tokens=10)
    second = client.responses.create(model=SERVED_MODEL, input=[
        {"type": "message", "role": "user", "content": "Two."},
        {"type": "message", "id": "msg_mine", "role": "user", "content": [{"type": "input_text", "text": "Three."}]},
    ], previous_response_id=first.id, max_output_tokens=10)
    newest_first = client.responses.input_items.list(second.id)
    texts = [item.content[0].text for item in newest_first.data]  # type: ignore[union-attr]
    assert texts == ["Three.", "Two.", REPLY, "One."] and not newest_first.has_more
    assert newest_first.data[0].id == "msg_mine" and newest_first.data[2].id == first.output[0].id
    assert len({item.id for item in newest_first.data}) == 4
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [item.id for item in page.data] == [item.id for item in reversed(newest_first.data)][:2] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", limit=2, after=page.data[-1].id)
    assert [item.id for item in rest.data] == [newest_first.data[1].id, "msg_mine"] and not rest.has_more
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_items.list(second.id, limit=0)
    assert refused.value.body["param"] == "limit"  # type: ignore[index]


def test_a_response_is_its_api_key_s_and_deleted_is_gone(stack: tuple[RouterServer, FakeCluster]) -> None:
    server, _ = stack
    mine, theirs = _client(server, "key-a"), _client(server, "key-b")
    response = mine.responses.create(model=SERVED_MODEL, input="Secret.", max_output_tokens=10)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(response.id)
    with pytest.raises(openai.BadRequestError) as refused:
        theirs.responses.create(model=SERVED_MODEL, input="Go on.", previous_response_id=response.id)
    assert refused.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    assert mine.responses.retrieve(response.id).id == response.id  # still there: theirs could not delete it
    deleted = mine.delete(f"/responses/{response.id}", cast_to=object)
    assert deleted == {"id": response.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.delete(response.id)
    for odd in ("resp:*", "x" * 129):  # never a key name
        with pytest.raises(openai.NotFoundError):
            mine.responses.retrieve(odd)
    with pytest.raises(openai.BadRequestError) as refused:
        mine.responses.create(model=SERVED_MODEL, input="Go on.", previous_response_id=response.id)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_store_false_keeps_nothing_and_the_ttl_is_set(
    stack: tuple[RouterServer, FakeCluster], redis_url: str,
) -> None:
    server, _ = stack
    client = _client(server)
    kept = client.responses.create(model=SERVED_MODEL, input="Keep.", max_output_tokens=10)
    unkept = client.responses.create(model=SERVED_MODEL, input="Forget.", store=False, max_output_tokens=10)
    assert kept.store is True and unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    namespace = server.state.config.namespace
    rc = redis.Redis.from_url(redis_url)
    try:
        assert 0 < rc.ttl(f"{namespace}:response:{kept.id}") <= TTL_S
        assert not rc.exists(f"{namespace}:response:{unkept.id}")
    finally:
        rc.close()


def test_another_router_on_the_same_redis_continues_the_conversation(
    stack: tuple[RouterServer, FakeCluster], prompts: Any, redis_url: str, tokenizer: Any,
) -> None:
    server, cluster = stack
    response = _client(server).responses.create(model=SERVED_MODEL, input="Remember 42.", max_output_tokens=10)
    other_state = make_state(prompts, redis_url=redis_url, namespace=server.state.config.namespace,
                             api_keys=["key-a", "key-b"], request_timeout_s=5.0)
    with RouterServer(other_state) as other:
        other.wait_ready(prefill=1, decode=1)
        client = _client(other)
        assert client.responses.retrieve(response.id).output_text == REPLY
        client.responses.create(model=SERVED_MODEL, input="Which number?", previous_response_id=response.id,
                                max_output_tokens=10)
        assert "Remember 42." in _prompt(cluster, tokenizer)


def test_without_a_store_nothing_is_stored_and_going_on_is_refused_by_name(
    redis_url: str, prompts: Any, tokenizer: Any,
) -> None:
    reply = list(tokenizer.encode(REPLY, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001}, response_ttl_s=0) as (server, _):
        client = _client(server)
        response = client.responses.create(model=SERVED_MODEL, input="Hi.", max_output_tokens=10)
        assert response.store is False
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(response.id)
        assert "stores no responses" in str(missing.value)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=SERVED_MODEL, input="Hi.", previous_response_id=response.id)
        assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert "--response-ttl" in refused.value.body["message"]  # type: ignore[index]
        # Nor are conversations kept.
        with pytest.raises(openai.NotFoundError) as no_conversations:
            client.conversations.create()
        assert "keeps no conversations" in str(no_conversations.value)
        with pytest.raises(openai.BadRequestError) as going_on:
            client.responses.create(model=SERVED_MODEL, input="Hi.", conversation="conv_1")
        assert going_on.value.body["param"] == "conversation"  # type: ignore[index]


def test_a_store_down_answers_unstored_or_503_and_comes_back(
    redis_url: str, prompts: Any, tokenizer: Any, make_redis_server: Callable[..., RedisServer],
) -> None:
    store = make_redis_server()
    reply = list(tokenizer.encode(REPLY, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001}, request_timeout_s=5.0,
                    response_store_url=store.url) as (server, _):
        client = _client(server)
        kept = client.responses.create(model=SERVED_MODEL, input="Before.", max_output_tokens=10)
        port = store.port
        store.stop()
        # The answer still comes, saying it was not stored; what needs the store is a 503.
        unkept = client.responses.create(model=SERVED_MODEL, input="During.", max_output_tokens=10)
        assert unkept.output_text == REPLY and unkept.store is False
        events = list(client.responses.create(model=SERVED_MODEL, input="During.", max_output_tokens=10, stream=True))
        assert events[-1].type == "response.completed" and events[-1].response.store is False  # type: ignore[union-attr]
        with pytest.raises(openai.InternalServerError) as down:
            client.responses.retrieve(kept.id)
        assert down.value.status_code == 503
        with pytest.raises(openai.InternalServerError):
            client.responses.create(model=SERVED_MODEL, input="Go on.", previous_response_id=kept.id)
        make_redis_server(port=port)  # back, empty (no persistence): new responses are stored again

        def stored_again() -> bool:
            response = client.responses.create(model=SERVED_MODEL, input="After.", max_output_tokens=10)
            return bool(response.store)

        assert wait_until(stored_again, 30)


def _record(response_id: str, text: str) -> StoredResponse:
    return StoredResponse("", {"id": response_id, "output": [{"type": "message", "text": text}]},
                          [{"type": "message", "role": "user", "content": "hi"}])


def test_under_a_cluster_key_a_record_not_written_with_it_is_not_believed(redis_url: str) -> None:
    namespace = f"store-{uuid.uuid4().hex[:8]}"
    key = ClusterKey.generate()
    keyed = ResponseStore(redis_url, namespace, TTL_S, key)
    unkeyed = ResponseStore(redis_url, namespace, TTL_S)
    rc = redis.Redis.from_url(redis_url)

    async def run() -> None:
        assert await keyed.save(_record("resp_signed", "true words"))
        loaded = await keyed.load("resp_signed", "")
        assert loaded is not None and loaded.response["output"][0]["text"] == "true words"
        assert await keyed.load("resp_signed", "someone-else") is None
        # Rewritten in Redis by whoever can write it, without the key: not believed.
        name = f"{namespace}:response:resp_signed"
        raw = rc.get(name)
        assert isinstance(raw, bytes)
        rc.set(name, raw.replace(b"true words", b"false words"))
        assert await keyed.load("resp_signed", "") is None
        assert await unkeyed.save(_record("resp_plain", "unsigned words"))
        assert await keyed.load("resp_plain", "") is None
        assert (await unkeyed.load("resp_plain", "")) is not None
        # A record copied under another response's name is not that response.
        rc.set(f"{namespace}:response:resp_copy", rc.get(f"{namespace}:response:resp_plain") or b"")
        assert await unkeyed.load("resp_copy", "") is None

    try:
        asyncio.run(run())
    finally:
        keyed.close()
        unkeyed.close()
        rc.close()


def test_under_a_cluster_key_an_event_log_altered_or_reordered_is_read_up_to_the_change(redis_url: str) -> None:
    """A streaming background response's events: read back after any number; with a cluster key, an event
    rewritten, or two swapped, ends the read where the log stops being the one written."""
    namespace = f"store-{uuid.uuid4().hex[:8]}"
    keyed = ResponseStore(redis_url, namespace, TTL_S, ClusterKey.generate())
    rc = redis.Redis.from_url(redis_url)
    events = [f'{{"type":"e","sequence_number":{i}}}'.encode() for i in range(6)]

    async def run() -> None:
        assert await keyed.append_events("resp_log", 0, events[:4]) and await keyed.append_events("resp_log", 4, events[4:])
        assert await keyed.read_events("resp_log", -1) == events
        assert await keyed.read_events("resp_log", 2) == events[3:]
        assert await keyed.read_events("resp_log", 5) == [] and await keyed.read_events("bad id!", -1) == []
        name = f"{namespace}:response-events:resp_log"
        assert 0 < (rc.ttl(name) or 0) <= TTL_S  # it expires with the record
        third, fourth = rc.lindex(name, 3), rc.lindex(name, 4)
        assert isinstance(third, bytes) and isinstance(fourth, bytes)
        rc.lset(name, 3, fourth)
        rc.lset(name, 4, third)
        assert await keyed.read_events("resp_log", -1) == events[:3]  # swapped: read up to them
        rc.lset(name, 3, third.replace(b'"e"', b'"x"'))
        assert await keyed.read_events("resp_log", 2) == []  # rewritten

    try:
        asyncio.run(run())
    finally:
        keyed.close()
        rc.close()


def test_an_update_reads_again_when_another_writer_changed_the_record_between_its_read_and_write(
    redis_url: str,
) -> None:
    """The lost update CI once met: a background response's lease renewal read its record running, a cancel was
    saved, and the renewal wrote the running record back over it (the cancel undone, the response run on).
    Here another writer cancels between the renewal's read and its write: the renewal reads again, finds it
    cancelled, and leaves it; under a cluster key too. Another owner's record is not touched."""
    import msgspec

    from router.background_responses import leased, running

    namespace = f"store-{uuid.uuid4().hex[:8]}"
    key = ClusterKey.generate()
    store, other = ResponseStore(redis_url, namespace, TTL_S, key), ResponseStore(redis_url, namespace, TTL_S, key)
    record = StoredResponse("owner", {"id": "resp_race", "status": "in_progress", "background": True}, [])
    seen: list[str] = []

    def renew(current: StoredResponse) -> StoredResponse | None:
        seen.append(current.response["status"])
        if len(seen) == 1:  # another router process cancels it now (this runs in the store's thread)
            asyncio.run(other.save(msgspec.structs.replace(
                current, response={**current.response, "status": "cancelled"})))
        return leased(current) if running(current) else None

    async def run() -> None:
        assert await store.save(record)
        after = await store.update("resp_race", "owner", renew)
        assert seen == ["in_progress", "cancelled"] and after is not None and after.response["status"] == "cancelled"
        stored = await store.load("resp_race", "owner")
        assert stored is not None and stored.response["status"] == "cancelled"
        assert await store.update("resp_race", "someone-else", lambda r: leased(r)) is None
        assert await store.update("resp_missing", "owner", lambda r: leased(r)) is None

    asyncio.run(run())
    store.close()
    other.close()


def test_conversations_many_writers_at_once_each_add_and_a_record_moved_or_forged_is_not_believed(
    redis_url: str,
) -> None:
    """Conversation records (``router/serving_conversations.py``): twenty writers adding an item each at once
    (as responses ending together do) leave twenty, none lost to another's write; under a cluster key a record
    rewritten in Redis, or copied under another conversation's name, is not believed; another owner reads none."""
    from router.response_store import StoredConversation

    namespace = f"store-{uuid.uuid4().hex[:8]}"
    key = ClusterKey.generate()
    stores = [ResponseStore(redis_url, namespace, TTL_S, ClusterKey(key.secret_text)) for _ in range(4)]
    rc = redis.Redis.from_url(redis_url)

    def add(item_id: str) -> Callable[[StoredConversation], StoredConversation]:
        return lambda r: StoredConversation(r.owner, r.conversation, [*r.items, {"id": item_id}])

    async def run() -> None:
        assert await stores[0].save(StoredConversation("owner", {"id": "conv_busy"}, []))
        await asyncio.gather(*(stores[i % 4].update_conversation("conv_busy", "owner", add(f"item_{i}"))
                               for i in range(20)))
        record = await stores[0].load_conversation("conv_busy", "owner")
        assert record is not None and sorted(item["id"] for item in record.items) == sorted(f"item_{i}" for i in range(20))
        assert await stores[0].load_conversation("conv_busy", "someone-else") is None
        name = f"{namespace}:conversation:conv_busy"
        assert 0 < rc.ttl(name) <= TTL_S  # (each change sets it again)
        rc.set(f"{namespace}:conversation:conv_copy", rc.get(name) or b"")
        assert await stores[0].load_conversation("conv_copy", "owner") is None
        raw = rc.get(name)
        assert isinstance(raw, bytes)
        rc.set(name, raw.replace(b"item_1", b"item_X"))
        assert await stores[0].load_conversation("conv_busy", "owner") is None

    try:
        asyncio.run(run())
    finally:
        for store in stores:
            store.close()
        rc.close()
