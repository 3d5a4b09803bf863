"""OpenAI's Conversations API, the routes the official client's `client.conversations` calls:
create, retrieve, update (metadata) and delete a conversation, and create, list, retrieve and
delete its items. A response created with `conversation` reads the conversation's items before
its own input and, once it has completed (or stopped at max_output_tokens), adds its input and
output items to it (jaxserve.server.openai_responses).

Items are the Responses API's input items and are checked as it checks them, in the context of
the conversation before them (a function_call_output must answer a call made before it). Kept in
memory (jaxserve.server.conversation_store), bounded by --max-stored-responses: with 0 there is
no store, and every route answers 400. `include` (more fields on items) is refused: items are
kept without logprobs.

Item ids are unique within a conversation (a repeated id is refused: items are read and deleted
by id), and a function call cannot be deleted while its output follows it (the output would
answer nothing, and no response could read the conversation). Responses running at once on one
conversation each read it as it was when they started, and add their exchanges in the order they
finish.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict
from quart import Response, jsonify, request

from jaxserve.server.accepted_fields import KnownFields
from jaxserve.server.conversation_store import Conversation, ConversationStore
from jaxserve.server.errors import ApiError
from jaxserve.server.generation import ServerState, route
from jaxserve.server.openai import parse
from jaxserve.server.response_store import page, with_ids

MAX_ITEMS_PER_CALL = 20  # OpenAI's limit on the items one create call adds


class _Forbid(KnownFields):
    model_config = ConfigDict(strict=True)


class ConversationCreate(_Forbid):
    """`client.conversations.create`'s body."""

    items: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None


class ConversationUpdate(_Forbid):
    """`client.conversations.update`'s body."""

    metadata: dict[str, str]


class ItemsCreate(_Forbid):
    """`client.conversations.items.create`'s body."""

    items: list[dict[str, Any]]


def store_of(state: ServerState) -> ConversationStore:
    if state.conversations is None:
        raise ApiError(400, "conversation: conversations are kept only on a server started with "
                       "--max-stored-responses above 0", "conversation")
    return state.conversations


def conversation_of(state: ServerState, conversation_id: str, param: str = "conversation_id") -> Conversation:
    found = store_of(state).get(conversation_id)
    if found is None:
        raise ApiError(404, f"{param}: no conversation {conversation_id!r} (conversations are kept in memory, "
                       f"the last {store_of(state).max_entries})", param)
    return found


