"""The Responses API's in-memory store (jaxserve.server.response_store): bounded LRU, and
OpenAI's input_items pages; a streamed background response's event log (jaxserve.server.event_log)."""

from __future__ import annotations

import asyncio
import json

import pytest

from jaxserve.server.event_log import EventLog
from jaxserve.server.response_store import ResponseStore, StoredResponse, page, with_ids


def _stored(i: int, text: str = "") -> StoredResponse:
    return StoredResponse.of({"id": f"resp_{i}", "status": "completed", "text": text}, [], [{"content": text}])


def test_the_least_recently_used_response_is_forgotten_beyond_the_bound():
    store = ResponseStore(2)
    store.put(_stored(1))
    store.put(_stored(2))
    assert store.get("resp_1") is not None  # used: resp_2 is now the oldest
    store.put(_stored(3))
    assert store.get("resp_2") is None and store.get("resp_1") and store.get("resp_3") and len(store) == 2
    assert store.delete("resp_1") and not store.delete("resp_1") and len(store) == 1
    with pytest.raises(ValueError):
        ResponseStore(0)


def test_the_store_is_bounded_in_bytes_too():
    one = len(_stored(1, "x" * 1000).text)
    store = ResponseStore(100, max_bytes=3 * one)
    for i in range(5):
        assert store.put(_stored(i, "x" * 1000))
    assert len(store) == 3 and store.num_bytes == 3 * one and store.get("resp_1") is None
    assert not store.put(_stored(9, "x" * 4000)) and store.get("resp_9") is None  # alone over the budget
    assert store.put(_stored(4, "x" * 1000)) and len(store) == 3 and store.num_bytes == 3 * one  # replaced
    assert store.get("resp_4").body["text"] == "x" * 1000 and store.get("resp_4").conversation == [
        {"content": "x" * 1000}]
    assert store.delete("resp_4") and store.num_bytes == 2 * one
    # A streamed background response's events count too.
    events = (b"x" * 500, b"y" * 500)
    streamed = StoredResponse.of(_stored(5).body, [], [], events)
    assert store.put(streamed) and store.get("resp_5").events == events
    assert streamed.size == len(streamed.text) + 1000 and store.num_bytes == 2 * one + streamed.size


def test_an_event_log_is_followed_live_and_resumed_after_any_event():
    async def go() -> tuple[list[list[bytes]], list[bytes], list[bytes]]:
        log = EventLog()
        seen: list[list[bytes]] = [[], []]

        async def read(k: int, after: int = -1) -> None:
            async for event in log.follow(after):
                seen[k].append(event)

        readers = [asyncio.create_task(read(0)), asyncio.create_task(read(1, after=0))]
        log.append(b"e0")
        await asyncio.sleep(0)
        log.append(b"e1")  # two appends before the readers run again: neither is missed
        log.append(b"e2")
        await asyncio.sleep(0.01)
        late = [e async for e in _until_closed(log, after=1)]  # a reader resuming after event 1
        await asyncio.gather(*readers)
        finished = [e async for e in log.follow(2)]  # after the last event of a closed log: nothing
        return seen, late, finished

    async def _until_closed(log: EventLog, after: int):
        asyncio.get_running_loop().call_later(0.01, log.close)
        async for e in log.follow(after):
            yield e

    seen, late, finished = asyncio.run(go())
    assert seen == [[b"e0", b"e1", b"e2"], [b"e1", b"e2"]] and late == [b"e2"] and finished == []
    closed = EventLog()
    closed.close()
    with pytest.raises(RuntimeError):
        closed.append(b"late")


def test_input_items_are_listed_as_openai_pages_them():
    items = with_ids([{"type": "message", "role": "user", "content": "a"},
                      {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
                      {"type": "function_call_output", "call_id": "c", "output": "4"}])
    assert items[0]["content"] == [{"type": "input_text", "text": "a"}] and items[0]["status"] == "completed"
    assert with_ids([{"role": "assistant", "content": "b"}])[0]["content"] == [
        {"type": "output_text", "annotations": [], "text": "b"}]
    assert items[0]["id"].startswith("msg_") and items[2]["id"].startswith("fco_")
    newest_first = page(items, "desc", 2, None)
    assert [i["id"] for i in newest_first["data"]] == [items[2]["id"], items[1]["id"]] and newest_first["has_more"]
    rest = page(items, "desc", 2, newest_first["last_id"])
    assert rest["data"] == [items[0]] and not rest["has_more"] and rest["first_id"] == rest["last_id"]
    assert page(items, "asc", 20, None)["data"] == items
    with pytest.raises(KeyError):
        page(items, "asc", 20, "msg_nope")


def test_conversations_are_bounded_and_readers_get_copies():
    from jaxserve.server.conversation_store import ConversationStore

    def items(*texts: str) -> list[dict]:
        return [{"id": f"msg_{t}", "type": "message", "content": t} for t in texts]

    store = ConversationStore(2)
    a = store.create(items("a1"), {"k": "v"})
    b = store.create([], {})
    assert store.add_items(a.id, items("a2")) and [i["id"] for i in store.get(a.id).items] == ["msg_a1", "msg_a2"]
    assert a.items == items("a1")  # what a reader got does not change as the conversation grows
    store.get(a.id)  # used: b is now the oldest
    c = store.create(items("c1"), {})
    assert store.get(b.id) is None and store.get(c.id) is not None and len(store) == 2
    assert store.delete_item(a.id, "msg_a1").items == items("a2") and store.delete_item(a.id, "msg_a1") is None
    assert store.set_metadata(a.id, {"k": "w"}).body()["metadata"] == {"k": "w"}
    assert store.delete(a.id) and not store.add_items(a.id, items("x")) and store.get(a.id) is None
    one = len(json.dumps(items("x" * 100)[0]))
    small = ConversationStore(10, max_bytes=3 * one)
    first, second = small.create(items("x" * 100), {}), small.create(items("y" * 100), {})
    assert small.add_items(second.id, items("z" * 100)) and small.num_bytes == 3 * one
    assert small.add_items(second.id, items("w" * 100, "u" * 100)) is False  # it alone would be over the bound
    small.create(items("v" * 100), {})  # the least recently used goes
    assert small.get(first.id) is None and small.num_bytes == 3 * one
    with pytest.raises(ValueError):
        small.create(items("a" * 400), {})
