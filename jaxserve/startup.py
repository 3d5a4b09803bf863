"""Start-up: load the model and tokenizer named by a Config, check they fit together, and build and
compile the engine (generation: `start_engine`, through engine/build.py; classification:
`start_classify_engine`). The server, `jaxserve.LLM` and the benchmarks all start here."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxserve.config import Config, ModelConfig, SchedulerConfig, lora_slot_count
from jaxserve.models.config import DecoderConfig
from jaxserve.parallel import make_mesh, param_sharding_for
from jaxserve.tokenizer import Tokenizer, load_tokenizer
from jaxserve.weights import LoadedModel, load_model
from jaxserve.weights.source import ModelSource

DEFAULT_LORA_RANK = 16  # vLLM's --max-lora-rank default

log = logging.getLogger("jaxserve")

if TYPE_CHECKING:
    from jaxserve.engine.classify import ClassifyEngine
    from jaxserve.engine.core import Engine
    from jaxserve.engine.core import ImageEncoder
    from jaxserve.multimodal.images import ImageSupport
    from jaxserve.weights.classifier_loader import LoadedClassifier


@dataclasses.dataclass
class LoadedServing:
    loaded: LoadedModel
    tokenizer: Tokenizer | None  # None: skip_tokenizer_init (token ids in and out)
    max_model_len: int
    seconds: float
    generation_eos_ids: tuple[int, ...] = ()  # generation_config.json's eos_token_id

    @property
    def config(self) -> DecoderConfig:
        return self.loaded.config

    def summary(self) -> str:
        c = self.config
        params = sum(int(x.size) for x in jax.tree_util.tree_leaves(self.loaded.model))
        return (
            f"{c.architecture}, {params / 1e6:.1f}M parameters, {jnp.dtype(self.loaded.dtype).name}, "
            f"{c.num_layers} layers, max_model_len {self.max_model_len}, vocab {c.vocab_size}, "
            f"loaded in {self.seconds:.1f}s{' (weights from the orbax cache)' if self.loaded.from_cache else ''}"
        )


def resolve_max_model_len(requested: int | None, limit: int,
                          what: str = "the model's max_position_embeddings") -> int:
    """--max-model-len, defaulting to the model's own limit and never beyond it."""
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"--max-model-len {requested} exceeds {what} {limit}")
    return requested


def load(cfg: ModelConfig, tensor_parallel_size: int = 1, sharded: bool = True,
         skip_tokenizer_init: bool = False, keep_blocks: str = "none",
         native_bf16: bool | None = None) -> LoadedServing:
    """Load weights (sharded over a mesh of `tensor_parallel_size` local devices; with
    sharded=False, at size 1, plainly on one device) and the tokenizer (none with
    skip_tokenizer_init: the checkpoint then needs no tokenizer files). keep_blocks: none, auto
    or strict, which of a GGUF's blocks are kept (loaded.blocks; load_model). native_bf16:
    whether bfloat16 runs fast here (--dtype auto; load_model)."""
    start = time.perf_counter()
    mesh = make_mesh(tensor_parallel_size, sharded)
    loaded = load_model(cfg.model, cfg.dtype, cache_dir=cfg.cache_dir, use_cache=cfg.weight_cache,
                        load_format=cfg.load_format, hf_overrides=cfg.hf_overrides,
                        keep_blocks=keep_blocks, native_bf16=native_bf16,
                        sharding_for=param_sharding_for(mesh) if mesh is not None else None)
    source = loaded.source
    tokenizer = None
    if not skip_tokenizer_init:
        tokenizer = load_tokenizer(source.tokenizer_dir, source.gguf_name, cfg.chat_template,
                                   cache_dir=cfg.cache_dir, prompt_special_tokens=cfg.prompt_special_tokens)
        if tokenizer.vocab_size > loaded.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has only "
                f"{loaded.config.vocab_size} rows"
            )
    max_len = resolve_max_model_len(cfg.max_model_len, loaded.config.max_position_embeddings)
    return LoadedServing(loaded, tokenizer, max_len, time.perf_counter() - start, generation_eos_ids(source))


