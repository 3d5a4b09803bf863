"""Build a ready classifier (decoder + score head, or BERT-style encoder + head) from a Hugging
Face safetensors directory: every parameter is matched to its checkpoint tensor by name and shape,
converted, stacked and placed with its sharding straight from the memory-mapped file, as the
causal-LM loader does; the orbax cache of converted weights is shared with it."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.models.bert import EncoderConfig
from jaxserve.models.classifier import (
    Classifier,
    ClassifierConfig,
    build_classifier,
    classifier_architecture,
    classifier_config_from_hf,
    head_tensor,
)
from jaxserve.models.config import UnsupportedModelError
from jaxserve.weights import orbax_cache
from jaxserve.weights.loader import (
    ShardingFn,
    _leaf_paths,
    _set,
    hf_name,
    merge,
    resolve_dtype,
    restore_or_build,
    single_device_sharding,
)
from jaxserve.weights.safetensors_dir import WeightsError
from jaxserve.weights.source import ModelSource, resolve

log = logging.getLogger("jaxserve.weights")

NameFn = Callable[[tuple[str, ...]], tuple[str, bool, bool]]

# Buffers some checkpoints persist that no model reads.
_IGNORED_SUFFIXES = ("embeddings.position_ids", "rotary_emb.inv_freq")


@dataclasses.dataclass
class LoadedClassifier:
    config: ClassifierConfig
    model: Classifier
    source: ModelSource
    dtype: Any
    load_seconds: float
    from_cache: bool


# ---- parameter paths -> HF tensor names -----------------------------------------------------------
_LAYER_NAMES = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attn_out": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "intermediate": "intermediate.dense",
    "output": "output.dense",
    "out_norm": "output.LayerNorm",
}
_TOP_NAMES = {
    "word_embeddings": "embeddings.word_embeddings",
    "position_embeddings": "embeddings.position_embeddings",
    "token_type_embeddings": "embeddings.token_type_embeddings",
    "embeddings_norm": "embeddings.LayerNorm",
    "pooler": "pooler.dense",
}
_HEAD_NAMES = {"classifier": "classifier", "head_dense": "classifier.dense", "head_out": "classifier.out_proj"}


def encoder_hf_name(cfg: EncoderConfig, path: tuple[str, ...]) -> tuple[str, bool, bool]:
    """Parameter path -> (HF name, with {i} for the layer; stacked; transposed)."""
    *module, leaf = path
    transposed = leaf == "kernel"
    hf_leaf = "weight" if transposed else leaf
    if module and module[0] == "layers":
        return f"{cfg.prefix}encoder.layer.{{i}}.{_LAYER_NAMES[module[1]]}.{hf_leaf}", True, transposed
    if not module:  # an embedding table is a bare parameter
        return f"{cfg.prefix}{_TOP_NAMES[leaf]}.weight", False, False
    if module[0] in _HEAD_NAMES:
        return f"{_HEAD_NAMES[module[0]]}.{hf_leaf}", False, transposed
    return f"{cfg.prefix}{_TOP_NAMES[module[0]]}.{hf_leaf}", False, transposed


def decoder_classifier_hf_name(path: tuple[str, ...]) -> tuple[str, bool, bool]:
    """Parameter path -> (HF name with {i} for the layer, stacked, transposed)."""
    if path[0] == "model":
        return hf_name(path[1:])  # the causal LM's own map, for the body
    module, leaf = path
    hf = {"score": "score", "score_hidden": "score.0", "score_out": "score.2"}[module]
    transposed = leaf == "kernel"
    return f"{hf}.{'weight' if transposed else leaf}", False, transposed


def hf_name_fn(cfg: ClassifierConfig) -> NameFn:
    if isinstance(cfg.body, EncoderConfig):
        body = cfg.body
        return lambda path: encoder_hf_name(body, path)
    return decoder_classifier_hf_name


def num_layers(cfg: ClassifierConfig) -> int:
    return cfg.body.num_layers


def _tensor(source: ModelSource, name: str) -> str:
    """The checkpoint's name for `name`: old BERT checkpoints call LayerNorm weights gamma/beta."""
    if name in source.tensors:
        return name
    for new, old in ((".LayerNorm.weight", ".LayerNorm.gamma"), (".LayerNorm.bias", ".LayerNorm.beta")):
        if name.endswith(new) and name[: -len(new)] + old in source.tensors:
            return name[: -len(new)] + old
    raise WeightsError(f"{source.path}: tensor {name} is missing from the checkpoint")


def _ignored(cfg: ClassifierConfig, name: str) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    # RoBERTa classifiers read <s> through their own head; a pooler left in the file is unused.
    return isinstance(cfg.body, EncoderConfig) and cfg.body.head == "roberta" and name.startswith("roberta.pooler.")


