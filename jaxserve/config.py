"""Frozen configuration of a jaxserve process, built once by the CLI (flags + YAML --config)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from jaxserve.multimodal.media import MediaPolicy


def default_cache_dir() -> Path:
    """Weight, tokenizer and compilation caches live here unless --cache-dir says otherwise."""
    env = os.environ.get("JAXSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxserve"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model: str  # HF directory, .gguf file, or a directory holding one .gguf
    served_model_name: str
    dtype: str = "auto"  # auto | float32 | bfloat16
    max_model_len: int | None = None  # None -> the model's max_position_embeddings
    chat_template: str | None = None  # template text or a file; overrides the checkpoint's
    weight_cache: bool = True  # convert once to an orbax checkpoint, restore later
    cache_dir: Path = dataclasses.field(default_factory=default_cache_dir)
    task: str = "auto"  # auto | generate | classify | embed (auto: from the checkpoint)
    load_format: str = "auto"  # auto (the checkpoint's weights) | dummy (random weights, config only)
    prompt_special_tokens: str = "parse"  # parse | text: special-token strings in raw prompts (tokenizer.py)
    served_model_aliases: tuple[str, ...] = ()  # more names requests may send (--served-model-name A B ...)
    accept_any_model_name: bool = False  # any requested name is the served model
    hf_overrides: dict[str, Any] | None = None  # keys replacing the checkpoint's config.json (--hf-overrides)
    quantization: str = "auto"  # auto | none | int8 | int4 (jaxserve.models.products; auto: a GGUF's own blocks)
    quantization_group_size: int = 32  # int4's rows per group (32 | 64 | 128)
    speculative_model: str | None = None  # a draft model (HF directory or .gguf) sharing the tokenizer
    # LoRA adapters served beside the model (jaxserve.weights.lora_adapter.LoraModuleSpec); whether
    # adapters may be loaded at run time (slots on every projection); how many slots, and of what
    # rank (None: jaxserve.startup.add_lora_capacity's defaults); how many adapters may be loaded
    # (None: any number; more than the slots take turns in them).
    lora_modules: tuple[Any, ...] = ()
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    lora_target_modules: tuple[str, ...] = ()  # the projections the slots cover (): add_lora_capacity's choice
    lora_eviction_policy: str = "lru"  # lru | fifo: which idle adapter gives up its slot
    enable_prompt_embeds: bool = False  # take embeddings as prompts (input_embeds / prompt_embeds)
    # vLLM's --generation-config (auto | vllm | a folder) and --override-generation-config, read
    # into what requests that leave them unset sample with (jaxserve.generation_config).
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What is wrong with the generation_config.json found beside the model, raised when a generation
    # engine starts (a classification or embedding model never reads it).
    generation_config_error: str | None = None
    # vLLM's --mm-processor-kwargs: the image processor's options for every request (Qwen2-VL's
    # min_pixels / max_pixels; max_pixels also sizes the compiled vision encoder).
    mm_processor_kwargs: dict[str, Any] | None = None

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name requests may send; the first is the one responses report."""
        return (self.served_model_name, *self.served_model_aliases)