def generation_eos_ids(source: ModelSource) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an id or a list), which HF's `generate` and vLLM stop
    on besides config.json's: instruct checkpoints often list their end-of-turn token only there
    (Llama 3's <|eot_id|>), and without a tokenizer (skip_tokenizer_init) nothing else names it."""
    path = source.path / "generation_config.json" if source.kind == "hf" else None
    if path is None or not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object ({e})") from e
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def speculation_defaults(source: ModelSource, scheduler: SchedulerConfig) -> SchedulerConfig:
    """The deployment's drafting defaults from generation_config.json beside the model (OVMS's
    num_assistant_tokens / assistant_confidence_threshold), checked against how it speculates."""
    folder = source.path if source.path.is_dir() else source.path.parent
    path = folder / "generation_config.json"
    if scheduler.speculative_method is None or not path.is_file():
        return scheduler
    try:
        config = json.loads(path.read_text())
        tokens, threshold = config.get("num_assistant_tokens"), config.get("assistant_confidence_threshold")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object ({e})") from e
    k = scheduler.num_speculative_tokens
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= k):
        raise ValueError(f"{path}: num_assistant_tokens must be an integer in [0, {k}] (--num-speculative-tokens), "
                         f"got {tokens!r}")
    if threshold is not None:
        if tokens is not None:
            raise ValueError(f"{path}: num_assistant_tokens and assistant_confidence_threshold are exclusive")
        if scheduler.speculative_method != "draft":
            raise ValueError(f"{path}: assistant_confidence_threshold needs a draft model (--speculative-model)")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"{path}: assistant_confidence_threshold must be in [0, 1], got {threshold!r}")
    if tokens is None and threshold is None:
        return scheduler
    log.info("speculative decoding: requests default to %s (%s)", f"{tokens} draft tokens" if tokens is not None
             else f"a draft confidence threshold of {threshold}", path)
    return dataclasses.replace(scheduler, default_assistant_tokens=tokens, default_confidence_threshold=threshold)


