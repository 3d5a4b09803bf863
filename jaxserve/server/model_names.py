"""Which model names a request may send: the served names (--served-model-name A B ...), an
omitted model, the generic names the seed documents' examples send, or any name with
--accept-any-model-name; and, on the generation routes, a LoRA adapter's (--lora-modules), which
selects that adapter. One check shared by every route that takes a model name."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.server.errors import ApiError

# Names that mean "whatever this server serves": FastDeploy's examples send "default" and "null".
GENERIC_NAMES = ("default", "null")


@dataclasses.dataclass(frozen=True)
class ModelNames:
    names: tuple[str, ...]  # the first is the one responses report
    accept_any: bool = False
    # LoRA adapters (--lora-modules, or loaded while serving): models of their own to clients, as
    # (name, directory, the parent /v1/models names or None for the served model).
    adapters: tuple[tuple[str, str, str | None], ...] = ()

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("a server serves at least one model name")

    @classmethod
    def of(cls, served: str | ModelNames) -> ModelNames:
        return served if isinstance(served, ModelNames) else cls((served,))

    @property
    def primary(self) -> str:
        return self.names[0]

    def accepts(self, name: str | None) -> bool:
        return name is None or self.accept_any or name in self.names or name in GENERIC_NAMES

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(a[0] for a in self.adapters)

    def check(self, name: str | None, param: str = "model") -> None:
        """404 (OpenAI's model_not_found) unless a request naming `name` is for this server's base
        model; 400 for an adapter's name (routes that take one call `lora`)."""
        if name in self.adapter_names:
            raise ApiError(400, f"`{name}` is a LoRA adapter, and only text generation decodes with adapters; "
                           f"this route serves the base model `{self.primary}`.", param)
        if not self.accepts(name):
            served = ", ".join(f"`{n}`" for n in self.names)
            raise ApiError(404, f"The model `{name}` does not exist; this server serves {served}.", param,
                           code="model_not_found")

    def lora(self, name: str | None, param: str = "model") -> str | None:
        """The LoRA adapter a generation request naming `name` decodes with (None: the base model),
        after `check`'s rules for any other name."""
        if name is not None and name in self.adapter_names:
            return name
        self.check(name, param)
        return None

    def reported(self, requested: str | None) -> str:
        """The model name a response to a request for `requested` reports: an adapter's own (as
        vLLM does), else the served name."""
        return requested if requested is not None and requested in self.adapter_names else self.primary

    def cards(self, created: int, max_model_len: int) -> dict:
        """/v1/models: one card per served name (as vLLM lists them), the reported one first, then
        one per LoRA adapter."""
        return {"object": "list", "data": [self.card(name, created, max_model_len)
                                           for name in (*self.names, *self.adapter_names)]}

    def card(self, name: str, created: int, max_model_len: int) -> dict:
        """/v1/models/{name} (OpenAI's retrieve): the card of a name this server answers to, else 404.
        An adapter's card names its directory as root and the served model as parent (vLLM's)."""
        adapters = {a[0]: a for a in self.adapters}
        if name in adapters:
            _, path, parent = adapters[name]
            return {"id": name, "object": "model", "created": created, "owned_by": "jaxserve", "root": path,
                    "parent": parent or self.primary, "max_model_len": max_model_len, "permission": []}
        self.check(name)
        if name not in self.names:  # "default", or any name under --accept-any-model-name: the served model
            name = self.primary
        return {"id": name, "object": "model", "created": created, "owned_by": "jaxserve", "root": self.primary,
                "parent": None, "max_model_len": max_model_len, "permission": []}


def served_names(config: Any) -> ModelNames:
    """The names a server started from `config` (jaxserve.config.Config) answers to."""
    return ModelNames(config.model.served_model_names, config.model.accept_any_model_name,
                      tuple((spec.name, str(spec.path), spec.base_model_name) for spec in config.model.lora_modules))
