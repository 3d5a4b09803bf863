"""The one place that wires and sizes a generation engine: KV pages, buckets, the device batch,
the multi-host channel and the ahead-of-time compile. The server, `jaxserve.LLM`, the benchmarks
and the tests all build engines here, so they run what production runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable
from typing import Any, Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.buckets import BucketTable
from jaxserve.engine.core import Engine, ImageEncoder
from jaxserve.engine.drafting import DraftingRunner
from jaxserve.engine.lora_slots import LoraSlots
from jaxserve.engine.info import EngineInfo
from jaxserve.engine.kv_cache import (
    bytes_per_page,
    cache_dtype,
    check_cache_dtype,
    num_pages_for,
    triton_safe_pages,
)
from jaxserve.engine.pages import PageAllocator
from jaxserve.engine.programs import STEP_KINDS
from jaxserve.engine.rows import row_params
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_inputs import Key, StepInputBuilder
from jaxserve.models import products
from jaxserve.models.decoder import Decoder
from jaxserve.parallel import ShardingPlan, mesh_of
from jaxserve.parallel.multihost import StepChannel, smallest_over_processes
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger("jaxserve.engine")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    attention_backend: str = "reference"  # reference | pallas_gpu | pallas_tpu | cpu (auto resolved by the caller)
    matmul_backend: str = "xla"  # xla | cpu (auto resolved by the caller: jaxserve.models.products)
    quantization: str = "none"  # none | int8 | int4 | gguf: the weights' form in the steps (jaxserve.models.products)
    quantization_group: int = 32  # int4's rows per group
    max_n: int = 128  # most samples (n / best_of) per request
    # Start step N+1 before turning step N's tokens into text (see Engine.step); False runs each
    # step to the end before the next starts (same tokens and text, for measuring the overlap).
    overlap: bool = True
    check_integrity: bool = True  # check the scheduler's invariants whenever the engine goes idle
    # Take client embeddings as prompt input (SGLang's input_embeds, vLLM's prompt_embeds and its
    # --enable-prompt-embeds): prefill steps then carry a [tokens, hidden] buffer.
    enable_prompt_embeds: bool = False
    # LoRA adapters kept loaded at most (vLLM's --max-cpu-loras; None: no limit). The model's
    # adapter slots (jaxserve.models.lora) bound how many decode in one step, not how many load.
    max_cpu_loras: int | None = None
    lora_eviction_policy: str = "lru"  # which idle adapter gives up its slot (jaxserve.engine.lora_slots)


def enable_compilation_cache(directory: Path) -> None:
    """JAX's persistent compilation cache: a warm start-up reads compiled steps from disk."""
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _expert_parallel(model: Decoder | None) -> None:
    """A mixture of experts whose experts the sharding plan split whole over the devices runs them
    expert-parallel (jaxserve.models.moe.shard_experts)."""
    if model is None or model.cfg.moe is None:
        return
    mesh = mesh_of(nnx.state(model))
    if mesh is not None and ShardingPlan(mesh, model.cfg).rules["experts"]:
        from jaxserve.models.moe import shard_experts

        shard_experts(model, mesh)


