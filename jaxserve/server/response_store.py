"""Responses kept in memory so a later request can continue one (`previous_response_id`) and
clients can read or delete them (`GET` / `DELETE /v1/responses/{id}`, `.../input_items`), as
OpenAI's Responses API stores them when `store` is true (its default).

Bounded: the least recently used response is forgotten beyond `max_entries` (--max-stored-
responses); nothing is written to disk, and a restart forgets everything. A response continued
from holds the whole conversation up to it, so continuing needs nothing older. Host bookkeeping
only.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import uuid
from typing import Any

# Each holds its whole conversation, up to --max-model-len tokens of text: a few hundred KiB at most.
DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object, as it was returned when it finished
    input_items: list[dict[str, Any]]  # this request's own input, as items with ids
    # The conversation through this response, as Responses input items (the responses it continued,
    # this one's input, then its output), which a request continuing it puts before its own input.
    conversation: list[dict[str, Any]]


class ResponseStore:
    """A bounded LRU of finished responses by id; safe to use from any thread."""

    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError(f"a response store holds at least one response, got {max_entries}")
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: StoredResponse) -> None:
        with self._lock:
            self._entries[response.body["id"]] = response
            self._entries.move_to_end(response.body["id"])
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            found = self._entries.get(response_id)
            if found is not None:
                self._entries.move_to_end(response_id)
            return found

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as OpenAI lists them (`input_items`): each with an id, messages with their text
    as input_text parts (output_text for an assistant's) and a status."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            parts = [{"type": part, "text": content}] if isinstance(content, str) else list(content or [])
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
