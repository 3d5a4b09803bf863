"""Conversations kept in memory for OpenAI's Conversations API (`/v1/conversations`): a list of
Responses items with ids, which a response created with `conversation` reads before its own
input and extends with its input and output once it has finished.

Bounded as the response store is (jaxserve.server.response_store): the least recently used
conversation is forgotten beyond `max_entries` (--max-stored-responses) or `max_bytes` of item
JSON, and a restart forgets them all. Host bookkeeping only.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from jaxserve.server.lru_store import LruStore

DEFAULT_MAX_CONVERSATION_BYTES = 512 << 20  # of item JSON, all conversations together


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A conversation as read from the store (a copy: the store holds each item as JSON text, so
    the bytes it counts are the bytes it holds)."""

    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]]  # oldest first, each with an id of its own

    def body(self) -> dict[str, Any]:
        """The Conversation object OpenAI's API returns."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    def item(self, item_id: str) -> dict[str, Any] | None:
        return next((item for item in self.items if item["id"] == item_id), None)


@dataclasses.dataclass
class _Entry:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[tuple[str, bytes]]  # (id, JSON)

    @property
    def size(self) -> int:
        return sum(len(text) for _, text in self.items)

    def read(self) -> Conversation:
        return Conversation(self.id, self.created_at, dict(self.metadata), [json.loads(t) for _, t in self.items])


def _encoded(items: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    return [(item["id"], json.dumps(item).encode()) for item in items]


class ConversationStore(LruStore[_Entry]):
    """A bounded LRU of conversations by id; safe to use from any thread. Items must carry ids
    unique within their conversation (the routes check them)."""

    noun = "conversation"

    def __init__(self, max_entries: int, max_bytes: int = DEFAULT_MAX_CONVERSATION_BYTES):
        super().__init__(max_entries, max_bytes)

    def create(self, items: list[dict[str, Any]], metadata: dict[str, str]) -> Conversation:
        """A new conversation holding `items`; ValueError when they alone are over max_bytes."""
        entry = _Entry(f"conv_{uuid.uuid4().hex}", int(time.time()), dict(metadata), _encoded(items))
        if entry.size > self.max_bytes:
            raise ValueError(f"the items take {entry.size} bytes, more than the {self.max_bytes} kept for "
                             "conversations")
        with self._lock:
            self._insert(entry.id, entry)
            return entry.read()

    def get(self, conversation_id: str) -> Conversation | None:
        with self._lock:
            found = self._used(conversation_id)
            return found.read() if found is not None else None

    def add_items(self, conversation_id: str, items: list[dict[str, Any]]) -> bool:
        """Append `items`; False when the conversation is gone (deleted or forgotten) or would be
        over max_bytes on its own."""
        encoded = _encoded(items)
        size = sum(len(text) for _, text in encoded)
        with self._lock:
            found = self._entries.get(conversation_id)
            if found is None or found.size + size > self.max_bytes:
                return False
            found.items += encoded
            self._grew(conversation_id, size)
            return True

    def delete_item(self, conversation_id: str, item_id: str) -> Conversation | None:
        """The conversation without that item; None when either is unknown."""
        with self._lock:
            found = self._entries.get(conversation_id)
            if found is None or all(i != item_id for i, _ in found.items):
                return None
            before = found.size
            found.items = [(i, text) for i, text in found.items if i != item_id]
            self._bytes -= before - found.size
            return found.read()

    def set_metadata(self, conversation_id: str, metadata: dict[str, str]) -> Conversation | None:
        with self._lock:
            found = self._entries.get(conversation_id)
            if found is None:
                return None
            found.metadata = dict(metadata)
            return found.read()
