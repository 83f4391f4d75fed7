"""The Responses API's stored responses, kept in Redis for ``--response-ttl`` seconds.

A response asked to be stored (``store``, true unless the request says false) is written once it has
finished, with every input item it answered: those of the responses it continued from
(``previous_response_id``) first, then its own. Continuing from it then reads one record, however
long the chain. ``GET``/``DELETE /v1/responses/{id}`` and ``GET .../input_items`` read and remove it.

Unlike a store in the router's memory, every router process on the same Redis sees every response
(a conversation may continue on another worker or router, or after a restart), and Redis drops each
one at its TTL, so the store cannot grow without bound. A record is its caller's: with API keys on,
another key reads it as not found. With a cluster key each record carries an HMAC-SHA256 over its
key name and bytes, as registry entries do, and a record that does not verify is not believed:
whoever can write to Redis cannot put words into a conversation that the model then continues.

Conversations (OpenAI's Conversations API: ``router/serving_conversations.py``) are kept the same way, each a record
of its items, signed alike, for ``--response-ttl`` seconds from its last change.

A background response that streams also keeps its events, in order, in a list beside its record
(``append_events`` / ``read_events``), for as long as the record: a client that lost its stream reads
them again from where it was (``GET /v1/responses/{id}?stream=true&starting_after=N``). With a cluster
key each event's MAC covers its number too, so a log cannot be reordered or spliced unnoticed.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import redis

from common.registry import RedisClient, SignedEntry
from router.errors import APIError

if TYPE_CHECKING:
    from common.cluster_key import ClusterKey

logger = logging.getLogger(__name__)

# A response id this router could have made (``resp_`` and hex); any other names no record, and is
# never put into a Redis key name.
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class StoredResponse(msgspec.Struct):
    owner: str  # the caller's API-key salt; "" with API keys off
    response: dict[str, Any]  # the response object as it was answered
    items: list[dict[str, Any]]  # the input items it answered, the whole chain's, oldest first
    # A background response still running: until when (wall clock) the router process running it has
    # vouched for it; past it, that process is gone and the response failed. 0: not running.
    lease_until: float = 0.0
    streamed: bool = False  # a background response created with ``stream``: its events are logged


class StoredConversation(msgspec.Struct):
    owner: str  # the caller's API-key salt; "" with API keys off
    conversation: dict[str, Any]  # the conversation object (id, created_at, metadata)
    items: list[dict[str, Any]]  # its items, oldest first, each with its id


_encoder = msgspec.json.Encoder()
_signed_decoder = msgspec.json.Decoder(SignedEntry)
_record_decoder = msgspec.json.Decoder(StoredResponse)
_conversation_decoder = msgspec.json.Decoder(StoredConversation)
Record = TypeVar("Record", StoredResponse, StoredConversation)


def unavailable() -> APIError:
    return APIError(503, "the response store (Redis) is unreachable; try again", code="store_unavailable")


class ResponseStore:
    def __init__(self, redis_url: str, namespace: str, ttl_s: int, cluster_key: ClusterKey | None = None) -> None:
        if ttl_s < 1:
            raise ValueError("a response store needs a TTL of at least one second")
        self._rc = RedisClient(redis_url, namespace)
        self.ttl_s = ttl_s
        self._key = cluster_key

    def _name(self, response_id: str) -> str:
        return self._rc.key("response", response_id)

    def _conversation_name(self, conversation_id: str) -> str:
        return self._rc.key("conversation", conversation_id)

    def _record_name(self, record: StoredResponse | StoredConversation) -> str:
        """The key a record belongs under (a record read from another key is not believed)."""
        if isinstance(record, StoredConversation):
            return self._conversation_name(str(record.conversation.get("id")))
        return self._name(str(record.response.get("id")))

    def _events_name(self, response_id: str) -> str:
        return self._rc.key("response-events", response_id)

    def _seal(self, name: str, payload: bytes) -> bytes:
        """``payload`` as stored under ``name``: with a cluster key, signed over the name and its bytes."""
        if self._key is None:
            return payload
        return _encoder.encode(SignedEntry(msgspec.Raw(payload), self._key.sign(name.encode() + b"\n" + payload)))

    def _unseal(self, name: str, raw: bytes) -> bytes | None:
        """What ``_seal`` stored under ``name``; None where a cluster key is set and it does not verify."""
        try:
            signed: SignedEntry | None = _signed_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            signed = None  # unsigned (or garbage: what decodes it next says which)
        payload = raw if signed is None else bytes(signed.entry)
        if self._key is not None and (signed is None or not self._key.verify(name.encode() + b"\n" + payload, signed.mac)):
            logger.warning("ignoring stored response %s: %s", name, "unsigned" if signed is None else "its MAC does not verify")
            return None
        return payload

    async def save(self, record: StoredResponse | StoredConversation) -> bool:
        """Write ``record`` under its response's (or conversation's) id, to expire after the TTL; False if Redis is
        down."""
        name = self._record_name(record)
        payload = self._seal(name, _encoder.encode(record))
        ok, _ = await asyncio.to_thread(self._rc.run, "response save", lambda c: c.set(name, payload, ex=self.ttl_s))
        return ok

    async def update(self, response_id: str, owner: str,
                     change: Callable[[StoredResponse], StoredResponse | None]) -> StoredResponse | None:
        """Replace ``owner``'s record of ``response_id`` by ``change(record)`` (None: leave it), atomically: if
        another writer changed it between this read and this write, read it again and ask ``change`` again
        (Redis' optimistic transaction: WATCH, then MULTI/EXEC). So a background response's lease renewal
        cannot undo a cancel saved meanwhile, nor a cancel overwrite an answer saved meanwhile. Returns the
        record as it stands afterwards; None if there is none of ``owner``'s; a 503 if Redis is down."""
        if not _ID.fullmatch(response_id):
            return None
        return await self._update(self._name(response_id), _record_decoder, owner, change)

    async def update_conversation(
        self, conversation_id: str, owner: str, change: Callable[[StoredConversation], StoredConversation | None]
    ) -> StoredConversation | None:
        """``update`` for a conversation (two responses adding to it at once each add their items)."""
        if not _ID.fullmatch(conversation_id):
            return None
        return await self._update(self._conversation_name(conversation_id), _conversation_decoder, owner, change)

    async def _update(self, name: str, decoder: msgspec.json.Decoder[Record], owner: str,
                      change: Callable[[Record], Record | None]) -> Record | None:
        def transact(client: Any) -> Record | None:
            with client.pipeline() as pipe:
                while True:
                    try:
                        pipe.watch(name)
                        raw = pipe.get(name)
                        record = None if raw is None else self._open(name, raw, decoder)
                        if record is None or record.owner != owner:
                            return None
                        new = change(record)
                        if new is None:
                            return record
                        pipe.multi()
                        pipe.set(name, self._seal(name, _encoder.encode(new)), ex=self.ttl_s)
                        pipe.execute()
                        return new
                    except redis.WatchError:
                        continue

        ok, result = await asyncio.to_thread(self._rc.run, "response update", transact)
        if not ok:
            raise unavailable()
        return result

    async def append_events(self, response_id: str, first: int, events: list[bytes]) -> bool:
        """Append a streaming background response's ``events`` (numbered ``first`` on) to its log, which
        expires with the record; False if Redis is down."""
        if not events:
            return True
        name = self._events_name(response_id)
        entries = [self._seal(f"{name}#{first + i}", event) for i, event in enumerate(events)]

        def write(client: Any) -> None:
            pipe = client.pipeline(transaction=False)
            pipe.rpush(name, *entries)
            pipe.expire(name, self.ttl_s)
            pipe.execute()

        ok, _ = await asyncio.to_thread(self._rc.run, "response events append", write)
        return ok

    async def read_events(self, response_id: str, after: int) -> list[bytes]:
        """The logged events numbered after ``after`` (-1: all), up to the first that does not verify; a
        503 if Redis is down."""
        if not _ID.fullmatch(response_id):
            return []
        name = self._events_name(response_id)
        ok, raw = await asyncio.to_thread(self._rc.run, "response events read", lambda c: c.lrange(name, after + 1, -1))
        if not ok:
            raise unavailable()
        events = []
        for number, entry in enumerate(raw, start=after + 1):
            event = self._unseal(f"{name}#{number}", entry)
            if event is None:
                break
            events.append(event)
        return events

    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        """The record of ``response_id`` if ``owner`` may read it, else None; a 503 if Redis is down."""
        if not _ID.fullmatch(response_id):
            return None
        return await self._load(self._name(response_id), _record_decoder, owner)

    async def load_conversation(self, conversation_id: str, owner: str) -> StoredConversation | None:
        """``load`` for a conversation."""
        if not _ID.fullmatch(conversation_id):
            return None
        return await self._load(self._conversation_name(conversation_id), _conversation_decoder, owner)

    async def _load(self, name: str, decoder: msgspec.json.Decoder[Record], owner: str) -> Record | None:
        ok, raw = await asyncio.to_thread(self._rc.run, "response load", lambda c: c.get(name))
        if not ok:
            raise unavailable()
        if raw is None:
            return None
        record = self._open(name, raw, decoder)
        return record if record is not None and record.owner == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        """Remove ``owner``'s record of ``response_id``; False if there was none for them."""
        if await self.load(response_id, owner) is None:
            return False
        return await self._delete(self._name(response_id), self._events_name(response_id))

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        """``delete`` for a conversation."""
        if await self.load_conversation(conversation_id, owner) is None:
            return False
        return await self._delete(self._conversation_name(conversation_id))

    async def _delete(self, *names: str) -> bool:
        ok, removed = await asyncio.to_thread(self._rc.run, "response delete", lambda c: c.delete(*names))
        if not ok:
            raise unavailable()
        return bool(removed)

    def _open(self, name: str, raw: bytes, decoder: msgspec.json.Decoder[Record]) -> Record | None:
        payload = self._unseal(name, raw)
        if payload is None:
            return None
        try:
            record = decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.warning("ignoring malformed stored record %s", name)
            return None
        return record if name == self._record_name(record) else None

    def close(self) -> None:
        self._rc.close()