def build_engine(decoder: Decoder, tokenizer: Tokenizer | None, config: EngineConfig = EngineConfig(),
                 compile: bool = True, take_weights: bool = False, eos_ids: Iterable[int] = (),
                 blocks: Callable[[tuple], Any] | None = None, draft: Decoder | None = None,
                 encoder: ImageEncoder | None = None) -> Engine:
    """A ready engine for `decoder` (compiled for every command shape unless compile=False; then
    call `compile_engine`). take_weights: the engine may free `decoder`'s weight buffers where it
    keeps them in another layout (the CPU kernel's), so start-up never holds two copies of the
    model; `decoder` is unusable afterwards (the engine's own weights are runner.params).
    tokenizer None: token ids in and out, no text (LLM(skip_tokenizer_init=True)). Sequences end
    at config.json's EOS ids, the tokenizer's, and `eos_ids` (generation_config.json's). blocks:
    the checkpoint's stored blocks for quantization "gguf" (jaxserve.weights.loader.stored_blocks).
    draft: the draft model of speculative decoding (config.scheduler.speculative_method "draft";
    jaxserve.engine.drafting). encoder: a vision-language model's image encoder
    (jaxserve.engine.vision_encoder)."""
    cfg = decoder.cfg
    config = _drafting_config(decoder, config, draft)
    if draft is not None and (encoder is not None or config.enable_prompt_embeds):
        raise ValueError("a draft model does not run on embedding inputs (images, prompt embeds): speculative "
                         "decoding with a draft model is for text-only models")
    sched = config.scheduler
    if sched.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {sched.max_model_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    check_cache_dtype(cache_dtype(config.cache.kv_cache_dtype, decoder.dtype), config.attention_backend,
                      jax.local_devices()[0])
    tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else None
    eos_ids = tuple(sorted(set(cfg.eos_token_ids) | set(eos_ids) | ({tokenizer_eos} - {None})))
    products.check_quantization_for(cfg, config.quantization)
    for model in (decoder, draft):
        _expert_parallel(model)
    lora = _lora_slots(decoder, config.max_cpu_loras, config.lora_eviction_policy)
    builder = _input_builder(decoder, config, eos_ids, takes_embeds=encoder is not None or config.enable_prompt_embeds,
                             lora=lora)
    reserve = 0
    if config.cache.num_pages is None and jax.local_devices()[0].platform != "cpu":
        reserve = step_scratch_bytes(decoder, config, blocks)
    num_pages = _num_pages(decoder, config, reserve, draft)
    runner: Any = _runner(decoder, config, num_pages, take_weights, blocks)
    if draft is not None:
        # The draft's decode steps are its drafting loops: as many iterations as drafts.
        # A GGUF's kept blocks are the target's own: the draft runs dense (or int8/int4 as asked).
        drafting = dataclasses.replace(
            config, scheduler=dataclasses.replace(sched, decode_steps=sched.num_speculative_tokens),
            quantization=config.quantization if config.quantization in ("int8", "int4") else "none")
        runner = DraftingRunner(runner, _runner(draft, drafting, num_pages, take_weights))
    if jax.process_count() > 1:
        if encoder is not None:
            # The encoder runs on process 0's devices only; its outputs would have to reach the others.
            raise ValueError("vision-language models run on one host only (for now)")
        # Multi-host: process 0 sends every command to the others (jaxserve.parallel.multihost).
        runner.channel = StepChannel(builder.keys(), builder.abstract)
    page_size = config.cache.page_size
    allocator = PageAllocator(num_pages, page_size, config.cache.enable_prefix_caching)
    info = EngineInfo(architecture=cfg.architecture, vocab_size=cfg.vocab_size, eos_ids=eos_ids, max_model_len=sched.max_model_len,
                      max_n=config.max_n, max_num_seqs=sched.max_num_seqs, page_size=page_size,
                      num_pages=num_pages, decode_steps=sched.decode_steps,
                      speculative_method=sched.speculative_method,
                      num_speculative_tokens=sched.num_speculative_tokens if sched.speculative_method else 0,
                      max_ngram_size=sched.max_ngram_size if sched.speculative_method == "ngram" else 0,
                      default_assistant_tokens=sched.default_assistant_tokens if sched.speculative_method else None,
                      default_confidence_threshold=(sched.default_confidence_threshold
                                                    if sched.speculative_method == "draft" else None),
                      embed_dim=cfg.hidden_size if config.enable_prompt_embeds else 0,
                      accepts_images=encoder is not None, max_loras=decoder.lora_slots,
                      max_lora_rank=decoder.lora_rank)
    engine = Engine(Scheduler(sched, allocator, page_size), builder, runner, tokenizer, info,
                    overlap=config.overlap)
    engine.encoder = encoder
    engine.lora = engine.scheduler.adapters = lora
    if cfg.rope.kind == "longrope":
        engine.scheduler.rope_switch = cfg.rope.original_max_position
    if lora is not None:
        # An empty write into slot 0 (all zeros still) compiles the slot writers now, not while a
        # request waits on the first adapter loaded at run time.
        runner.write_lora_slot(0, lora.rank, {})
    if config.check_integrity:
        engine.on_idle = engine.check_idle_integrity
    if compile:
        compile_engine(engine)
    return engine


def _drafting_config(decoder: Decoder, config: EngineConfig, draft: Decoder | None) -> EngineConfig:
    """`config` checked against the draft model (or its absence), with one decode iteration per
    step when drafting: a verify step (or one token) at a time, so the draft's cache follows."""
    sched = config.scheduler
    if (draft is not None) != (sched.speculative_method == "draft"):
        raise ValueError("a draft model goes with speculative_method 'draft', and that method needs one")
    if draft is None:
        return config
    if draft.cfg.vocab_size != decoder.cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size} tokens) is not the model's "
                         f"({decoder.cfg.vocab_size}): a draft model must share the tokenizer")
    if jax.process_count() > 1:
        raise ValueError("speculative decoding with a draft model runs on one host only")
    if draft.cfg.max_position_embeddings < sched.max_model_len:
        raise ValueError(f"the draft model reads at most {draft.cfg.max_position_embeddings} positions, fewer than "
                         f"the context limit of {sched.max_model_len} (--max-model-len): its drafts past it would be noise")
    if sched.decode_steps > 1:
        log.info("speculative decoding with a draft model: one decode iteration per step (not %d)", sched.decode_steps)
    return dataclasses.replace(config, scheduler=dataclasses.replace(sched, decode_steps=1))