def resolve_decode_steps(requested: int | None, platform: str | None = None) -> int:
    """--decode-steps: the decode iterations one device step may run. auto (None): 8 on GPUs and
    TPUs, where the host's work between steps (1.7 ms at batch 1, 5 ms at 64 on an H100) is a
    large share of a step; 1 on the CPU, where the step itself takes tens of milliseconds and the
    host's work runs beside it (benchmarks/RESULTS.md)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--decode-steps must be >= 1, got {requested}")
        return requested
    return 1 if (platform or jax.default_backend()) == "cpu" else 8


def check_draft_source(cfg: ModelConfig) -> None:
    """A --speculative-model that cannot be a checkpoint is refused before the served model loads
    (minutes, for a large one), in the flag's words: the loader's own error named only a path."""
    if cfg.speculative_model is None:
        return
    from jaxserve.weights.safetensors_dir import WeightsError
    from jaxserve.weights.source import resolve

    try:
        resolve(cfg.speculative_model, weights=cfg.load_format != "dummy")
    except ValueError as e:  # WeightsError, or a config.json that is no JSON
        raise WeightsError(f"--speculative-model: {e}") from e


def check_lora_sources(cfg: ModelConfig) -> None:
    """--lora-modules that cannot be adapters are refused before the model loads (minutes, for a
    large one)."""
    from jaxserve.weights.safetensors_dir import WeightsError

    for spec in cfg.lora_modules:
        if not (spec.path / "adapter_config.json").is_file():
            raise WeightsError(f"--lora-modules: {spec.name}={spec.path} is not a PEFT LoRA adapter directory (no "
                               "adapter_config.json)")


def add_lora_capacity(decoder: Any, cfg: ModelConfig) -> list[Any]:
    """Give the loaded model its LoRA adapter slots: --max-loras of them (default: one per
    --lora-modules adapter, or one with --enable-lora; with fewer, the adapters take turns in
    them), of rank --max-lora-rank (default: the largest adapter's, at least vLLM's 16 with
    --enable-lora), on --lora-target-modules (default: the projections the adapters adapt, all
    seven with --enable-lora: adapters loaded later may adapt any). Returns the --lora-modules
    adapters, read (jaxserve.weights.lora_adapter.LoraAdapter), for `load_lora_modules`: their
    files are read once."""
    if not cfg.lora_modules and not cfg.enable_lora:
        return []
    if cfg.enable_lora and jax.process_count() > 1:
        raise ValueError("--enable-lora: an adapter loaded while serving would reach process 0's devices only; "
                         "give a multi-host server its adapters with --lora-modules")
    from jaxserve.models.lora import add_lora_slots, target_shapes
    from jaxserve.weights.lora_adapter import TARGETS, load_adapter

    shapes = target_shapes(decoder)
    adapters = [load_adapter(spec, decoder.cfg.num_layers, shapes) for spec in cfg.lora_modules]
    targets = cfg.lora_target_modules or (
        tuple(TARGETS) if cfg.enable_lora else tuple(sorted({t for a in adapters for t in a.targets})))
    for spec, adapter in zip(cfg.lora_modules, adapters):
        outside = sorted(set(adapter.targets) - set(targets))
        if outside:
            raise ValueError(f"--lora-modules: {spec.name} adapts {', '.join(outside)}, which --lora-target-modules "
                             f"leaves out ({', '.join(targets)})")
    rank = cfg.max_lora_rank or max([DEFAULT_LORA_RANK if cfg.enable_lora else 1, *(a.rank for a in adapters)])
    slots = lora_slot_count(cfg.max_loras, len(adapters))
    if slots < len(adapters) and jax.process_count() > 1:
        # Adapters would change slots while serving, and those writes reach process 0's devices only.
        raise ValueError(f"--max-loras {slots} is fewer than the {len(adapters)} adapters of --lora-modules, and a "
                         "multi-host server cannot swap adapters in and out of its slots")
    add_lora_slots(decoder, slots, rank, targets)
    log.info("LoRA: %d adapter slot(s) of rank %d on %s%s", slots, rank, ", ".join(targets),
             "; adapters may be loaded and unloaded at run time" if cfg.enable_lora else "")
    return adapters


def load_lora_modules(engine: "Engine", cfg: ModelConfig, adapters: list[Any]) -> None:
    """Load the --lora-modules adapters (read by add_lora_capacity): the first ones into the
    engine's slots, any more when their requests come."""
    for spec, adapter in zip(cfg.lora_modules, adapters):
        engine.add_lora(adapter, spec.path, pinned=spec.pinned)


