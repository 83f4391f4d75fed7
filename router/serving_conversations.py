"""OpenAI's Conversations API (``/v1/conversations``): a conversation's items kept by the router, which a response
continues (``POST /v1/responses`` with ``conversation``) and adds its input and output items to once it ends.

A conversation is a record in the response store (``router/response_store.py``): in Redis, seen by every router on
it, signed with the cluster key where there is one, the caller's alone with API keys on (another key finds it not
found), and kept ``--response-ttl`` seconds from its last change (OpenAI keeps conversations without a TTL; a
router's Redis is not meant to grow without bound). Two responses ending at once each add their items (the record
is changed in a Redis transaction). Items are the Responses API's input items (messages, function calls and their
outputs, reasoning), checked as a response's input is, each given an id; a response's output items keep theirs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field, StrictStr

from router.config import RequestLimits
from router.errors import APIError, bad_request
from router.openai_models import CheckedRequest, parse_request
from router.response_store import ResponseStore, StoredConversation, unavailable
from router.responses_api import input_messages, new_id, stored_items
from router.state import RouterState

MAX_NEW_ITEMS = 20  # OpenAI's bound on the items one call adds


class _Items(CheckedRequest):
    items: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_NEW_ITEMS)

    def check(self, limits: RequestLimits) -> None:
        input_messages(self.items or [], field="items")  # a 400 naming the first item that is not one


class ConversationCreate(_Items):
    """``POST /v1/conversations``: its first items (up to 20) and metadata."""

    metadata: dict[str, StrictStr] | None = Field(default=None, max_length=16)


class ConversationUpdate(CheckedRequest):
    """``POST /v1/conversations/{id}``: its metadata, replaced."""

    metadata: dict[str, StrictStr] = Field(max_length=16)


class ConversationItems(_Items):
    """``POST /v1/conversations/{id}/items``: items added (1 to 20)."""

    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_NEW_ITEMS)


class ConversationObject(BaseModel):
    """A conversation (``POST``/``GET /v1/conversations/{id}``), for the API's schema."""

    id: str
    object: str = "conversation"
    created_at: int
    metadata: dict[str, str]


class DeletedConversation(BaseModel):
    """What ``DELETE /v1/conversations/{id}`` answers."""

    id: str
    object: str = "conversation.deleted"
    deleted: bool


def _store(state: RouterState) -> ResponseStore:
    if state.responses is None:
        raise APIError(404, "this router keeps no conversations (--response-ttl 0, or no Redis)", code="not_found")
    return state.responses


def _not_found(conversation_id: str) -> APIError:
    return APIError(404, f"no conversation '{conversation_id}' (never made, expired or deleted)", code="not_found")


async def _conversation(state: RouterState, owner: str, conversation_id: str) -> StoredConversation:
    record = await _store(state).load_conversation(conversation_id, owner)
    if record is None:
        raise _not_found(conversation_id)
    return record


async def _change(state: RouterState, owner: str, conversation_id: str,
                  change: Callable[[StoredConversation], StoredConversation | None]) -> StoredConversation:
    record = await _store(state).update_conversation(conversation_id, owner, change)
    if record is None:
        raise _not_found(conversation_id)
    return record


def _no_item(conversation_id: str, item_id: str) -> APIError:
    return APIError(404, f"no item '{item_id}' in conversation '{conversation_id}'", code="not_found")


def _item_list(items: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def page(items: list[dict[str, Any]], limit: int, order: str, after: str | None, where: str) -> dict[str, Any]:
    """A page of ``limit`` items (oldest first as given) after the item ``after``, newest first unless ``order``
    is ``asc``; ``where``: what holds them, for the 400 about an ``after`` not among them."""
    if not 1 <= limit <= 100:
        raise bad_request("limit must be between 1 and 100", param="limit")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", param="order")
    items = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise bad_request(f"after: no item '{after}' in {where}", param="after")
        items = items[ids.index(after) + 1:]
    return _item_list(items[:limit], len(items) > limit)


async def create_conversation(state: RouterState, owner: str, body: Any) -> dict[str, Any]:
    request = parse_request(ConversationCreate, body, state.config.limits)
    store = _store(state)
    conversation = {"id": new_id("conv"), "object": "conversation", "created_at": int(time.time()),
                    "metadata": request.metadata or {}}
    if not await store.save(StoredConversation(owner, conversation, stored_items(request.items or []))):
        raise unavailable()
    return conversation


async def retrieve_conversation(state: RouterState, owner: str, conversation_id: str) -> dict[str, Any]:
    return (await _conversation(state, owner, conversation_id)).conversation


async def update_conversation(state: RouterState, owner: str, conversation_id: str, body: Any) -> dict[str, Any]:
    request = parse_request(ConversationUpdate, body, state.config.limits)

    def change(record: StoredConversation) -> StoredConversation:
        return StoredConversation(record.owner, {**record.conversation, "metadata": request.metadata}, record.items)

    return (await _change(state, owner, conversation_id, change)).conversation


async def delete_conversation(state: RouterState, owner: str, conversation_id: str) -> dict[str, Any]:
    if not await _store(state).delete_conversation(conversation_id, owner):
        raise _not_found(conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


async def create_items(state: RouterState, owner: str, conversation_id: str, body: Any) -> dict[str, Any]:
    """The items added, as a list."""
    request = parse_request(ConversationItems, body, state.config.limits)
    added = stored_items(request.items or [])
    await add_items(state, owner, conversation_id, added)
    return _item_list(added)


async def list_items(state: RouterState, owner: str, conversation_id: str, limit: int, order: str,
                     after: str | None) -> dict[str, Any]:
    record = await _conversation(state, owner, conversation_id)
    return page(record.items, limit, order, after, "this conversation")


async def retrieve_item(state: RouterState, owner: str, conversation_id: str, item_id: str) -> dict[str, Any]:
    record = await _conversation(state, owner, conversation_id)
    for item in record.items:
        if item.get("id") == item_id:
            return item
    raise _no_item(conversation_id, item_id)


async def delete_item(state: RouterState, owner: str, conversation_id: str, item_id: str) -> dict[str, Any]:
    """The conversation, the item gone from it."""
    found = False

    def change(record: StoredConversation) -> StoredConversation | None:
        nonlocal found
        kept = [item for item in record.items if item.get("id") != item_id]
        found = len(kept) < len(record.items)
        return StoredConversation(record.owner, record.conversation, kept) if found else None

    record = await _change(state, owner, conversation_id, change)
    if not found:
        raise _no_item(conversation_id, item_id)
    return record.conversation


async def conversation_items(state: RouterState, owner: str, conversation_id: str) -> list[dict[str, Any]]:
    """The items a response continuing ``conversation_id`` comes after; a 400 naming ``conversation`` where there is
    none of the caller's."""
    if state.responses is None:
        raise bad_request("conversation: this router keeps no conversations (--response-ttl 0, or no Redis)",
                          param="conversation")
    record = await state.responses.load_conversation(conversation_id, owner)
    if record is None:
        raise APIError(400, f"conversation '{conversation_id}' not found (never made, expired or deleted)",
                       param="conversation", code="conversation_not_found")
    return record.items


async def add_items(state: RouterState, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> None:
    """Add ``items`` (with their ids) after the conversation's; a 404 where it is gone."""
    def change(record: StoredConversation) -> StoredConversation:
        return StoredConversation(record.owner, record.conversation, [*record.items, *items])

    await _change(state, owner, conversation_id, change)
