"""The events of a streamed background response, kept so that any number of readers can follow
them and a reader whose connection dropped can resume after the last event it saw (OpenAI's
`GET /v1/responses/{id}?stream=true&starting_after=N`).

The generation writes the log from a task of its own, so a reader that goes away stops nothing.
Events are numbered from 0 in the order they were appended, which is their `sequence_number`.
Host bookkeeping only; every method runs on the server's event loop.

Memory: a running log holds every event so far, about 250 bytes a token (about 2 KB with 20 top
logprobs), so it is bounded by its response's max_output_tokens, and the logs together by
--max-concurrent-requests. Once the response finishes, its events are stored with it, within the
response store's byte bound; a response whose events do not fit is stored without them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class EventLog:
    """Append-only framed SSE events, with readers woken as events arrive."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.closed = False
        self._grew = asyncio.Event()

    def append(self, event: bytes) -> None:
        if self.closed:
            raise RuntimeError("an event log takes no events once closed")
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        """No more events: readers end once they have read the last one."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        # Each waiting reader holds the event it waits on; a fresh one is set aside for the next wait.
        self._grew.set()
        self._grew = asyncio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[bytes]:
        """The events numbered above `after`, then each new one as it is appended, until the log
        is closed."""
        sent = after + 1
        while True:
            grew = self._grew
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.closed:
                return
            await grew.wait()
