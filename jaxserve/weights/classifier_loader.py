"""Build a ready classifier (decoder + score head, or BERT-style encoder + head) or embedding model
(encoder or decoder body + pooling) from a Hugging Face safetensors directory: every parameter is matched to its checkpoint tensor by name and shape,
converted and placed with its sharding straight from the memory-mapped file, as the causal-LM
loader does (jaxserve.weights.tree); the orbax cache of converted weights is shared with it."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.bert import EncoderConfig
from jaxserve.models.classifier import (
    ClassifierConfig,
    classifier_architecture,
    classifier_config_from_hf,
    head_tensor,
    token_head,
)
from jaxserve.models.config import UnsupportedModelError
from jaxserve.models.embedder import (
    EmbedderConfig,
    PoolingConfig,
    PoolingModel,
    build_pooling_model,
    embedder_config_from_hf,
)
from jaxserve.weights import orbax_cache
from jaxserve.weights.loader import hf_name, resolve_dtype, restore_or_build
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

log = logging.getLogger("jaxserve.weights")

# Buffers some checkpoints persist that no model reads.
_IGNORED_SUFFIXES = ("embeddings.position_ids", "rotary_emb.inv_freq")


@dataclasses.dataclass
class LoadedClassifier:
    """A loaded classifier or embedding model (both pool one output per input)."""

    config: PoolingConfig
    model: PoolingModel
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


def encoder_hf_name(cfg: EncoderConfig, path: ParamPath) -> tuple[str, bool]:
    """Parameter path -> (HF name, transposed)."""
    *module, leaf = path
    transposed = leaf == "kernel"
    hf_leaf = "weight" if transposed else leaf
    if module and module[0] == "layers":
        return f"{cfg.prefix}encoder.layer.{module[1]}.{_LAYER_NAMES[module[2]]}.{hf_leaf}", transposed
    if not module:  # an embedding table is a bare parameter
        return f"{cfg.prefix}{_TOP_NAMES[leaf]}.weight", False
    if module[0] in _HEAD_NAMES:
        return f"{_HEAD_NAMES[module[0]]}.{hf_leaf}", transposed
    return f"{cfg.prefix}{_TOP_NAMES[module[0]]}.{hf_leaf}", transposed


def decoder_classifier_hf_name(path: ParamPath) -> tuple[str, bool]:
    """Parameter path -> (HF name, transposed)."""
    if path[0] == "model":
        return hf_name(path[1:])  # the causal LM's own map, for the body
    module, leaf = path
    hf = {"score": "score", "score_hidden": "score.0", "score_out": "score.2"}[module]
    transposed = leaf == "kernel"
    return f"{hf}.{'weight' if transposed else leaf}", transposed


def hf_name_fn(cfg: PoolingConfig) -> NameFn:
    if isinstance(cfg, EmbedderConfig):  # the body under `model`, named as its own checkpoint names it
        body = cfg.body
        if isinstance(body, EncoderConfig):
            return lambda path: encoder_hf_name(body, path[1:])
        return lambda path: hf_name(path[1:])
    if isinstance(cfg.body, EncoderConfig):
        encoder = cfg.body
        return lambda path: encoder_hf_name(encoder, path)
    return decoder_classifier_hf_name


def num_layers(cfg: PoolingConfig) -> int:
    return cfg.body.num_layers


def _alias(source: ModelSource, name: str) -> str:
    """The checkpoint's name for `name`: old BERT checkpoints call LayerNorm weights gamma/beta; a
    bare decoder body (Qwen3-Embedding) is saved without the causal LM's `model.` prefix, and a
    bare encoder may be saved with its task model's `bert.` / `roberta.` prefix."""
    if name in source.tensors:
        return name
    for new, old in ((".LayerNorm.weight", ".LayerNorm.gamma"), (".LayerNorm.bias", ".LayerNorm.beta")):
        if name.endswith(new) and name[: -len(new)] + old in source.tensors:
            return name[: -len(new)] + old
    for other in (name.removeprefix("model."), "bert." + name, "roberta." + name):
        if other != name and other in source.tensors:
            return other
    return name


def _ignored(cfg: PoolingConfig, name: str) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    if isinstance(cfg, EmbedderConfig):
        # Pooling reads the hidden states: BERT's pooler and a causal LM's head are unused.
        return name == "lm_head.weight" or name.removeprefix("bert.").removeprefix("roberta.").startswith("pooler.")
    if cfg.from_tokens and name == "lm_head.weight":  # read through the derived score.weight
        return True
    # RoBERTa classifiers read <s> through their own head; a pooler left in the file is unused.
    return isinstance(cfg.body, EncoderConfig) and cfg.body.head == "roberta" and name.startswith("roberta.pooler.")


