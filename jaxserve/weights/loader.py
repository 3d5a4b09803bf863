"""Build a ready Decoder from a checkpoint: map HF tensor names onto the model's parameters,
convert dtype, stack layers, and place every array with its sharding straight from the source
(each device shard is read from the memory-mapped file; no full copy on one device first)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.models.config import DecoderConfig, decoder_config_from_hf
from jaxserve.models.decoder import Decoder
from jaxserve.weights import orbax_cache
from jaxserve.weights.safetensors_dir import WeightsError
from jaxserve.weights.source import ModelSource, resolve

log = logging.getLogger("jaxserve.weights")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
LOAD_FORMATS = ("auto", "dummy")

ShardingFn = Callable[[tuple[str, ...], tuple[int, ...]], jax.sharding.Sharding]


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


def hf_name(path: tuple[str, ...]) -> tuple[str, bool, bool]:
    """Model parameter path -> (HF name template with {i} for the layer, stacked, transposed)."""
    if path[0] == "layers":
        *module, leaf = path[1:]
        transposed = leaf == "kernel"
        return f"model.layers.{{i}}.{'.'.join(module)}.{'weight' if transposed else leaf}", True, transposed
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight", False, False
    if path == ("lm_head",):
        return "lm_head.weight", False, False
    return "model." + ".".join(path), False, False


def _leaf_paths(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _leaf_paths(v, (*prefix, str(k)))]
    return [(prefix, tree)]


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def single_device_sharding(path: tuple[str, ...], shape: tuple[int, ...]) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def abstract_model(cfg: DecoderConfig, dtype: Any) -> tuple[nnx.GraphDef, nnx.State, dict]:
    """Graph definition, abstract state, and the parameter tree as a plain dict of ShapeDtypeStructs."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype))
    graphdef, state = nnx.split(abstract)
    return graphdef, state, nnx.to_pure_dict(state)


def _check_tensors(cfg: DecoderConfig, source: ModelSource, leaves: list[tuple[tuple[str, ...], Any]]) -> None:
    expected = set()
    for path, spec in leaves:
        template, stacked, transposed = hf_name(path)
        names = [template.format(i=i) for i in range(cfg.num_layers)] if stacked else [template]
        shape = tuple(spec.shape[1:] if stacked else spec.shape)
        want = shape[::-1] if transposed else shape
        for name in names:
            expected.add(name)
            if name not in source.tensors:
                raise WeightsError(f"{source.path}: tensor {name} is missing from the checkpoint")
            got = source.tensors[name][1]
            if got != want:
                raise WeightsError(f"{source.path}: tensor {name} has shape {got}, the config implies {want}")
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
    extra = sorted(set(source.tensors) - expected - {"lm_head.weight"})
    extra = [n for n in extra if not n.endswith("rotary_emb.inv_freq")]
    if extra:
        raise WeightsError(f"{source.path}: tensors the model does not use: {extra[:5]}{' ...' if len(extra) > 5 else ''}")


def _make_array(
    source: ModelSource, path: tuple[str, ...], spec: Any, num_layers: int, dtype: Any, sharding: jax.sharding.Sharding
) -> jax.Array:
    template, stacked, transposed = hf_name(path)

    def host(name: str, index: tuple[slice, ...]) -> np.ndarray:
        w = source.tensors[name][0]()
        w = w.T if transposed else w
        return np.asarray(w[index], dtype=dtype)

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        if not stacked:
            return host(template, index)
        layers = range(num_layers)[index[0]]
        return np.stack([host(template.format(i=i), index[1:]) for i in layers])

    return jax.make_array_from_callback(spec.shape, sharding, callback)


def build_from_source(
    cfg: DecoderConfig, source: ModelSource, dtype: Any, sharding: ShardingFn = single_device_sharding
) -> Decoder:
    graphdef, state, tree = abstract_model(cfg, dtype)
    leaves = _leaf_paths(tree)
    _check_tensors(cfg, source, leaves)
    total = sum(int(np.prod(s.shape)) * jnp.dtype(dtype).itemsize for _, s in leaves)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {source.path.name}", leave=False, disable=None) as bar:
        for path, spec in leaves:
            arr = _make_array(source, path, spec, cfg.num_layers, dtype, sharding(path, spec.shape))
            _set(tree, path, arr)
            bar.update(arr.nbytes)
            bar.set_postfix_str(".".join(path))
    return merge(graphdef, state, tree)


def merge(graphdef: nnx.GraphDef, state: nnx.State, tree: dict) -> Decoder:
    """Fill the abstract `state` with the arrays of `tree` (same structure) and build the model."""
    nnx.replace_by_pure_dict(state, tree)
    return nnx.merge(graphdef, state)


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
        for p, s in _leaf_paths(tree):
            _set(tree, p, jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding(p, s.shape)))
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
    source = resolve(model, weights=not dummy)
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
