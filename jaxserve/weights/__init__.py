"""Weight loading: HF safetensors directories, GGUF files, and an orbax cache of converted weights.

The loaders need jax; the checkpoint readers (safetensors_dir, gguf_file, source) do not, so the
names below are imported on first use and a tokenizer read from a GGUF file imports no jax."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LoadedModel": "jaxserve.weights.loader",
    "load_model": "jaxserve.weights.loader",
    "resolve_dtype": "jaxserve.weights.loader",
    "WeightsError": "jaxserve.weights.safetensors_dir",
    "ModelSource": "jaxserve.weights.source",
    "resolve": "jaxserve.weights.source",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
