"""Build a ready Decoder from a checkpoint: map HF tensor names onto the model's parameters (one
buffer per layer, as the checkpoint stores them), convert dtype, and place every array with its
sharding straight from the source (each device shard is read from the memory-mapped file; no full
copy on one device first)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import DecoderConfig, decoder_config_from_hf
from jaxserve.models.decoder import Decoder
from jaxserve.models.products import Blocks
from jaxserve.weights import orbax_cache
from jaxserve.weights.gguf_file import FLOAT_TYPES, KEPT_TYPES
from jaxserve.weights.safetensors_dir import WeightsError
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
    # A GGUF's stored blocks for its product weights (stored_blocks), which the model then holds
    # only abstractly: jaxserve.models.products.place(quantization="gguf", blocks=...) places them.
    blocks: Callable[[ParamPath], Blocks | None] | None = None


def resolve_dtype(requested: str, checkpoint_dtype: str, platform: str, native_bf16: bool | None = None) -> Any:
    """--dtype: float32 | bfloat16 | auto. auto is the checkpoint's own precision, never more: float32
    checkpoints run in float32, 16-bit and quantized ones (GGUF) in bfloat16 -- except on a CPU
    where bfloat16 products would be emulated (`native_bf16` False; default: whether this CPU has
    bfloat16 dot instructions), where everything runs in float32. A generation model's products
    also run fast on the native product kernels (jaxserve.models.products.bfloat16_runs_fast)."""
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


# Where a vision-language checkpoint keeps its language model's tensors: transformers 5's
# save_pretrained layout, then the Hub's llava-hf layout.
_LM_PREFIXES = (("model.", "model.language_model."), ("model.", "language_model.model."),
                ("lm_head.", "language_model.lm_head."))


def vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a vision-language model's vision side."""
    from jaxserve.weights import qwen2_vl_vision_loader, vision_loader  # they read checkpoints through this module

    return vision_loader.vision_tensor(name) or qwen2_vl_vision_loader.vision_tensor(name)


def _unused(name: str) -> bool:
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding); some persist the
    # rotary tables; a vision-language model's vision side is loaded by its own loader.
    return (name in ("lm_head.weight", "language_model.lm_head.weight") or name.endswith("rotary_emb.inv_freq")
            or vision_tensor(name))


def lm_alias(source: ModelSource) -> Callable[[str], str]:
    """A causal LM's tensor name -> the name `source` stores it under (a vision-language
    checkpoint nests its language model)."""
    tensors = source.tensors

    def alias(name: str) -> str:
        if name in tensors:
            return name
        for plain, nested in _LM_PREFIXES:
            if name.startswith(plain) and nested + name[len(plain):] in tensors:
                return nested + name[len(plain):]
        return name

    return alias


def build_from_source(
    cfg: DecoderConfig, source: ModelSource, dtype: Any, sharding: ShardingFn = single_device_sharding,
    skip: Callable[[str], bool] = lambda name: False,
) -> Decoder:
    """The decoder with every weight read from `source`, except the tensors `skip` names (abstract)."""
    graphdef, state, tree = abstract_model(cfg, dtype)
    names = tensor_names(source, leaf_paths(tree), hf_name, alias=lm_alias(source), ignored=_unused)
    return fill_from_source(graphdef, state, tree, source, names, dtype, sharding, skip)


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


def _product_tensor(name: str, head: str) -> bool:
    """Whether HF tensor `name` multiplies activations: a Linear weight, or the head (`head`: the
    embedding when tied)."""
    # A mixture of experts' stacked kernels are not Linear products (they run in the model's dtype).
    return name == head or (name.startswith("model.layers.") and name.endswith("_proj.weight")
                            and ".experts." not in name)


