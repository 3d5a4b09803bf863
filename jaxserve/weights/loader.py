"""Build a ready Decoder from a checkpoint: map HF tensor names onto the model's parameters (one
buffer per layer, as the checkpoint stores them), convert dtype, and place every array with its
sharding straight from the source (each device shard is read from the memory-mapped file; no full
copy on one device first)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import DecoderConfig, decoder_config_from_hf
from jaxserve.models.decoder import Decoder
from jaxserve.weights import orbax_cache
from jaxserve.weights.source import ModelSource, resolve
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

log = logging.getLogger("jaxserve.weights")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
LOAD_FORMATS = ("auto", "dummy")


@dataclasses.dataclass
class LoadedModel:
    config: DecoderConfig
    model: Decoder
    source: ModelSource
    dtype: Any
    load_seconds: float
    from_cache: bool


def resolve_dtype(requested: str, checkpoint_dtype: str, platform: str, native_bf16: bool | None = None) -> Any:
    """--dtype: float32 | bfloat16 | auto. auto is the checkpoint's own precision, never more: float32
    checkpoints run in float32, 16-bit and quantized ones (GGUF) in bfloat16 -- except on a CPU
    without native bfloat16 arithmetic (`native_bf16`, default: read from this CPU), where
    bfloat16 products are emulated and everything runs in float32."""
    if requested in DTYPES:
        return DTYPES[requested]
    if requested != "auto":
        raise ValueError(f"--dtype {requested!r} is not one of auto, float32, bfloat16")
    if checkpoint_dtype == "float32":
        return jnp.float32
    if platform == "cpu" and not (cpu_has_native_bf16() if native_bf16 is None else native_bf16):
        return jnp.float32
    # float16 checkpoints run as bfloat16: same memory, and no overflow in activations.
    return jnp.bfloat16


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (x86 AVX512-BF16 or AMX-BF16, Arm
    BF16), which XLA:CPU's matmuls use: there bfloat16 served 16 sequences 1.8x faster than
    float32 (benchmarks/RESULTS.md). Read from /proc/cpuinfo; False where that is missing."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(value.split()))
    return False


def hf_name(path: ParamPath) -> tuple[str, bool]:
    """Model parameter path -> (HF tensor name, transposed)."""
    if path[0] == "layers":
        index, *module, leaf = path[1:]
        transposed = leaf == "kernel"
        return f"model.layers.{index}.{'.'.join(module)}.{'weight' if transposed else leaf}", transposed
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight", False
    if path == ("lm_head",):
        return "lm_head.weight", False
    return "model." + ".".join(map(str, path)), False


def abstract_model(cfg: DecoderConfig, dtype: Any) -> tuple[nnx.GraphDef, nnx.State, dict]:
    """Graph definition, abstract state, and the parameter tree as a plain dict of ShapeDtypeStructs."""
    return abstract(lambda: Decoder(cfg, dtype))


def _unused(name: str) -> bool:
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding); some persist the
    # rotary tables.
    return name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq")


def build_from_source(
    cfg: DecoderConfig, source: ModelSource, dtype: Any, sharding: ShardingFn = single_device_sharding
) -> Decoder:
    graphdef, state, tree = abstract_model(cfg, dtype)
    names = tensor_names(source, leaf_paths(tree), hf_name, ignored=_unused)
    return fill_from_source(graphdef, state, tree, source, names, dtype, sharding)


def restore_or_build(
    weights_dir: Path | None,
    abstract: Callable[[], tuple[nnx.GraphDef, nnx.State, dict]],
    build: Callable[[], Any],
    sharding: ShardingFn,
    source_config: dict,
) -> tuple[Any, bool]:
    """The module restored from the orbax cache straight into its shards, or built from the source
    checkpoint (and then written to the cache). Returns (module, whether it came from the cache)."""
    if weights_dir is not None and orbax_cache.exists(weights_dir):
        graphdef, state, tree = abstract()
        for p, s in leaf_paths(tree):
            set_leaf(tree, p, jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding(p, tuple(s.shape))))
        return merge(graphdef, state, orbax_cache.restore(weights_dir, tree)), True
    module = build()
    if weights_dir is not None:
        orbax_cache.save(weights_dir, nnx.to_pure_dict(nnx.split(module)[1]), source_config)
    return module, False


def load_model(
    model: str | Path,
    dtype: str = "auto",
    *,
    cache_dir: Path | None = None,
    use_cache: bool = True,
    sharding: ShardingFn = single_device_sharding,
    sharding_for: Callable[[DecoderConfig], ShardingFn] | None = None,
    load_format: str = "auto",
    hf_overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load `model` (HF directory or GGUF). With use_cache, the first load writes an orbax
    checkpoint of the converted parameters under cache_dir and later loads restore from it.
    sharding_for, when given, builds the sharding callback from the model's config (tensor
    parallelism needs the head counts, which are only known once the checkpoint is read)."""
    start = time.perf_counter()
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    dummy = load_format == "dummy"
    if use_cache and jax.process_count() > 1:
        # An orbax save is collective over the processes and needs one shared directory; each host
        # reads its own shards straight from the source files instead.
        log.info("multi-host: the orbax weight cache is off; each process loads its shards from the source")
        use_cache = False
    source = resolve(model, weights=not dummy, overrides=hf_overrides)
    cached = None
    if use_cache and cache_dir is not None and not dummy:
        # The dtype is part of the key, so resolve it from the checkpoint's own config first;
        # that config is cached beside the weights to avoid re-parsing the source.
        cached = orbax_cache.entry_dir(cache_dir, source.fingerprint())
    hf_config = orbax_cache.read_config(cached) if cached is not None else None
    cfg = decoder_config_from_hf(hf_config or source.config)
    jdtype = resolve_dtype(dtype, cfg.dtype, jax.devices()[0].platform)
    if sharding_for is not None:
        sharding = sharding_for(cfg)
    weights_dir = cached / jnp.dtype(jdtype).name if cached is not None else None
    if dummy:
        from jaxserve.weights.dummy import build_random

        decoder, from_cache = build_random(cfg, jdtype, sharding), False
    else:
        decoder, from_cache = restore_or_build(weights_dir, lambda: abstract_model(cfg, jdtype),
                                               lambda: build_from_source(cfg, source, jdtype, sharding), sharding,
                                               source.config)
    seconds = time.perf_counter() - start
    log.info(
        "loaded %s (%s, %s, %d layers) in %.2fs%s",
        source.path, cfg.architecture, jnp.dtype(jdtype).name, cfg.num_layers, seconds,
        " from the orbax cache" if from_cache else " (random weights: --load-format dummy)" if dummy else "",
    )
    return LoadedModel(cfg, decoder, source, jdtype, seconds, from_cache)