def start_engine(config: "Config", default_max_model_len: int | None = None,
                 skip_tokenizer_init: bool = False) -> tuple["Engine", dict[str, float]]:
    """Load the model, size the KV cache, and compile every step shape: everything before the
    first request. Returns the engine and the seconds each phase took. default_max_model_len
    caps the model's own limit when --max-model-len is not given (jaxserve.LLM's 2048).
    skip_tokenizer_init: no tokenizer (engine.tokenizer is None); outputs are token ids only."""
    from jaxserve.engine.attention import describe_backend, resolve_backend
    from jaxserve.engine.build import EngineConfig, build_engine, compile_engine, enable_compilation_cache
    from jaxserve.models import products

    start = time.perf_counter()
    if config.model.generation_config_error is not None:  # read by generation models only
        raise ValueError(config.model.generation_config_error)
    check_draft_source(config.model)
    check_lora_sources(config.model)
    if config.compilation_cache_dir is not None:
        enable_compilation_cache(config.compilation_cache_dir)
    tp = config.parallel.tensor_parallel_size
    asked = config.model.quantization
    products.check_group_size(config.model.quantization_group_size)
    keep_blocks = ("strict" if asked == "gguf" else
                   "auto" if asked == "auto" and products.keeps_gguf_blocks(config.matmul_backend, tp) else "none")
    # On the CPU, --dtype auto picks bfloat16 where the products run fast in it (the native kernels).
    native_bf16 = products.bfloat16_runs_fast(config.matmul_backend, tp)
    ready = load(config.model, tp, skip_tokenizer_init=skip_tokenizer_init, keep_blocks=keep_blocks,
                 native_bf16=native_bf16)
    log.info("model: %s", ready.summary())
    max_model_len = ready.max_model_len
    if config.model.max_model_len is None and default_max_model_len is not None:
        max_model_len = min(max_model_len, default_max_model_len)
    scheduler = dataclasses.replace(config.scheduler, max_model_len=max_model_len,
                                    decode_steps=resolve_decode_steps(config.decode_steps))
    scheduler = speculation_defaults(ready.loaded.source, scheduler)
    attention_backend = resolve_backend(config.attention_backend, tensor_parallel=tp)
    log.info("attention: %s", describe_backend(attention_backend))
    matmul_backend = products.resolve_backend(config.matmul_backend, ready.loaded.model.dtype, tensor_parallel=tp)
    blocks = ready.loaded.blocks
    products.check_quantization_for(ready.loaded.config, asked)
    if asked == "int4":  # before any weight is repacked: the model's shapes against the group size
        products.check_int4_shapes(ready.loaded.config, config.model.quantization_group_size)
    quantization = products.resolve_quantization(asked, gguf_blocks=blocks is not None)
    group = config.model.quantization_group_size
    if asked == "auto" and ready.loaded.source.kind == "gguf" and blocks is None:
        log.info("--quantization auto: the GGUF's weights run dequantized to %s (its blocks are kept only where "
                 "the native CPU kernel reads them)", jnp.dtype(ready.loaded.dtype).name)
    if quantization in ("int4", "gguf") and matmul_backend != "cpu":
        log.warning("--quantization %s on XLA's dot dequantizes every weight in every step: it saves memory, "
                    "not time (only the native CPU kernel reads 4-bit weights fast so far)", quantization)
    log.info("products: %s%s", products.describe_backend(matmul_backend), products.describe_quantization(quantization, group))
    log.info("decode: up to %d iterations per device step", scheduler.decode_steps)
    draft = None
    if config.model.speculative_model is not None:
        # The served model's config.json overrides are its own, not the draft's.
        draft_config = dataclasses.replace(config.model, model=config.model.speculative_model, max_model_len=None,
                                           speculative_model=None, hf_overrides=None)
        draft = load(draft_config, tp, skip_tokenizer_init=True, native_bf16=native_bf16).loaded.model
        log.info("speculative decoding: draft model %s, up to %d draft tokens per verify step",
                 config.model.speculative_model, scheduler.num_speculative_tokens)
    elif scheduler.speculative_method is not None:
        log.info("speculative decoding: %s (prompt lookup), up to %d draft tokens per verify step, n-grams of up "
                 "to %d tokens", scheduler.speculative_method, scheduler.num_speculative_tokens,
                 scheduler.max_ngram_size)
    lora_modules = add_lora_capacity(ready.loaded.model, config.model)
    engine_config = EngineConfig(cache=config.cache, scheduler=scheduler, max_n=config.server.max_n,
                                 attention_backend=attention_backend, matmul_backend=matmul_backend,
                                 quantization=quantization, quantization_group=group,
                                 enable_prompt_embeds=config.model.enable_prompt_embeds,
                                 max_cpu_loras=config.model.max_cpu_loras,
                                 lora_eviction_policy=config.model.lora_eviction_policy)
    encoder = vision_encoder(ready.loaded, config.model.load_format, config.model.mm_processor_kwargs)
    # The engine takes the weights: nothing here uses the loaded module again.
    engine = build_engine(ready.loaded.model, ready.tokenizer, engine_config, compile=False, take_weights=True,
                          eos_ids=ready.generation_eos_ids, blocks=blocks, draft=draft, encoder=encoder)
    load_lora_modules(engine, config.model, lora_modules)
    loaded = time.perf_counter()
    compile_engine(engine)
    if encoder is not None:
        encoder.compile()
    done = time.perf_counter()
    return engine, {"load": loaded - start, "compile": done - loaded, "total": done - start}


