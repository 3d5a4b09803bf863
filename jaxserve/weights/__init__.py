"""Weight loading: HF safetensors directories, GGUF files, and an orbax cache of converted weights."""

from jaxserve.weights.loader import LoadedModel, load_model, resolve_dtype
from jaxserve.weights.safetensors_dir import WeightsError
from jaxserve.weights.source import ModelSource, resolve

__all__ = ["LoadedModel", "ModelSource", "WeightsError", "load_model", "resolve", "resolve_dtype"]