def _lora_slots(decoder: Decoder, max_loaded: int | None, policy: str) -> LoraSlots | None:
    """The bookkeeping of the model's LoRA adapter slots (None: it has none)."""
    if not decoder.lora_slots:
        return None
    from jaxserve.models.lora import slot_targets, target_shapes

    return LoraSlots(decoder.lora_slots, decoder.lora_rank, slot_targets(decoder), decoder.cfg.num_layers,
                     target_shapes(decoder), max_loaded, policy)


def _input_builder(decoder: Decoder, config: EngineConfig, eos_ids: tuple[int, ...] = (),
                   takes_embeds: bool = False, lora: LoraSlots | None = None) -> StepInputBuilder:
    sched = config.scheduler
    return StepInputBuilder(
        embed_dim=decoder.cfg.hidden_size if takes_embeds else 0, embed_dtype=np.dtype(decoder.dtype),
        mrope=bool(decoder.cfg.mrope_section),
        num_slots=sched.max_num_seqs + 1,  # + the padding rows' slot
        vocab_size=decoder.cfg.vocab_size, page_size=config.cache.page_size,
        max_pages_per_seq=math.ceil(sched.max_model_len / config.cache.page_size), buckets=BucketTable(sched),
        max_prefill_seqs=sched.max_prefill_seqs, decode_steps=sched.decode_steps,
        row_params=lambda seq: row_params(seq, eos_ids, lora.slot_of if lora is not None else None),
        num_speculative_tokens=sched.num_speculative_tokens if sched.speculative_method else 0,
        draft_model=sched.speculative_method == "draft")


def _runner(decoder: Decoder, config: EngineConfig, num_pages: int, take_weights: bool = False,
            blocks: Callable[[tuple], Any] | None = None) -> ModelRunner:
    sched = config.scheduler
    return ModelRunner(decoder, num_pages, config.cache.page_size,
                       math.ceil(sched.max_model_len / config.cache.page_size), sched.max_num_seqs + 1,
                       attention_backend=config.attention_backend, matmul_backend=config.matmul_backend,
                       quantization=config.quantization, quantization_group=config.quantization_group, blocks=blocks,
                       decode_steps=sched.decode_steps, take_weights=take_weights,
                       kv_dtype=cache_dtype(config.cache.kv_cache_dtype, decoder.dtype))


