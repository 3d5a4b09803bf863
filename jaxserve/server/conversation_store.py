"""Conversations kept in memory for OpenAI's Conversations API (`/v1/conversations`): a list of
Responses items with ids, which a response created with `conversation` reads before its own
input and extends with its input and output once it has finished.

Bounded as the response store is (jaxserve.server.response_store): the least recently used
conversation is forgotten beyond `max_entries` (--max-stored-responses) or `max_bytes` of item
JSON, and a restart forgets them all. Host bookkeeping only.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
import uuid
from typing import Any

DEFAULT_MAX_CONVERSATION_BYTES = 512 << 20  # of item JSON, all conversations together


def _size(items: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(item)) for item in items)


@dataclasses.dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]]  # oldest first, each with an id
    size: int = 0  # bytes of item JSON

    def body(self) -> dict[str, Any]:
        """The Conversation object OpenAI's API returns."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    def item(self, item_id: str) -> dict[str, Any] | None:
        return next((item for item in self.items if item["id"] == item_id), None)


class ConversationStore:
    """A bounded LRU of conversations by id; safe to use from any thread. Readers get copies of
    the item lists, so a conversation that grows while a response reads it changes nothing there."""

    def __init__(self, max_entries: int, max_bytes: int = DEFAULT_MAX_CONVERSATION_BYTES):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"a conversation store holds at least one conversation and one byte, got "
                             f"{max_entries} and {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: collections.OrderedDict[str, Conversation] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def create(self, items: list[dict[str, Any]], metadata: dict[str, str]) -> Conversation:
        """A new conversation holding `items` (with ids); ValueError when they alone are over max_bytes."""
        size = _size(items)
        if size > self.max_bytes:
            raise ValueError(f"the items take {size} bytes, more than the {self.max_bytes} kept for conversations")
        conversation = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), dict(metadata), list(items), size)
        with self._lock:
            self._entries[conversation.id] = conversation
            self._bytes += size
            self._evict(keep=conversation.id)
        return self._copy(conversation)

    def get(self, conversation_id: str) -> Conversation | None:
        with self._lock:
            found = self._entries.get(conversation_id)
            if found is None:
                return None
            self._entries.move_to_end(conversation_id)
            return self._copy(found)

    def add_items(self, conversation_id: str, items: list[dict[str, Any]]) -> bool:
        """Append `items` (with ids); False when the conversation is gone (deleted or forgotten)
        or would be over max_bytes on its own."""
        size = _size(items)
        with self._lock:
            found = self._entries.get(conversation_id)
            if found is None or found.size + size > self.max_bytes:
                return False
            found.items = [*found.items, *items]
            found.size += size
            self._bytes += size
            self._entries.move_to_end(conversation_id)
            self._evict(keep=conversation_id)
            return True

    def delete_item(self, conversation_id: str, item_id: str) -> Conversation | None:
        """The conversation without that item; None when either is unknown."""
        with self._lock:
            found = self._entries.get(conversation_id)
            item = found.item(item_id) if found is not None else None
            if found is None or item is None:
                return None
            found.items = [i for i in found.items if i["id"] != item_id]
            size = _size([item])
            found.size -= size
            self._bytes -= size
            return self._copy(found)

    def set_metadata(self, conversation_id: str, metadata: dict[str, str]) -> Conversation | None:
        with self._lock:
            found = self._entries.get(conversation_id)
            if found is None:
                return None
            found.metadata = dict(metadata)
            return self._copy(found)

    def delete(self, conversation_id: str) -> bool:
        with self._lock:
            dropped = self._entries.pop(conversation_id, None)
            if dropped is not None:
                self._bytes -= dropped.size
            return dropped is not None

    def _evict(self, keep: str) -> None:
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            if oldest == keep:  # (it alone fits max_bytes, so something else goes first)
                self._entries.move_to_end(keep)
                oldest = next(iter(self._entries))
            dropped = self._entries.pop(oldest)
            self._bytes -= dropped.size

    @staticmethod
    def _copy(c: Conversation) -> Conversation:
        return dataclasses.replace(c, metadata=dict(c.metadata), items=list(c.items))

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