def vision_encoder(loaded: LoadedModel, load_format: str = "auto",
                   processor_kwargs: dict[str, Any] | None = None) -> "ImageEncoder | None":
    """A vision-language checkpoint's image encoder (its vision side, in the language model's
    dtype), None for a text-only model. processor_kwargs: --mm-processor-kwargs (Qwen2.5-VL's
    max_pixels sizes the encoder)."""
    from jaxserve.models.config import LANGUAGE_MODEL_ONLY_ARCHITECTURES, VISION_LANGUAGE_ARCHITECTURES

    config = loaded.source.config
    archs = config.get("architectures") or []
    language_only = [a for a in archs if a in LANGUAGE_MODEL_ONLY_ARCHITECTURES]
    if language_only:
        log.warning("%s: serving its language model only; requests with images are refused", language_only[0])
    if not any(a in VISION_LANGUAGE_ARCHITECTURES for a in archs):
        if processor_kwargs:
            raise ValueError("--mm-processor-kwargs: this model takes no images (a vision-language model's image "
                             "processor reads it)")
        return None
    if processor_kwargs:  # a key the processor cannot take: refused before anything compiles
        from jaxserve.multimodal.images import image_processor

        image_processor(loaded.source.path, config, processor_kwargs)
    if jax.process_count() > 1:
        raise ValueError("vision-language models run on one host only (for now)")
    if "Qwen2_5_VLForConditionalGeneration" in archs:
        return _qwen_vl_encoder(loaded, load_format, processor_kwargs)
    from jaxserve.engine.vision_encoder import LlavaEncoder
    from jaxserve.models.vision import vision_config_from_hf
    from jaxserve.weights.vision_loader import load_vision, random_vision

    cfg = vision_config_from_hf(config)
    model = (random_vision(cfg, loaded.dtype) if load_format == "dummy"
             else load_vision(loaded.source, cfg, loaded.dtype))
    log.info("vision: %s tower, %d layers, %d-pixel tiles of %d tokens", cfg.tower, cfg.num_layers_used,
             cfg.image_size, cfg.tokens_per_tile)
    return LlavaEncoder(model)


