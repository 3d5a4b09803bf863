"""Which LoRA adapter holds which of the model's adapter slots (host bookkeeping, no jax).

The model is compiled with a fixed number of slots of a fixed rank, on a fixed set of projections
(jaxserve.models.lora). Loading an adapter takes a free slot and writes its factors there (the
runner's `write_lora_slot`); unloading frees it. A request names its adapter, and its batch row
reads that slot. Refusals are ValueErrors whose message says what the server can hold.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class LoadedLora:
    name: str
    path: Path
    slot: int
    rank: int
    targets: tuple[str, ...]


class LoraSlots:
    def __init__(self, num_slots: int, rank: int, targets: tuple[str, ...]):
        """num_slots adapters of rank <= `rank` on the projections `targets` (PEFT module names)."""
        self.num_slots = num_slots
        self.rank = rank
        self.targets = targets
        self._loaded: dict[str, LoadedLora] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._loaded)

    @property
    def adapters(self) -> dict[str, Path]:
        """Loaded adapters by name -> their directory, in load order."""
        return {name: lora.path for name, lora in self._loaded.items()}

    def get(self, name: str) -> LoadedLora | None:
        return self._loaded.get(name)

    def slot_of(self, name: str | None) -> int:
        """The slot a request naming `name` reads (-1: the base model)."""
        return -1 if name is None else self._loaded[name].slot

    def check_fits(self, name: str, rank: int, targets: tuple[str, ...]) -> None:
        """Raises ValueError unless an adapter `name` of this rank and these targets can be loaded now."""
        if name in self._loaded:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (from {self._loaded[name].path}); "
                             "unload it first")
        if rank > self.rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above this server's --max-lora-rank {self.rank}")
        missing = sorted(set(targets) - set(self.targets))
        if missing:
            raise ValueError(f"LoRA adapter {name!r} adapts {', '.join(missing)}, which this server's adapter slots do "
                             f"not cover ({', '.join(self.targets)}); start it with --enable-lora for every projection")
        if len(self._loaded) >= self.num_slots:
            raise ValueError(f"all {self.num_slots} LoRA adapter slots are taken ({', '.join(self._loaded)}; "
                             "--max-loras); unload one first")

    def add(self, name: str, path: Path, rank: int, targets: tuple[str, ...]) -> LoadedLora:
        """Give `name` a free slot (after check_fits)."""
        self.check_fits(name, rank, targets)
        used = {lora.slot for lora in self._loaded.values()}
        slot = min(s for s in range(self.num_slots) if s not in used)
        lora = LoadedLora(name, path, slot, rank, targets)
        self._loaded[name] = lora
        return lora

    def remove(self, name: str) -> LoadedLora:
        if name not in self._loaded:
            loaded = ", ".join(self._loaded) or "none"
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return self._loaded.pop(name)
