"""The LoRA adapters the server holds, and which of them hold the model's adapter slots (host
bookkeeping, no jax).

The model is compiled with a fixed number of slots of a fixed rank, on a fixed set of projections
(jaxserve.models.lora). A batch row reads one slot, so at most that many adapters decode in one
step; any number may be loaded. A loaded adapter keeps its factors in host memory (at most
`max_loaded` adapters: vLLM's --max-cpu-loras) and takes a slot when a request of it is admitted
(`acquire`): a free one, else the one of the least recently used adapter no running sequence
reads. The engine writes the factors there before the step that reads them (`take_writes`).
A pinned adapter (SGLang's `pinned`) takes a slot when loaded and keeps it; while adapters not
pinned are loaded, one slot at least stays unpinned for them to take turns in. Refusals are
LoraRefused (ValueError) errors saying what the server can hold.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any


class LoraRefused(ValueError):
    """An adapter this server cannot take (now); `param` names what is wrong: the name (taken,
    unknown, too many loaded) or the adapter at the path (its rank or projections)."""

    def __init__(self, message: str, param: str = "lora_name") -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedLora:
    """A loaded adapter. `key` is unique to this load (the name and a load count): the prefix
    cache's pages of its requests hang from it, so an adapter loaded later under the same name
    never reads this one's K/V. `factors`: its host copies, by (layer, projection), as
    jaxserve.weights.lora_adapter.LoraAdapter's."""

    name: str
    path: Path
    rank: int
    targets: tuple[str, ...]
    key: str
    factors: Mapping[tuple[int, str], Any] = dataclasses.field(repr=False, default_factory=dict)
    pinned: bool = False  # SGLang's: it keeps its slot from its load to its unload


