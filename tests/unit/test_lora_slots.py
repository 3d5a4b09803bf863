"""The LoRA adapter bookkeeping (jaxserve.engine.lora_slots), host only: adapters load without a
slot, take one when asked (free first, then the least recently used adapter no running sequence
reads), queue each slot that changes hands for writing, and free it when unloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxserve.engine.lora_slots import LoraRefused, LoraSlots


def _slots(num_slots: int = 2, max_loaded: int | None = None) -> LoraSlots:
    slots = LoraSlots(num_slots, 8, ("q_proj", "v_proj"), 2, {"q_proj": (16, 16), "v_proj": (16, 8)}, max_loaded)
    for name in "abcd":
        if max_loaded is None or len(slots.names) < max_loaded:
            slots.add(name, Path(f"/{name}"), 4, ("q_proj",), {(0, "q_proj"): name})
    return slots


def _written(slots: LoraSlots) -> list[tuple[int, str]]:
    return [(slot, lora.name) for slot, lora in slots.take_writes()]


def test_free_slots_first_then_least_recently_used_idle():
    slots = _slots()
    assert slots.resident == (None, None) and slots.names == ("a", "b", "c", "d")
    assert slots.acquire("a", busy=()) == 0 and slots.acquire("b", busy=()) == 1
    assert _written(slots) == [(0, "a"), (1, "b")]
    assert slots.acquire("a", busy=()) == 0 and _written(slots) == []  # already there: no write
    # b was used longest ago: c takes its slot; with a and c busy, d must wait.
    assert slots.acquire("c", busy={"a"}) == 1 and slots.resident == ("a", "c")
    assert slots.acquire("d", busy={"a", "c"}) is None and slots.resident == ("a", "c")
    assert _written(slots) == [(1, "c")]
    assert slots.acquire("d", busy={"c"}, evict=False) is None  # no free slot, and no eviction asked
    assert slots.acquire("d", busy={"c"}) == 0 and slots.slot_of("d") == 0 and slots.slot_of(None) == -1
    with pytest.raises(KeyError, match="'a' holds no adapter slot"):
        slots.slot_of("a")


def test_unload_frees_its_slot_and_drops_its_pending_write():
    slots = _slots()
    slots.acquire("a", busy=())
    slots.acquire("b", busy=())
    slots.remove("b")
    assert slots.resident == ("a", None) and _written(slots) == [(0, "a")]
    assert slots.acquire("c", busy={"a"}) == 1
    with pytest.raises(LoraRefused, match="no LoRA adapter named 'b'"):
        slots.remove("b")
    # Loaded again under the same name: a new key, so the prefix cache never mixes the two loads.
    first = slots.get("a").key
    slots.remove("a")
    assert slots.add("a", Path("/a2"), 4, ("q_proj",), {}).key != first


def test_refusals():
    slots = _slots(max_loaded=3)
    assert slots.names == ("a", "b", "c")
    with pytest.raises(LoraRefused, match=r"3 LoRA adapters are loaded \(a, b, c\).*--max-cpu-loras"):
        slots.add("d", Path("/d"), 4, ("q_proj",), {})
    with pytest.raises(LoraRefused, match="already loaded"):
        slots.check_fits("a", 4, ("q_proj",))
    with pytest.raises(LoraRefused, match="rank 16, above this server's --max-lora-rank 8") as e:
        slots.check_adapter("x", 16, ("q_proj",))
    assert e.value.param == "lora_path"
    with pytest.raises(LoraRefused, match="adapts k_proj"):
        slots.check_adapter("x", 4, ("k_proj", "q_proj"))
    with pytest.raises(ValueError, match="below the 2 adapter slots"):
        LoraSlots(2, 8, ("q_proj",), 2, {}, max_loaded=1)


def test_pinned_adapters_keep_their_slots():
    slots = _slots(num_slots=3)
    slots.acquire("a", busy=())
    slots.acquire("b", busy=())
    slots.acquire("c", busy=())
    # Pinned at load: it takes the least recently used idle slot (a's) at once, and keeps it.
    slots.add("p", Path("/p"), 4, ("q_proj",), {}, pinned=True, busy={"b"})
    assert slots.resident == ("p", "b", "c") and (0, "p") in _written(slots)
    assert slots.acquire("a", busy=()) == 1  # b's, never p's
    assert slots.acquire("d", busy={"a"}) == 2
    # A second pin leaves one slot; a third would leave the adapters not pinned none to take turns in.
    slots.add("q", Path("/q"), 4, ("q_proj",), {}, pinned=True, busy={"d"})
    assert slots.resident == ("p", "q", "d")
    with pytest.raises(LoraRefused, match="2 of the 3 adapter slots .* are pinned already") as e:
        slots.add("r", Path("/r"), 4, ("q_proj",), {}, pinned=True)
    assert e.value.param == "pinned" and slots.get("r") is None
    assert slots.acquire("a", busy=()) == 2  # the one slot left takes turns
    with pytest.raises(LoraRefused, match="cannot pin LoRA adapter 'q' now"):
        _busy_pin()
    # With only pinned adapters loaded, every slot may be pinned; then nothing unpinned loads.
    solo = LoraSlots(1, 8, ("q_proj",), 2, {})
    solo.add("p", Path("/p"), 4, ("q_proj",), {}, pinned=True)
    with pytest.raises(LoraRefused, match="all 1 adapter slots .* are pinned"):
        solo.add("x", Path("/x"), 4, ("q_proj",), {})


def _busy_pin() -> None:
    """Two slots both held by adapters that running sequences read: no slot to pin into now."""
    slots = LoraSlots(2, 8, ("q_proj",), 2, {})
    for name in "ab":
        slots.add(name, Path(f"/{name}"), 4, ("q_proj",), {})
        slots.acquire(name, busy=())
    slots.add("q", Path("/q"), 4, ("q_proj",), {}, pinned=True, busy={"a", "b"})


def test_fifo_evicts_the_earliest_taken_slot():
    slots = LoraSlots(2, 8, ("q_proj",), 2, {}, policy="fifo")
    for name in "abc":
        slots.add(name, Path(f"/{name}"), 4, ("q_proj",), {})
    slots.acquire("a", busy=())
    slots.acquire("b", busy=())
    slots.acquire("a", busy=())  # used again: lru would now keep it, fifo still evicts it first
    assert slots.acquire("c", busy=()) == 0 and slots.resident == ("c", "b")
    with pytest.raises(ValueError, match="lru or fifo"):
        LoraSlots(2, 8, ("q_proj",), 2, {}, policy="lfu")
