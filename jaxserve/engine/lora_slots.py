"""Which LoRA adapter holds which of the model's adapter slots (host bookkeeping, no jax).

The model is compiled with a fixed number of slots of a fixed rank, on a fixed set of projections
(jaxserve.models.lora). Loading an adapter takes a free slot and writes its factors there (the
runner's `write_lora_slot`); unloading frees it. A request names its adapter, and its batch row
reads that slot. Refusals are LoraRefused (ValueError) errors saying what the server can hold.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


class LoraRefused(ValueError):
    """An adapter this model's slots cannot take (now); `param` names what is wrong: the name
    (taken, unknown, no free slot) or the adapter at the path (its rank or projections)."""

    def __init__(self, message: str, param: str = "lora_name") -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class LoadedLora:
    """An adapter in a slot. `key` is unique to this load (the name and a load count): the prefix
    cache's pages of its requests hang from it, so an adapter loaded later under the same name
    never reads this one's K/V."""

    name: str
    path: Path
    slot: int
    rank: int
    targets: tuple[str, ...]
    key: str


class LoraSlots:
    """The model's adapter slots and the adapters in them."""

    def __init__(self, num_slots: int, rank: int, targets: tuple[str, ...], num_layers: int,
                 shapes: dict[str, tuple[int, int]]) -> None:
        """num_slots adapters of rank <= `rank` on the projections `targets` (PEFT module names)
        of a model of `num_layers` layers whose projections have these (in, out) `shapes` (what
        an adapter's files are checked against)."""
        self.num_slots = num_slots
        self.rank = rank
        self.targets = targets
        self.num_layers = num_layers
        self.shapes = shapes
        self._loaded: dict[str, LoadedLora] = {}
        self._num_loads = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._loaded)

    def get(self, name: str) -> LoadedLora | None:
        return self._loaded.get(name)

    def slot_of(self, name: str | None) -> int:
        """The slot a request naming `name` reads (-1: the base model)."""
        return -1 if name is None else self._loaded[name].slot

    def check_fits(self, name: str, rank: int, targets: tuple[str, ...]) -> None:
        """Raises LoraRefused unless an adapter `name` of this rank and these targets can be loaded now."""
        if name in self._loaded:
            raise LoraRefused(f"a LoRA adapter named {name!r} is already loaded (from {self._loaded[name].path}); "
                              "unload it first")
        self.check_adapter(name, rank, targets)
        if len(self._loaded) >= self.num_slots:
            raise LoraRefused(f"all {self.num_slots} LoRA adapter slots are taken ({', '.join(self._loaded)}; "
                              "--max-loras); unload one first")

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

    def add(self, name: str, path: Path, rank: int, targets: tuple[str, ...]) -> LoadedLora:
        """Give `name` a free slot (after check_fits)."""
        self.check_fits(name, rank, targets)
        used = {lora.slot for lora in self._loaded.values()}
        slot = min(s for s in range(self.num_slots) if s not in used)
        self._num_loads += 1
        lora = LoadedLora(name, path, slot, rank, targets, f"{name}\x00{self._num_loads}")
        self._loaded[name] = lora
        return lora

    def remove(self, name: str) -> LoadedLora:
        if name not in self._loaded:
            loaded = ", ".join(self._loaded) or "none"
            raise LoraRefused(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return self._loaded.pop(name)
