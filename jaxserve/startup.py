"""Start-up: load the model and tokenizer named by a ModelConfig and check they fit together."""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

from typing import TYPE_CHECKING

from jaxserve.config import Config, ModelConfig
from jaxserve.models.config import DecoderConfig
from jaxserve.tokenizer import Tokenizer, load_tokenizer
from jaxserve.weights import LoadedModel, load_model

log = logging.getLogger("jaxserve")

if TYPE_CHECKING:
    from jaxserve.engine.engine import Engine


@dataclasses.dataclass
class LoadedServing:
    loaded: LoadedModel
    tokenizer: Tokenizer
    max_model_len: int
    seconds: float

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


def resolve_max_model_len(requested: int | None, cfg: DecoderConfig) -> int:
    limit = cfg.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's max_position_embeddings {limit}")
    return requested


def load(cfg: ModelConfig) -> LoadedServing:
    start = time.perf_counter()
    loaded = load_model(cfg.model, cfg.dtype, cache_dir=cfg.cache_dir, use_cache=cfg.weight_cache)
    source = loaded.source
    tokenizer = load_tokenizer(source.tokenizer_dir, source.gguf_name, cfg.chat_template, cache_dir=cfg.cache_dir)
    if tokenizer.vocab_size > loaded.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has only "
            f"{loaded.config.vocab_size} rows"
        )
    max_len = resolve_max_model_len(cfg.max_model_len, loaded.config)
    return LoadedServing(loaded, tokenizer, max_len, time.perf_counter() - start)


def start_engine(config: "Config") -> tuple["Engine", dict[str, float]]:
    """Load the model, size the KV cache, and compile every step shape: everything before the
    first request. Returns the engine and the seconds each phase took."""
    from jaxserve.engine.engine import Engine, EngineConfig

    start = time.perf_counter()
    ready = load(config.model)
    log.info("model: %s", ready.summary())
    scheduler = dataclasses.replace(config.scheduler, max_model_len=ready.max_model_len)
    engine = Engine(
        ready.loaded.model,
        ready.tokenizer,
        EngineConfig(cache=config.cache, scheduler=scheduler, max_n=config.server.max_n,
                     compilation_cache_dir=config.compilation_cache_dir),
    )
    loaded = time.perf_counter()
    engine.compile()
    done = time.perf_counter()
    return engine, {"load": loaded - start, "compile": done - loaded, "total": done - start}
