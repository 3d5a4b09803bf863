"""Responses kept in memory so a later request can continue one (`previous_response_id`) and
clients can read or delete them (`GET` / `DELETE /v1/responses/{id}`, `.../input_items`), as
OpenAI's Responses API stores them when `store` is true (its default).

Bounded: the least recently used response is forgotten beyond `max_entries` (--max-stored-
responses) or beyond `max_bytes` of stored JSON (a response with top-20 logprobs on thousands of
tokens is megabytes); each is kept as JSON text (a streamed background response with its events),
so the bytes counted are the bytes held. Nothing
is written to disk, and a restart forgets everything. A response continued from holds the whole
conversation up to it, so continuing needs nothing older. Host bookkeeping only.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from jaxserve.server.lru_store import LruStore

DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_MAX_STORED_BYTES = 512 << 20  # of JSON text, all responses together


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    """One response, held as JSON text (`stored`) and read back as objects."""

    id: str
    status: str
    text: bytes  # JSON of [body, input_items, conversation]
    # A streamed background response's SSE events, numbered by position, for a reader resuming
    # its stream (GET .../{id}?stream=true); none for any other response.
    events: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, body: dict[str, Any], input_items: list[dict[str, Any]], conversation: list[dict[str, Any]],
           events: tuple[bytes, ...] = ()) -> StoredResponse:
        """body: the Response object as returned; input_items: this request's own input, as items
        with ids; conversation: the conversation through this response as Responses input items
        (the responses it continued, this one's input, then its output), which a request
        continuing it puts before its own input; events: see the field."""
        return cls(body["id"], body["status"], json.dumps([body, input_items, conversation]).encode(), events)

    @property
    def size(self) -> int:
        """The bytes it holds."""
        return len(self.text) + sum(len(e) for e in self.events)

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.text)[0]

    @property
    def input_items(self) -> list[dict[str, Any]]:
        return json.loads(self.text)[1]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return json.loads(self.text)[2]


class ResponseStore(LruStore[StoredResponse]):
    """A bounded LRU of finished responses by id; safe to use from any thread."""

    noun = "response"

    def __init__(self, max_entries: int, max_bytes: int = DEFAULT_MAX_STORED_BYTES):
        super().__init__(max_entries, max_bytes)

    def put(self, response: StoredResponse) -> bool:
        """Keep `response` (replacing an earlier version of it), forgetting the least recently
        used beyond the bounds; False (and nothing kept) when it alone is over max_bytes."""
        with self._lock:
            old = self._entries.pop(response.id, None)
            if old is not None:
                self._bytes -= old.size
            if response.size > self.max_bytes:
                return False
            self._insert(response.id, response)
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._used(response_id)


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as OpenAI lists them (`input_items`): each with an id, messages with their text
    as input_text parts (output_text for an assistant's) and a status."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            part = ({"type": "output_text", "annotations": []} if item.get("role") == "assistant"
                    else {"type": "input_text"})
            parts = [{**part, "text": content}] if isinstance(content, str) else list(content or [])
            item = {"type": "message", "role": item.get("role"), "content": parts, "status": "completed",
                    "id": item.get("id") or f"msg_{uuid.uuid4().hex}"}
        elif "id" not in item:
            prefix = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}.get(kind, "item")
            item = {**item, "id": f"{prefix}_{uuid.uuid4().hex}"}
        out.append(item)
    return out


def page(items: list[dict[str, Any]], order: str, limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's list object over `items` (oldest first): `order` "asc" or "desc" (OpenAI's default),
    at most `limit`, starting after the item with id `after`. KeyError when no item has that id."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [i["id"] for i in ordered]
        start = ids.index(after) + 1 if after in ids else -1
        if start < 0:
            raise KeyError(after)
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}
