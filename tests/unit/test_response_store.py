"""The Responses API's in-memory store (jaxserve.server.response_store): bounded LRU, and
OpenAI's input_items pages."""

from __future__ import annotations

import pytest

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