class LoraSlots:
    """The loaded adapters and the model's adapter slots."""

    def __init__(self, num_slots: int, rank: int, targets: tuple[str, ...], num_layers: int,
                 shapes: dict[str, tuple[int, int]], max_loaded: int | None = None, policy: str = "lru") -> None:
        """num_slots adapters of rank <= `rank` on the projections `targets` (PEFT module names)
        of a model of `num_layers` layers whose projections have these (in, out) `shapes` (what
        an adapter's files are checked against); at most `max_loaded` loaded (None: no limit).
        policy: which idle adapter gives up its slot, "lru" (the least recently used) or "fifo"
        (the one that took its slot first), as SGLang's --lora-eviction-policy."""
        if max_loaded is not None and max_loaded < num_slots:
            raise ValueError(f"max_loaded {max_loaded} is below the {num_slots} adapter slots")
        if policy not in ("lru", "fifo"):
            raise ValueError(f"the eviction policy is lru or fifo, got {policy!r}")
        self.policy = policy
        self.num_slots = num_slots
        self.rank = rank
        self.targets = targets
        self.num_layers = num_layers
        self.shapes = shapes
        self.max_loaded = max_loaded
        self._loaded: dict[str, LoadedLora] = {}
        self._num_loads = 0
        self._holder: list[str | None] = [None] * num_slots  # the adapter in each slot
        self._last_use: dict[str, int] = {}  # when each slot holder was last acquired (fifo: took its slot)
        self._clock = itertools.count()
        self._writes: dict[int, LoadedLora] = {}  # slots given to an adapter, not written yet

    @property
    def names(self) -> tuple[str, ...]:
        """The loaded adapters, in load order."""
        return tuple(self._loaded)

    @property
    def resident(self) -> tuple[str | None, ...]:
        """The adapter in each slot (None: empty)."""
        return tuple(self._holder)

    def get(self, name: str) -> LoadedLora | None:
        return self._loaded.get(name)

    def slot_of(self, name: str | None) -> int:
        """The slot a row decoding with `name` reads (-1: the base model). Only an adapter of a
        running sequence is asked for, and those hold a slot (`acquire`): KeyError otherwise."""
        if name is None:
            return -1
        try:
            return self._holder.index(name)
        except ValueError:
            raise KeyError(f"LoRA adapter {name!r} holds no adapter slot") from None

    def check_fits(self, name: str, rank: int, targets: tuple[str, ...], pinned: bool = False) -> None:
        """Raises LoraRefused unless an adapter `name` of this rank and these targets can be loaded
        now (a pinned one: see also check_pin)."""
        if name in self._loaded:
            raise LoraRefused(f"a LoRA adapter named {name!r} is already loaded (from {self._loaded[name].path}); "
                              "unload it first")
        self.check_adapter(name, rank, targets)
        if not pinned and sum(lora.pinned for lora in self._loaded.values()) == self.num_slots:
            raise LoraRefused(f"all {self.num_slots} adapter slots (--max-loras) are pinned: an adapter not pinned "
                              "could never run; unload a pinned one first")
        if self.max_loaded is not None and len(self._loaded) >= self.max_loaded:
            raise LoraRefused(f"{self.max_loaded} LoRA adapters are loaded ({', '.join(self._loaded)}), the most "
                              "this server keeps (--max-cpu-loras); unload one first")

    def check_adapter(self, name: str, rank: int, targets: tuple[str, ...]) -> None:
        """Raises LoraRefused unless the slots can hold an adapter of this rank and these targets."""
        if rank > self.rank:
            raise LoraRefused(f"LoRA adapter {name!r} has rank {rank}, above this server's --max-lora-rank {self.rank}",
                              "lora_path")
        missing = sorted(set(targets) - set(self.targets))
        if missing:
            raise LoraRefused(f"LoRA adapter {name!r} adapts {', '.join(missing)}, which this server's adapter "
                              f"slots do not cover ({', '.join(self.targets)}); start it with --enable-lora for "
                              "every projection", "lora_path")

    def check_pin(self, name: str, busy: Collection[str]) -> None:
        """Raises LoraRefused unless a pinned adapter `name` could take a slot now (`busy`: the
        adapters running sequences decode with, whose slots cannot be taken). An adapter `name`
        loaded already is about to be replaced: its slot counts as free."""
        others = [lora for lora in self._loaded.values() if lora.name != name]
        pinned = sum(lora.pinned for lora in others)
        if pinned + 1 > self.num_slots or (pinned + 1 == self.num_slots and pinned < len(others)):
            raise LoraRefused(f"cannot pin LoRA adapter {name!r}: {pinned} of the {self.num_slots} adapter slots "
                              "(--max-loras) are pinned already, and the adapters not pinned need one to take turns "
                              "in", "pinned")
        if name not in self._holder and self._take(busy) is None:
            raise LoraRefused(f"cannot pin LoRA adapter {name!r} now: every adapter slot holds an adapter that running "
                              "requests decode with", "pinned")

    def add(self, name: str, path: Path, rank: int, targets: tuple[str, ...], factors: Mapping[tuple[int, str], Any],
            pinned: bool = False, busy: Collection[str] = ()) -> LoadedLora:
        """Load `name` (after check_fits); it takes a slot when a request of it is admitted, or
        now if pinned (after check_pin with the same `busy`)."""
        self.check_fits(name, rank, targets, pinned)
        if pinned:
            self.check_pin(name, busy)
        self._num_loads += 1
        lora = LoadedLora(name, path, rank, targets, f"{name}\x00{self._num_loads}", factors, pinned)
        self._loaded[name] = lora
        if pinned:
            self.acquire(name, busy)
        return lora

    def remove(self, name: str) -> LoadedLora:
        """Unload `name` (no sequence may read it): its slot, if it holds one, is free."""
        if name not in self._loaded:
            loaded = ", ".join(self._loaded) or "none"
            raise LoraRefused(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        if name in self._holder:
            self._holder[self._holder.index(name)] = None
            del self._last_use[name]
        self._writes = {slot: lora for slot, lora in self._writes.items() if lora.name != name}
        return self._loaded.pop(name)

    def acquire(self, name: str, busy: Collection[str], evict: bool = True) -> int | None:
        """A slot for `name`, whose request is being admitted: its own, else the lowest free one,
        else (evict) that of the least recently acquired adapter neither pinned nor in `busy` (the
        adapters running sequences decode with). None, changing nothing, when there is none. A
        slot changing hands is queued for writing (`take_writes`)."""
        lora = self._loaded[name]
        if name in self._holder:
            slot = self._holder.index(name)
            if self.policy == "fifo":
                return slot
        else:
            found = self._take(busy, evict)
            if found is None:
                return None
            slot = found
            if self._holder[slot] is not None:
                del self._last_use[self._holder[slot]]
            self._holder[slot] = name
            self._writes[slot] = lora
        self._last_use[name] = next(self._clock)
        return slot

    def _take(self, busy: Collection[str], evict: bool = True) -> int | None:
        """The slot a new holder would take: the lowest free one, else (evict) the least recently
        acquired (fifo: the earliest taken) one whose adapter is neither busy nor pinned."""
        free = [s for s, holder in enumerate(self._holder) if holder is None]
        if free:
            return free[0]
        idle = sorted((self._last_use[h], s) for s, h in enumerate(self._holder)
                      if h is not None and h not in busy and not self._loaded[h].pinned)
        return idle[0][1] if evict and idle else None

    def take_writes(self) -> list[tuple[int, LoadedLora]]:
        """The slots given to another adapter since the last call, and the adapter each now holds,
        to be written before any step reads them."""
        writes, self._writes = self._writes, {}
        return sorted(writes.items(), key=lambda item: item[0])
