"""Build a ready VisionModel (LLaVA-OneVision / LLaVA-NeXT image side) from the safetensors directory
that also holds the language model, as the causal-LM loader does (jaxserve.weights.tree): every
parameter matched to its checkpoint tensor by name and shape, converted and placed with its
sharding straight from the memory-mapped file.

The same tensors go by several names, and all of them load:
  llava-hf on the Hub         vision_tower.vision_model.encoder.layers.0...., multi_modal_projector....,
                              image_newline (the LM under language_model.model. and language_model.lm_head.)
  transformers 5.17 saves     the same without the tower's vision_model. level (vision_tower.encoder....)
  transformers 5 in memory    everything under model. (model.vision_tower.encoder...., model.image_newline),
                              with or without vision_model.
The layout is read off the checkpoint once, so a missing tensor is named as that checkpoint would
name it.

Tensors the model never reads are allowed: the tower's layers past the deepest feature layer, its
post_layernorm, SigLIP's pooling head, and every language-model tensor (`vision_tensor` tells the
LM loader which to skip).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.models.vision import VisionConfig, VisionModel
from jaxserve.weights.dummy import _drawer, init_kind
from jaxserve.weights.source import ModelSource
from jaxserve.weights.tree import (
    ParamPath,
    ShardingFn,
    abstract,
    fill_from_source,
    leaf_paths,
    merge,
    set_leaf,
    single_device_sharding,
    tensor_names,
)

_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")
_UNUSED_TOWER = ("post_layernorm.", "head.", "embeddings.position_ids")
_LAYER = re.compile(r"encoder\.layers\.(\d+)\.")


def vision_tensor(name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to the image side (tower, projector, newline)."""
    name = name.removeprefix("model.")
    return name.startswith(_VISION_PREFIXES) or name == "image_newline"


def _layout(source: ModelSource) -> tuple[str, str]:
    """(prefix of the image side: "model." or "", prefix of the tower's own names)."""
    names = [n for n in source.tensors if vision_tensor(n)]
    top = "model." if any(n.startswith("model.") for n in names) else ""
    tower = [n for n in names if n.startswith(f"{top}vision_tower.")]
    # With no tower at all, name what is missing as the Hub's checkpoints do.
    nested = not tower or any(n.startswith(f"{top}vision_tower.vision_model.") for n in tower)
    return top, f"{top}vision_tower.{'vision_model.' if nested else ''}"


def vision_hf_name(path: ParamPath, layout: tuple[str, str]) -> tuple[str, bool]:
    """Parameter path -> (checkpoint tensor name, transposed) in the checkpoint's `layout`."""
    top, tower = layout
    *module, leaf = path
    transposed = leaf == "kernel"
    leaf = "weight" if transposed else leaf
    if not module and leaf == "image_newline":
        return f"{top}image_newline", False
    if module and module[0] == "multi_modal_projector":
        return f"{top}{'.'.join(map(str, module))}.{leaf}", transposed
    if module and module[0] == "layers":
        return f"{tower}encoder.layers.{'.'.join(map(str, module[1:]))}.{leaf}", transposed
    if leaf == "position_embedding":  # an embedding table is a bare parameter
        return f"{tower}embeddings.position_embedding.weight", False
    return f"{tower}{'.'.join(map(str, (*module, leaf)))}", transposed


def _unused(cfg: VisionConfig, layout: tuple[str, str], name: str) -> bool:
    if not vision_tensor(name):
        return True  # the language model's
    rest = name.removeprefix(layout[1])
    if rest == name:
        return False
    layer = _LAYER.match(rest)
    return rest.startswith(_UNUSED_TOWER) or (layer is not None and int(layer.group(1)) >= cfg.num_layers_used)


def load_vision(source: ModelSource, cfg: VisionConfig, dtype: Any,
                sharding: ShardingFn = single_device_sharding) -> VisionModel:
    """The image side of a LLaVA checkpoint; raises WeightsError naming a missing or misshapen tensor."""
    graphdef, state, tree = abstract(lambda: VisionModel(cfg, dtype))
    layout = _layout(source)
    names = tensor_names(source, leaf_paths(tree), lambda path: vision_hf_name(path, layout),
                         ignored=lambda name: _unused(cfg, layout, name))
    return fill_from_source(graphdef, state, tree, source, names, dtype, sharding)


def random_vision(cfg: VisionConfig, dtype: Any, sharding: ShardingFn = single_device_sharding,
                  seed: int = 0) -> VisionModel:
    """A VisionModel of `cfg`'s shapes with random weights (--load-format dummy), drawn as the
    decoder's are (jaxserve.weights.dummy): matrices N(0, 0.02^2), norm scales 1, biases 0."""
    graphdef, state, tree = abstract(lambda: VisionModel(cfg, dtype))
    key = jax.random.key(seed)
    for i, (path, spec) in enumerate(leaf_paths(tree)):
        shape = tuple(spec.shape)
        draw = _drawer(init_kind(path), shape, jnp.dtype(dtype), sharding(path, shape))
        set_leaf(tree, path, draw(jax.random.fold_in(key, i)))
    return merge(graphdef, state, tree)


__all__ = ["load_vision", "random_vision", "vision_hf_name", "vision_tensor"]