def compile_engine(engine: Engine) -> float:
    """Compile every command shape ahead of time; returns the total seconds."""
    start = time.perf_counter()
    runner: ModelRunner = engine.runner  # type: ignore[assignment]
    engine.compile_seconds = runner.compile(engine.builder.keys(), engine.builder.abstract)
    if runner.channel is not None:
        runner.channel.warm_up()
    return time.perf_counter() - start


def _num_pages(decoder: Decoder, config: EngineConfig, reserve_bytes: int, draft: Decoder | None = None) -> int:
    """--num-pages, or what the memory left after the weights, the device batch and the step's
    scratch (`reserve_bytes`) holds; every process of a multi-host job takes the smallest answer.
    A draft model's cache has as many pages, so each page costs both models' bytes."""
    cfg = decoder.cfg
    mesh = mesh_of(nnx.state(decoder))
    kv_shards = ShardingPlan(mesh, cfg).kv_shards if mesh is not None else 1
    device = jax.local_devices()[0]
    kv_dtype = cache_dtype(config.cache.kv_cache_dtype, decoder.dtype)
    num_pages = smallest_over_processes(num_pages_for(config.cache, cfg, kv_dtype, device, kv_shards,
                                                      reserve_bytes))
    page_size = config.cache.page_size
    # Per device: each cache is split over its own model's kv-head shards.
    arrays = [bytes_per_page(cfg, page_size, kv_dtype, device.platform) / 2 / kv_shards]  # one K (or V), per page
    if draft is not None:
        draft_mesh = mesh_of(nnx.state(draft))
        draft_shards = ShardingPlan(draft_mesh, draft.cfg).kv_shards if draft_mesh is not None else 1
        arrays.append(bytes_per_page(draft.cfg, page_size, cache_dtype(config.cache.kv_cache_dtype, draft.dtype),
                                     device.platform) / 2 / draft_shards)
        if config.cache.num_pages is None:
            num_pages = max(2, int(num_pages * arrays[0] // sum(arrays)))
    if config.attention_backend == "pallas_gpu" and kv_dtype.itemsize == 1:
        num_pages = triton_safe_pages(num_pages, arrays)
    log.info("KV cache: %d pages = %d tokens (%.1f MiB, %s%s)", num_pages, num_pages * page_size,
             num_pages * bytes_per_page(cfg, page_size, kv_dtype, device.platform) / kv_shards / 2**20, kv_dtype.name,
             f" per device, split {kv_shards} ways" if kv_shards > 1 else "")
    return num_pages


def step_scratch_bytes(decoder: Decoder, config: EngineConfig, blocks: Callable[[tuple], Any] | None = None) -> int:
    """The most scratch (temp) memory one step needs, read from XLA's memory analysis of the
    largest prefill and decode steps compiled against a tiny cache, plus headroom. The KV cache is
    sized from what is left, so a step can never run out of memory mid-serving (vLLM profiles a
    forward pass for the same reason)."""
    builder = _input_builder(decoder, config)
    probe = _runner(decoder, config, builder.max_pages_per_seq + 1, blocks=blocks)
    start = time.perf_counter()
    probe.compile(largest_steps(builder.keys()), builder.abstract)
    scratch = max(c.memory_analysis().temp_size_in_bytes for c in probe.compiled_steps.values())
    log.info("step scratch memory: %.2f GiB (largest steps, measured in %.1fs); set aside before sizing "
             "the KV cache", scratch / 2**30, time.perf_counter() - start)
    del probe
    return scratch_reserve(scratch)


def largest_steps(keys: list[Key], kinds: tuple[str, ...] = STEP_KINDS) -> list[Key]:
    """The largest step of each kind among `keys`: the ones whose scratch memory is measured."""
    return [max((k for k in keys if k[0] == kind), key=lambda k: k[1]) for kind in kinds
            if any(k[0] == kind for k in keys)]


def scratch_reserve(scratch_bytes: int) -> int:
    """Memory set aside for the steps before the KV cache is sized (also by jaxserve.plan)."""
    return int(scratch_bytes * 1.1) + 256 * 2**20  # headroom for allocator fragmentation
