"""Build Qwen2.5-VL's vision encoder from a Hugging Face safetensors directory: each parameter is
matched to its checkpoint tensor by name and shape and placed with its sharding straight from the
memory-mapped file (jaxserve.weights.tree), as the language model's loader does.

Checkpoints name the encoder's tensors `visual.*` (the Hub's files, and what transformers 5.17's
save_pretrained writes) or `model.visual.*` (the in-memory layout of transformers 5.x, which some
saves keep); both load. The language model's tensors are the causal-LM loader's business:
`vision_tensor` tells them apart.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxserve.models.qwen2_vl_vision import Qwen2VisionTransformer, VisionConfig, vision_config_from_hf
from jaxserve.weights.safetensors_dir import WeightsError
from jaxserve.weights.source import ModelSource, resolve
from jaxserve.weights.tree import (
    NameFn,
    ParamPath,
    ShardingFn,
    abstract,
    fill_from_source,
    leaf_paths,
    single_device_sharding,
    tensor_names,
)

__all__ = ["LoadedVision", "load_vision_model", "vision_hf_name", "vision_prefix", "vision_tensor"]

PREFIXES = ("model.visual.", "visual.")
_MERGER = {"fc1": "mlp.0", "fc2": "mlp.2"}


def vision_tensor(name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to the vision encoder (either layout)."""
    return name.startswith(PREFIXES)


@dataclasses.dataclass
class LoadedVision:
    config: VisionConfig
    model: Qwen2VisionTransformer
    source: ModelSource
    dtype: Any


def vision_prefix(source: ModelSource) -> str:
    """The prefix the checkpoint stores the encoder under; WeightsError when it holds none."""
    for prefix in PREFIXES:
        if any(name.startswith(prefix) for name in source.tensors):
            return prefix
    raise WeightsError(f"{source.path}: the checkpoint has no vision encoder tensors (visual.* or model.visual.*)")


def vision_hf_name(prefix: str) -> NameFn:
    """Parameter path -> (HF tensor name, transposed) under `prefix`."""

    def name_of(path: ParamPath) -> tuple[str, bool]:
        if path == ("patch_embed",):
            return f"{prefix}patch_embed.proj.weight", False  # Conv3d's own [out, C, T, p, p]
        *module, leaf = path
        transposed = leaf == "kernel"
        if module[0] == "merger":
            module = [module[0], _MERGER.get(module[1], module[1])]
        return f"{prefix}{'.'.join(map(str, module))}.{'weight' if transposed else leaf}", transposed

    return name_of


def load_vision_model(model: str | Path | ModelSource, dtype: Any, sharding: ShardingFn = single_device_sharding
                      ) -> LoadedVision:
    """The encoder of the Qwen2.5-VL checkpoint `model` (a directory or its resolved source), every
    weight converted to `dtype` (a jnp dtype: the language model's). Raises WeightsError naming a
    missing or misshapen tensor, or an encoder tensor the model does not use."""
    source = model if isinstance(model, ModelSource) else resolve(model)
    if source.kind != "hf":
        raise WeightsError(f"{source.path}: a vision encoder loads from a Hugging Face safetensors directory")
    cfg = vision_config_from_hf(source.config)
    prefix = vision_prefix(source)
    graphdef, state, tree = abstract(lambda: Qwen2VisionTransformer(cfg, dtype))
    names = tensor_names(source, leaf_paths(tree), vision_hf_name(prefix),
                         ignored=lambda name: not name.startswith(prefix))
    module = fill_from_source(graphdef, state, tree, source, names, dtype, sharding)
    return LoadedVision(cfg, module, source, dtype)