def check_tensors(cfg: ClassifierConfig, source: ModelSource, leaves: list[tuple[tuple[str, ...], Any]]) -> None:
    """Every parameter's tensor exists with the shape the config implies; nothing is left over."""
    name_of = hf_name_fn(cfg)
    used = set()
    for path, spec in leaves:
        template, stacked, transposed = name_of(path)
        names = [template.format(i=i) for i in range(num_layers(cfg))] if stacked else [template]
        shape = tuple(spec.shape[1:] if stacked else spec.shape)
        want = shape[::-1] if transposed else shape
        for name in names:
            actual = _tensor(source, name)
            used.add(actual)
            got = source.tensors[actual][1]
            if got != want:
                raise WeightsError(f"{source.path}: tensor {actual} has shape {got}, the config implies {want}")
    extra = sorted(n for n in set(source.tensors) - used if not _ignored(cfg, n))
    if extra:
        more = " ..." if len(extra) > 5 else ""
        raise WeightsError(f"{source.path}: tensors the model does not use: {extra[:5]}{more}")


def _make_array(source: ModelSource, name_of: NameFn, path: tuple[str, ...], spec: Any, layers: int, dtype: Any,
                sharding: jax.sharding.Sharding) -> jax.Array:
    template, stacked, transposed = name_of(path)

    def host(name: str, index: tuple[slice, ...]) -> np.ndarray:
        w = source.tensors[_tensor(source, name)][0]()
        w = w.T if transposed else w
        return np.asarray(w[index], dtype=dtype)

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        if not stacked:
            return host(template, index)
        return np.stack([host(template.format(i=i), index[1:]) for i in range(layers)[index[0]]])

    return jax.make_array_from_callback(spec.shape, sharding, callback)


def abstract_classifier(cfg: ClassifierConfig, dtype: Any) -> tuple[nnx.GraphDef, nnx.State, dict]:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_classifier(cfg, dtype)))
    return graphdef, state, nnx.to_pure_dict(state)


def build_from_source(cfg: ClassifierConfig, source: ModelSource, dtype: Any,
                      sharding: ShardingFn = single_device_sharding) -> Classifier:
    graphdef, state, tree = abstract_classifier(cfg, dtype)
    leaves = _leaf_paths(tree)
    check_tensors(cfg, source, leaves)
    name_of = hf_name_fn(cfg)
    total = sum(int(np.prod(s.shape)) * jnp.dtype(dtype).itemsize for _, s in leaves)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {source.path.name}", leave=False,
              disable=None) as bar:
        for path, spec in leaves:
            arr = _make_array(source, name_of, path, spec, num_layers(cfg), dtype, sharding(path, spec.shape))
            _set(tree, path, arr)
            bar.update(arr.nbytes)
    return merge(graphdef, state, tree)


def read_classifier_config(source: ModelSource) -> ClassifierConfig:
    """The classifier's config; the number of classes is read from its head tensor's shape."""
    if source.kind != "hf":
        raise UnsupportedModelError(f"{source.path}: classification models load from a Hugging Face directory "
                                    "(config.json + *.safetensors), not GGUF")
    arch = classifier_architecture(source.config)
    if arch is None:
        # Let the config parser name the supported architectures.
        return classifier_config_from_hf(source.config, 1)
    head = head_tensor(arch)
    if head not in source.tensors:
        raise WeightsError(f"{source.path}: tensor {head} (the {arch} head) is missing from the checkpoint")
    return classifier_config_from_hf(source.config, int(source.tensors[head][1][0]))


def load_classifier(
    model: str | Path,
    dtype: str = "auto",
    *,
    cache_dir: Path | None = None,
    use_cache: bool = True,
    sharding: ShardingFn = single_device_sharding,
) -> LoadedClassifier:
    """Load a classifier checkpoint. With use_cache, converted weights go to (and later come from)
    the orbax cache under cache_dir, keyed by the source files and the dtype."""
    start = time.perf_counter()
    source = resolve(model)
    cfg = read_classifier_config(source)
    jdtype = resolve_dtype(dtype, cfg.dtype, jax.devices()[0].platform)
    weights_dir = None
    if use_cache and cache_dir is not None:
        weights_dir = orbax_cache.entry_dir(cache_dir, source.fingerprint()) / jnp.dtype(jdtype).name
    classifier, from_cache = restore_or_build(weights_dir, lambda: abstract_classifier(cfg, jdtype),
                                              lambda: build_from_source(cfg, source, jdtype, sharding), sharding,
                                              source.config)
    seconds = time.perf_counter() - start
    log.info("loaded %s (%s, %d labels, %s, %d layers) in %.2fs%s", source.path, cfg.architecture, cfg.num_labels,
             jnp.dtype(jdtype).name, num_layers(cfg), seconds, " from the orbax cache" if from_cache else "")
    return LoadedClassifier(cfg, classifier, source, jdtype, seconds, from_cache)


__all__ = ["LoadedClassifier", "load_classifier", "read_classifier_config"]