def abstract_classifier(cfg: PoolingConfig, dtype: Any) -> tuple[nnx.GraphDef, nnx.State, dict]:
    return abstract(lambda: build_pooling_model(cfg, dtype))


def add_token_head(cfg: ClassifierConfig, source: ModelSource) -> None:
    """Give `source` the `score.weight` a classifier_from_token head reads: the LM head's rows of
    its tokens (or, for Qwen3-Reranker, the second row minus the first), computed in float32."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    ids = []
    for token in cfg.from_tokens:
        i = tokenizer.convert_tokens_to_ids(token)
        if i is None or (i == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise UnsupportedModelError(f"classifier_from_token: {token!r} is not a token of the vocabulary")
        ids.append(int(i))
    lm = "lm_head.weight" if "lm_head.weight" in source.tensors else _alias(source, "model.embed_tokens.weight")
    if lm not in source.tensors:
        raise WeightsError(f"{source.path}: classifier_from_token needs the LM head (lm_head.weight or the tied "
                           "model.embed_tokens.weight)")
    read, (vocab, hidden), _ = source.tensors[lm]

    def score() -> np.ndarray:
        rows = np.asarray(read()[ids], np.float32)
        return rows[1:] - rows[:1] if cfg.token_difference else rows

    source.tensors["score.weight"] = (score, (1 if cfg.token_difference else len(ids), hidden), np.dtype(np.float32))


def build_from_source(cfg: PoolingConfig, source: ModelSource, dtype: Any,
                      sharding: ShardingFn = single_device_sharding) -> PoolingModel:
    if isinstance(cfg, ClassifierConfig) and cfg.from_tokens:
        add_token_head(cfg, source)
    graphdef, state, tree = abstract_classifier(cfg, dtype)
    names = tensor_names(source, leaf_paths(tree), hf_name_fn(cfg), alias=lambda n: _alias(source, n),
                         ignored=lambda n: _ignored(cfg, n))
    return fill_from_source(graphdef, state, tree, source, names, dtype, sharding)


def read_classifier_config(source: ModelSource, task: str = "classify") -> PoolingConfig:
    """The classifier's config (the number of classes is read from its head tensor's shape), or
    the embedding model's (task "embed")."""
    if source.kind != "hf":
        raise UnsupportedModelError(f"{source.path}: classification and embedding models load from a Hugging Face "
                                    "directory (config.json + *.safetensors), not GGUF")
    if task == "embed":
        return embedder_config_from_hf(source.config, source.path)
    arch = classifier_architecture(source.config)
    if arch is None:
        # Let the config parser name the supported architectures.
        return classifier_config_from_hf(source.config, 1)
    from_tokens = token_head(source.config)
    if from_tokens is not None:
        tokens, difference = from_tokens
        return classifier_config_from_hf(source.config, 1 if difference else len(tokens))
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
    task: str = "classify",
    hf_overrides: dict[str, Any] | None = None,
) -> LoadedClassifier:
    """Load a classifier (task "classify") or embedding model ("embed") checkpoint. With
    use_cache, converted weights go to (and later come from) the orbax cache under cache_dir,
    keyed by the source files, the dtype and the task (their parameter trees differ)."""
    start = time.perf_counter()
    source = resolve(model, overrides=hf_overrides)
    cfg = read_classifier_config(source, task)
    jdtype = resolve_dtype(dtype, cfg.dtype, jax.devices()[0].platform)
    weights_dir = None
    if use_cache and cache_dir is not None:
        entry = orbax_cache.entry_dir(cache_dir, source.fingerprint()) / jnp.dtype(jdtype).name
        weights_dir = entry if task == "classify" else entry.with_name(f"{entry.name}-{task}")
    classifier, from_cache = restore_or_build(weights_dir, lambda: abstract_classifier(cfg, jdtype),
                                              lambda: build_from_source(cfg, source, jdtype, sharding), sharding,
                                              source.config)
    seconds = time.perf_counter() - start
    what = (f"{cfg.pooling} pooling{', normalised' if cfg.normalize else ''}" if isinstance(cfg, EmbedderConfig)
            else f"{cfg.num_labels} labels")
    log.info("loaded %s (%s, %s, %s, %d layers) in %.2fs%s", source.path, cfg.architecture, what,
             jnp.dtype(jdtype).name, num_layers(cfg), seconds, " from the orbax cache" if from_cache else "")
    return LoadedClassifier(cfg, classifier, source, jdtype, seconds, from_cache)


__all__ = ["LoadedClassifier", "load_classifier", "read_classifier_config"]