def _qwen_vl_encoder(loaded: LoadedModel, load_format: str,
                     processor_kwargs: dict[str, Any] | None = None) -> "ImageEncoder":
    from jaxserve.engine.vision_encoder import QwenVLEncoder
    from jaxserve.multimodal.images import image_processor
    from jaxserve.weights.qwen2_vl_vision_loader import load_vision_model

    if load_format == "dummy":
        raise ValueError("--load-format dummy: random weights for Qwen2.5-VL's vision encoder are not built yet")
    source = loaded.source
    processor, _ = image_processor(source.path, source.config, processor_kwargs)
    vision = load_vision_model(source, loaded.dtype)
    cfg = vision.config
    max_patches = processor.max_pixels // processor.patch_size**2
    log.info("vision: Qwen2.5-VL encoder, %d blocks, images of up to %d patches (%d tokens)", cfg.depth,
             max_patches, max_patches // cfg.merge_unit)
    return QwenVLEncoder(vision.model, int(source.config.get("image_token_id", 151655)), max_patches)


def image_input(config: Config, engine: "Engine") -> "ImageSupport | None":
    """The server's side of a vision-language model's images: where they may come from
    (config.media) and the model's image processor; None for a text-only model."""
    if not engine.info.accepts_images:
        return None
    from jaxserve.multimodal.images import image_support
    from jaxserve.weights.source import resolve

    source = resolve(config.model.model, weights=False, overrides=config.model.hf_overrides)
    hf = engine.tokenizer.hf if engine.tokenizer is not None else None
    return image_support(source.path, source.config, hf, config.media, config.model.mm_processor_kwargs)


def start_classify_engine(config: Config, task: str = "classify", default_max_model_len: int | None = None,
                          skip_tokenizer_init: bool = False,
                          ) -> tuple["ClassifyEngine", Tokenizer | None, "LoadedClassifier", dict[str, float]]:
    """Load the classifier (or, task "embed", the embedding model) and its tokenizer and compile
    every step shape: everything before the first request. --max-num-seqs bounds the inputs per
    step, --max-num-batched-tokens the packed tokens (at least --max-model-len, so any valid input
    fits). An embedding model's default context is its sentence-transformers max_seq_length (what
    its embeddings were trained on). Returns the seconds per phase too. default_max_model_len and
    skip_tokenizer_init (no tokenizer: None) as for `start_engine`."""
    from jaxserve.engine.build import enable_compilation_cache
    from jaxserve.engine.classify import ClassifyConfig, ClassifyEngine
    from jaxserve.models.embedder import EmbedderConfig
    from jaxserve.weights.classifier_loader import load_classifier

    m = config.model
    if m.quantization not in ("auto", "none"):
        raise ValueError(f"--quantization {m.quantization}: classification and embedding models run with the "
                         "checkpoint's weights; quantization is for generation models")
    if config.scheduler.decode_buckets is not None or config.scheduler.prefill_buckets is not None:
        raise ValueError("--decode-buckets / --prefill-buckets: classification and embedding models compile one "
                         "step per token bucket, powers of two up to the largest packed step; the flags are for "
                         "generation models")
    start = time.perf_counter()
    if config.compilation_cache_dir is not None:
        enable_compilation_cache(config.compilation_cache_dir)
    loaded = load_classifier(m.model, m.dtype, cache_dir=m.cache_dir, use_cache=m.weight_cache, task=task,
                             hf_overrides=m.hf_overrides)
    tokenizer = None if skip_tokenizer_init else load_tokenizer(
        loaded.source.tokenizer_dir, None, m.chat_template, cache_dir=m.cache_dir,
        prompt_special_tokens=m.prompt_special_tokens)
    if tokenizer is not None and tokenizer.vocab_size > loaded.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has only "
                         f"{loaded.config.vocab_size} rows")
    limit = loaded.config.max_context
    requested = m.max_model_len
    st_len = getattr(loaded.config, "max_seq_length", None)
    if requested is None and st_len is not None:
        requested = min(st_len, limit)
    max_len = resolve_max_model_len(requested, limit, "what the model's position embeddings allow:")
    if m.max_model_len is None and default_max_model_len is not None:
        max_len = min(max_len, default_max_model_len)
    engine = ClassifyEngine(loaded.model, loaded.config, ClassifyConfig(
        max_model_len=max_len, max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens))
    c = loaded.config
    if isinstance(c, EmbedderConfig):
        what = f"{c.dimensions}-value embeddings, {c.pooling} pooling{', normalised' if c.normalize else ''}"
    else:
        what = f"{c.num_labels} labels ({', '.join(c.labels[:4]) + (' ...' if c.num_labels > 4 else '')})"
    log.info("model: %s, %s, %s, max_model_len %d, %d step shapes (%s tokens)", c.architecture, what,
             jnp.dtype(loaded.dtype).name, max_len, len(engine.buckets), [b.tokens for b in engine.buckets])
    loaded_at = time.perf_counter()
    engine.compile()
    done = time.perf_counter()
    return engine, tokenizer, loaded, {"load": loaded_at - start, "compile": done - loaded_at, "total": done - start}
