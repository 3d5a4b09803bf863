"""The bound both of the Responses API's in-memory stores keep (responses, conversations): entries
by id, the least recently used forgotten beyond `max_entries` or beyond `max_bytes` (the sum of
the entries' `size`, the bytes each holds). Host bookkeeping only.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, Protocol, TypeVar


class _Sized(Protocol):
    @property
    def size(self) -> int: ...


E = TypeVar("E", bound=_Sized)


class LruStore(Generic[E]):
    """The LRU and its byte count; subclasses add their own operations, each under `_lock`.
    `noun` names what is kept, in errors."""

    noun = "entry"

    def __init__(self, max_entries: int, max_bytes: int):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"a {self.noun} store holds at least one {self.noun} and one byte, got {max_entries} "
                             f"and {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: collections.OrderedDict[str, E] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _insert(self, key: str, entry: E) -> None:
        """Keep `entry` (which alone fits max_bytes) as the most recently used. Under the lock."""
        self._entries[key] = entry
        self._grew(key, entry.size)

    def _grew(self, key: str, size: int) -> None:
        """`key`'s entry holds `size` bytes more (fewer if negative): counted, made the most
        recently used, and the least recently used others forgotten beyond the bounds (the entry
        itself alone fits max_bytes, so it is never the one forgotten). Under the lock."""
        self._bytes += size
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size

    def _used(self, key: str) -> E | None:
        """`key`'s entry, made the most recently used; None if there is none. Under the lock."""
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def delete(self, key: str) -> bool:
        with self._lock:
            dropped = self._entries.pop(key, None)
            if dropped is not None:
                self._bytes -= dropped.size
            return dropped is not None

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