def checked_items(state: ServerState, items: list[dict[str, Any]],
                  before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`items` with ids, once each reads as the Responses API reads input items after `before`."""
    from jaxserve.server.openai_responses import items_to_chat

    if len(items) > MAX_ITEMS_PER_CALL:
        raise ApiError(400, f"items: at most {MAX_ITEMS_PER_CALL} a call, got {len(items)}", "items")
    named = [(f"conversation[{i}]", item) for i, item in enumerate(before)]
    named += [(f"items[{i}]", item) for i, item in enumerate(items)]
    items_to_chat(named, state.reasoning_parser is not None)
    return with_unique_ids(items, before, "items")


def with_unique_ids(items: list[dict[str, Any]], before: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """`items` with ids (fresh where they have none), refusing an id that is not a string or that
    an item before them (or among them) already has: items are read and deleted by id."""
    listed = with_ids(items)
    taken = {item["id"] for item in before}
    for i, item in enumerate(listed):
        if not isinstance(item["id"], str):
            raise ApiError(400, f"{name}[{i}].id: must be a string, got {item['id']!r}", f"{name}[{i}].id")
        if item["id"] in taken:
            raise ApiError(400, f"{name}[{i}].id: the conversation already has an item {item['id']!r}; leave the "
                           "id out (a fresh one is given) or send the item once", f"{name}[{i}].id")
        taken.add(item["id"])
    return listed


# OpenAI's bounds on `metadata`, on a response as on a conversation.
METADATA_LIMITS = "at most 16 pairs, keys up to 64 characters, values up to 512"


def metadata_refused(metadata: dict[str, str] | None) -> bool:
    pairs = metadata or {}
    return len(pairs) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in pairs.items())


def _check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    if metadata_refused(metadata):
        raise ApiError(400, f"metadata: {METADATA_LIMITS}", "metadata")
    return metadata or {}


def _refuse_include() -> None:
    if "include" in request.args or "include[]" in request.args:
        raise ApiError(400, "include: items are returned as they are kept, which is without logprobs or anything "
                       "more to include", "include")


async def create(state: ServerState) -> Response:
    req = await parse(ConversationCreate)
    store = store_of(state)
    metadata = _check_metadata(req.metadata)
    items = checked_items(state, req.items or [], [])
    try:
        return jsonify(store.create(items, metadata).body())
    except ValueError as e:
        raise ApiError(400, f"items: {e}", "items") from None


async def retrieve(state: ServerState, conversation_id: str) -> Response:
    return jsonify(conversation_of(state, conversation_id).body())


async def update(state: ServerState, conversation_id: str) -> Response:
    req = await parse(ConversationUpdate)
    metadata = _check_metadata(req.metadata)
    conversation_of(state, conversation_id)  # (a 404 for an unknown id)
    updated = store_of(state).set_metadata(conversation_id, metadata)
    return jsonify(updated.body() if updated is not None else conversation_of(state, conversation_id).body())


async def delete(state: ServerState, conversation_id: str) -> Response:
    conversation_of(state, conversation_id)
    store_of(state).delete(conversation_id)
    return jsonify({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def create_items(state: ServerState, conversation_id: str) -> Response:
    _refuse_include()
    req = await parse(ItemsCreate)
    found = conversation_of(state, conversation_id)
    items = checked_items(state, req.items, found.items)
    if not store_of(state).add_items(conversation_id, items):
        raise ApiError(400, "items: the conversation would be larger than the memory kept for conversations",
                       "items")
    return jsonify({"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                    "last_id": items[-1]["id"] if items else None, "has_more": False})


async def list_items(state: ServerState, conversation_id: str) -> Response:
    """`order` "desc" (OpenAI's default) or "asc", `limit` 1-100 (20), `after` an item id."""
    _refuse_include()
    return jsonify(page_from_query(conversation_of(state, conversation_id).items, "item", "this conversation"))


def page_from_query(items: list[dict[str, Any]], noun: str, where: str) -> dict[str, Any]:
    """OpenAI's list object over `items` (oldest first) as the request's query asks for it: `order`
    "desc" (OpenAI's default) or "asc", `limit` 1-100 (20), `after` the id of one of them (a
    `noun` in `where`, as a 400 says it)."""
    args = request.args
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: must be 'asc' or 'desc', got {order!r}", "order")
    try:
        limit = int(args.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit: must be an integer from 1 to 100, got {args.get('limit')!r}", "limit")
    try:
        return page(items, order, limit, args.get("after"))
    except KeyError:
        raise ApiError(400, f"after: no {noun} {args.get('after')!r} in {where}", "after") from None


async def retrieve_item(state: ServerState, conversation_id: str, item_id: str) -> Response:
    _refuse_include()
    item = conversation_of(state, conversation_id).item(item_id)
    if item is None:
        raise ApiError(404, f"item_id: no item {item_id!r} in conversation {conversation_id!r}", "item_id")
    return jsonify(item)


async def delete_item(state: ServerState, conversation_id: str, item_id: str) -> Response:
    found = conversation_of(state, conversation_id)
    item = found.item(item_id) or {}
    answer = next((i for i in found.items if item.get("type") == "function_call" and
                   i.get("type") == "function_call_output" and i.get("call_id") == item.get("call_id")), None)
    if answer is not None:  # left alone, the output would answer no call and the conversation could not be used
        raise ApiError(400, f"item_id: {item_id!r} is a function call that {answer['id']!r} answers; delete the "
                       "output first", "item_id")
    remaining = store_of(state).delete_item(conversation_id, item_id)
    if remaining is None:
        raise ApiError(404, f"item_id: no item {item_id!r} in conversation {conversation_id!r}", "item_id")
    return jsonify(remaining.body())


def register(app: Any, state: ServerState) -> None:
    route(app, state, "/v1/conversations", create, "POST", ConversationCreate)
    route(app, state, "/v1/conversations/<conversation_id>", retrieve, "GET")
    route(app, state, "/v1/conversations/<conversation_id>", update, "POST", ConversationUpdate)
    route(app, state, "/v1/conversations/<conversation_id>", delete, "DELETE")
    route(app, state, "/v1/conversations/<conversation_id>/items", create_items, "POST", ItemsCreate)
    route(app, state, "/v1/conversations/<conversation_id>/items", list_items, "GET")
    route(app, state, "/v1/conversations/<conversation_id>/items/<item_id>", retrieve_item, "GET")
    route(app, state, "/v1/conversations/<conversation_id>/items/<item_id>", delete_item, "DELETE")