def stored_blocks(source: ModelSource, head_path: tuple[str, ...], strict: bool = True,
                  dtype_name: str = "bfloat16") -> Callable[[ParamPath], Blocks | None] | None:
    """What a GGUF's blocks give the products: a parameter path -> the Blocks its tensor is stored
    in ([K, N], as products.place takes them), None for a tensor that runs in the model's dtype;
    None in place of the whole callable when no product weight (Linear kernel, LM head) is stored
    in blocks a product reads (safetensors, a float GGUF). A product weight in another block type
    (llama.cpp's Q4_K_M files put Q5_0 wherever a row is no whole number of 256) is, `strict`
    (--quantization gguf), refused with a WeightsError naming it, its type and the supported set;
    else (--quantization auto) dequantized to `dtype_name`, with a warning naming it: never
    silently."""
    types = source.tensor_types
    head = hf_name(head_path)[0]
    weights = [n for n in types if _product_tensor(n, head)]
    other = [n for n in weights if types[n] not in KEPT_TYPES and types[n] not in FLOAT_TYPES]
    if other and strict:
        name = other[0]
        raise WeightsError(
            f"{source.path}: tensor {source.stored_name(name)} is stored as {types[name]}; --quantization gguf "
            f"keeps a GGUF's blocks in {', '.join(KEPT_TYPES)} (and float {', '.join(FLOAT_TYPES)}) only. "
            "Pass --quantization auto to run such tensors dequantized, none to dequantize the whole model, "
            "or int8 / int4 to requantize it")
    experts = [n for n in types if ".experts." in n and types[n] not in FLOAT_TYPES]
    if experts and strict:
        raise WeightsError(
            f"{source.path}: the experts ({source.stored_name(experts[0])}, {types[experts[0]]}) of a mixture of "
            "experts have no block-quantized product yet: --quantization gguf cannot keep them. Pass "
            "--quantization auto to run them dequantized (the rest in the file's blocks) or none")
    if not any(types[n] in KEPT_TYPES for n in weights):
        return None
    if experts:
        log.warning("the GGUF's %d expert tensors (%s, ...) run dequantized to %s: experts have no block-quantized "
                    "product yet", len(experts), source.stored_name(experts[0]), dtype_name)
    if other:
        names = ", ".join(f"{source.stored_name(n)} ({types[n]})" for n in other[:4])
        log.warning("%d of the GGUF's %d product weights are in block types no kernel reads and run dequantized to "
                    "%s: %s%s", len(other), len(weights), dtype_name, names, " ..." if len(other) > 4 else "")
    blocks = source.blocks

    def get(path: ParamPath) -> Blocks | None:
        entry = blocks.get(hf_name(path)[0])
        if entry is None:
            return None
        type_name, load = entry
        q, d, mn = load()  # [N, K] as stored: rows are output channels
        return Blocks(q.T, d.T, None if mn is None else mn.T, KEPT_TYPES[type_name])

    return get


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
    keep_blocks: str = "none",
    native_bf16: bool | None = None,
) -> LoadedModel:
    """Load `model` (HF directory or GGUF). With use_cache, the first load writes an orbax
    checkpoint of the converted parameters under cache_dir and later loads restore from it.
    sharding_for, when given, builds the sharding callback from the model's config (tensor
    parallelism needs the head counts, which are only known once the checkpoint is read).
    keep_blocks: "auto" (--quantization auto): the product weights a GGUF stores in blocks that a
    product reads are not loaded as arrays (the model holds them abstractly; LoadedModel.blocks
    reads them, so start-up never holds a dequantized copy, and the memory-mapped file is their
    cache: no orbax cache is written) when the model runs in bfloat16, the native kernel's dtype;
    weights in other block types run dequantized, named in a warning. "strict" (--quantization
    gguf): in any dtype, refusing other block types (stored_blocks). "none": everything loaded.
    native_bf16: whether bfloat16 runs fast here, for --dtype auto (resolve_dtype)."""
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
    jdtype = resolve_dtype(dtype, cfg.dtype, jax.devices()[0].platform, native_bf16)
    if sharding_for is not None:
        sharding = sharding_for(cfg)
    weights_dir = cached / jnp.dtype(jdtype).name if cached is not None else None
    blocks = None
    if keep_blocks not in ("none", "auto", "strict"):
        raise ValueError(f"keep_blocks must be none, auto or strict, got {keep_blocks!r}")
    if keep_blocks == "strict" and source.kind != "gguf":
        raise ValueError(f"--quantization gguf keeps a GGUF file's blocks; {source.path} is not a GGUF file")
    if keep_blocks == "strict" and dummy:
        raise ValueError("--quantization gguf needs the file's blocks, not --load-format dummy")
    if (keep_blocks == "strict" or (keep_blocks == "auto" and jdtype == jnp.bfloat16)) and not dummy \
            and source.kind == "gguf":
        head_path = ("embed_tokens",) if cfg.tie_word_embeddings else ("lm_head",)
        blocks = stored_blocks(source, head_path, strict=keep_blocks == "strict", dtype_name=jnp.dtype(jdtype).name)
    if blocks is not None:
        kept = set(source.blocks)
        head = hf_name(head_path)[0]
        skip = lambda name: name in kept and _product_tensor(name, head)
        decoder, from_cache = build_from_source(cfg, source, jdtype, sharding, skip), False
    elif dummy:
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
        " from the orbax cache" if from_cache else " (random weights: --load-format dummy)" if dummy else
        " (product weights kept in the file's blocks)" if blocks is not None else "",
    )
    return LoadedModel(cfg, decoder, source, jdtype, seconds, from_cache, blocks)