# --kv-cache-dtype: "auto" (the model's dtype), "bfloat16" (for a float32 model), or an 8-bit float
# cache, "fp8" (= "fp8_e4m3") or "fp8_e5m2": vLLM's names (jaxserve.engine.kv_cache maps them to
# dtypes). No cache wider than the model's: its keys and values would hold nothing more.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # None: from kv_cache_memory_fraction of free device memory
    kv_cache_memory_fraction: float = 0.9  # of the memory left after weights (accelerators)
    cpu_kv_cache_bytes: int = 2 * 2**30  # KV budget on the CPU, where "free device memory" is the host's
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # most sequences in one decode step (also the largest decode bucket)
    max_num_batched_tokens: int = 512  # most prompt tokens in one prefill step (largest prefill bucket)
    max_prefill_seqs: int = 8  # most sequences sharing one prefill step
    max_model_len: int = 2048  # prompt + output limit per sequence
    # Decode iterations one device step may run when the batch has nothing else to do (no
    # arrivals, no grammar rows): the host round trip is paid once per that many tokens.
    decode_steps: int = 1
    # Speculative decoding: "ngram" (prompt lookup, jaxserve.engine.ngram), "draft" (a draft model,
    # jaxserve.engine.drafting) or None; the most draft tokens a verify step checks per row, and
    # the longest n-gram looked up.
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    max_ngram_size: int = 3
    min_ngram_size: int = 1  # shorter matches are not drafted from (vLLM's prompt_lookup_min)
    # Per-request defaults when a request sets neither (OVMS: the model's generation_config.json
    # num_assistant_tokens / assistant_confidence_threshold); None: num_speculative_tokens, no threshold.
    default_assistant_tokens: int | None = None
    default_confidence_threshold: float | None = None
    decode_buckets: tuple[int, ...] | None = None  # None: powers of two up to max_num_seqs
    prefill_buckets: tuple[int, ...] | None = None  # None: powers of two from 16 to max_num_batched_tokens

    def __post_init__(self) -> None:
        # Any sequence is taken (a command line's or a caller's list); kept as a tuple, so that the
        # frozen config stays hashable and equal to one built from the same sizes.
        for name in ("decode_buckets", "prefill_buckets"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-host serving under jax.distributed (jaxserve.parallel.multihost). None values are
    auto-detected by JAX (TPU pods, GKE, Slurm)."""

    enabled: bool = False
    coordinator_address: str | None = None  # host:port of process 0's coordination service
    num_processes: int | None = None
    process_id: int | None = None
    coordinator_bind_address: str | None = None  # default: coordinator_address (never all interfaces)
    initialization_timeout: int = 300  # seconds to wait for every process to join


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed: DistributedConfig = DistributedConfig()


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    # CORS (jaxserve.server.cors), vLLM's flags and defaults: any origin, method and header.
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allowed_credentials: bool = False
    request_id_headers: bool = False  # vLLM's --enable-request-id-headers: X-Request-Id on responses
    return_tokens_as_token_ids: bool = False  # vLLM's flag: logprobs show tokens as "token_id:N"
    max_stored_responses: int = 1024  # the Responses API's in-memory store (0: nothing kept)
    max_concurrent_requests: int = 1024  # over it: 429 at once
    max_request_bytes: int = 16 * 2**20  # over it: 413
    request_timeout: float | None = None  # seconds; None = no deadline
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    max_n: int = 128
    reasoning_parser: str | None = None  # jaxserve.server.reasoning.PARSERS; None: no splitting
    tool_call_parser: str | None = None  # jaxserve.server.tool_parsers.PARSERS or "auto"; None: no parsing
    structured: "StructuredOutputConfig" = dataclasses.field(default_factory=lambda: StructuredOutputConfig())


@dataclasses.dataclass(frozen=True)
class StructuredOutputConfig:
    """Compiling regex / JSON-schema / grammar constraints (jaxserve.structured)."""

    timeout_s: float = 30.0  # a compile running longer is killed; the request gets 400
    max_mib: int = 256  # largest compiled index accepted
    cache_entries: int = 256  # compiled constraints kept in memory (LRU)
    workers: int = 2  # compile processes (compiles of different specs run in parallel)


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    parallel: ParallelConfig
    server: ServerConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    # Where images may come from and how large (vision-language models; jaxserve.multimodal.media).
    media: MediaPolicy = MediaPolicy()
    compilation_cache_dir: Path | None = None
    attention_backend: str = "auto"  # auto | reference | pallas (resolved for the device at start-up)
    matmul_backend: str = "auto"  # auto | xla | cpu (jaxserve.models.products.resolve_backend)
    decode_steps: int | None = None  # None: auto (jaxserve.startup.resolve_decode_steps)


def lora_slot_count(max_loras: int | None, num_modules: int) -> int:
    """The model's LoRA adapter slots: --max-loras, else one per --lora-modules adapter (at least
    one, for --enable-lora)."""
    return max_loras or max(num_modules, 1)
