"""The classification engine: a prefill-only batcher in front of one jitted step per token bucket.

`ClassifyEngine` packs waiting inputs (`ClassifyBatcher`, host only) and runs them through the
step compiled for their bucket ahead of time; nothing is kept on the device between steps (no KV
cache). `AsyncClassifyEngine` runs it in its own thread, as `AsyncEngine` does for generation:
the event loop only queues inputs and awaits futures that the thread resolves with
`loop.call_soon_threadsafe`. The thread dispatches step N+1 before it reads step N's logits back,
so packing and posting results overlap the device's work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.engine.engine_thread import EngineDeadError, EngineThread, post
from jaxserve.engine.classify_batcher import (
    Bucket,
    ClassifyBatcher,
    ClassifyItem,
    PackedStep,
    PackingSpec,
    classify_buckets,
)
from jaxserve.errors import InvalidRequestError
from jaxserve.models.bert import EncoderConfig
from jaxserve.models.embedder import EmbedderConfig, PoolingConfig, PoolingModel

log = logging.getLogger("jaxserve.engine")


class RequestAbortedError(RuntimeError):
    """The input was aborted (server shutdown) before its step ran."""


@dataclasses.dataclass(frozen=True)
class ClassifyConfig:
    max_model_len: int  # longest input, in tokens
    max_num_seqs: int = 16  # most inputs per step
    max_num_batched_tokens: int = 0  # most packed tokens per step; raised to max_model_len if smaller
    token_buckets: tuple[int, ...] | None = None  # None: powers of two from 16 to max_step_tokens

    @property
    def max_step_tokens(self) -> int:
        return max(self.max_num_batched_tokens, self.max_model_len)


@dataclasses.dataclass
class ClassifyResult:
    request_id: str
    output: np.ndarray  # float32: the class logits [num_labels], or the embedding [hidden]
    num_tokens: int


def packing_spec(cfg: PoolingConfig) -> PackingSpec:
    roberta = isinstance(cfg.body, EncoderConfig) and cfg.body.family == "roberta"
    if isinstance(cfg, EmbedderConfig):
        # sentence-transformers pools by the attention mask: the last token is the input's last,
        # even when it is the pad token (Qwen3-Embedding appends <|endoftext|>, its pad token).
        return PackingSpec("last" if cfg.pooling == "last" else "first", cfg.pad_token_id if roberta else None,
                           roberta_positions=roberta)
    if isinstance(cfg.body, EncoderConfig):
        return PackingSpec("first", cfg.pad_token_id, roberta_positions=roberta)
    return PackingSpec("last", cfg.pad_token_id)


class ClassifyRunner:
    """Owns the classifier's device arrays and one compiled step per bucket."""

    def __init__(self, model: PoolingModel, max_model_len: int | None = None):
        self.graphdef, self.params = nnx.split(model)
        self.max_model_len = max_model_len  # no input is longer: bounds the keys a query block reads
        self._step = jax.jit(self._step_fn)
        self._compiled: dict[Bucket, Any] = {}

    def _step_fn(self, params: nnx.State, tokens: jax.Array, positions: jax.Array, segments: jax.Array,
                 pool_rows: jax.Array, token_types: jax.Array) -> jax.Array:
        model = nnx.merge(self.graphdef, params)
        # [S, labels] or [S, hidden] float32
        return model(tokens, positions, segments, pool_rows, token_types, max_segment=self.max_model_len)

    def compile(self, buckets: tuple[Bucket, ...]) -> dict[Bucket, float]:
        seconds: dict[Bucket, float] = {}
        i32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
        with tqdm(buckets, desc="compiling classify steps", unit="shape", disable=None) as bar:
            for bucket in bar:
                bar.set_postfix_str(f"tokens={bucket.tokens} seqs={bucket.seqs}")
                start = time.perf_counter()
                lowered = self._step.lower(self.params, i32(bucket.tokens), i32(bucket.tokens), i32(bucket.tokens),
                                           i32(bucket.seqs), i32(bucket.tokens))
                self._compiled[bucket] = lowered.compile()
                seconds[bucket] = time.perf_counter() - start
                log.info("compiled classify step tokens=%d seqs=%d in %.2fs", bucket.tokens, bucket.seqs,
                         seconds[bucket])
        return seconds

    @property
    def compiled_buckets(self) -> tuple[Bucket, ...]:
        return tuple(self._compiled)

    def dispatch(self, step: PackedStep) -> jax.Array:
        """Start the step (asynchronously); the logits are a future until read."""
        compiled = self._compiled.get(step.bucket)
        if compiled is None:
            raise RuntimeError(f"classify step shape {step.bucket} was not compiled at start-up")
        return compiled(self.params, step.tokens, step.positions, step.segments, step.pool_rows, step.token_types)


class ClassifyEngine:
    """Inputs in, logits out; `step()` runs one packed batch. Not thread-safe: one owner thread."""

    def __init__(self, model: PoolingModel, cfg: PoolingConfig, config: ClassifyConfig):
        if not 1 <= config.max_model_len <= cfg.max_context:
            raise ValueError(f"max_model_len {config.max_model_len} must be in [1, {cfg.max_context}] (the model's "
                             "position embeddings)")
        self.cfg = cfg
        self.config = config
        self.buckets = classify_buckets(config.max_step_tokens, config.max_num_seqs, config.token_buckets)
        self.batcher = ClassifyBatcher(packing_spec(cfg), config.max_model_len, cfg.vocab_size, self.buckets)
        self.runner = ClassifyRunner(model, config.max_model_len)
        self.compile_seconds: dict[Bucket, float] = {}
        self.num_steps = 0

    def compile(self) -> float:
        """Compile every bucket's step now; returns the seconds it took."""
        start = time.perf_counter()
        self.compile_seconds = self.runner.compile(self.buckets)
        return time.perf_counter() - start

    def add(self, request_id: str, token_ids: list[int], priority: int = 0,
            token_types: list[int] | None = None) -> None:
        """Queue one input; raises InvalidRequestError / RequestTooLongError."""
        self.batcher.add(ClassifyItem(request_id, list(token_ids), priority, token_types))

    def abort(self, request_id: str) -> bool:
        return self.batcher.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.batcher.has_waiting()

    def dispatch(self) -> tuple[PackedStep, jax.Array] | None:
        """Pack the next step and start it on the device; None when nothing waits."""
        step = self.batcher.next_step()
        if step is None:
            return None
        self.num_steps += 1
        return step, self.runner.dispatch(step)

    @staticmethod
    def collect(started: tuple[PackedStep, jax.Array]) -> list[ClassifyResult]:
        """Wait for a dispatched step and split its logits by input."""
        step, logits = started
        rows = np.asarray(logits)
        return [ClassifyResult(rid, rows[i], n) for i, (rid, n) in enumerate(zip(step.request_ids, step.num_tokens))]

    def step(self) -> list[ClassifyResult]:
        started = self.dispatch()
        return [] if started is None else self.collect(started)

    def classify(self, inputs: list[list[int]], priority: int = 0,
                 token_types: list[list[int]] | None = None) -> list[ClassifyResult]:
        """Offline: run token-id inputs (with their token types, for text pairs) and return their
        results in input order."""
        ids = [f"offline-{i}" for i in range(len(inputs))]
        types = token_types if token_types is not None else [None] * len(inputs)
        for rid, tokens, tt in zip(ids, inputs, types):
            self.add(rid, tokens, priority, tt)
        out: dict[str, ClassifyResult] = {}
        while self.has_unfinished():
            out.update((r.request_id, r) for r in self.step())
        return [out[rid] for rid in ids]


class AsyncClassifyEngine(EngineThread):
    """The engine in its own thread; `classify()` is awaited from the event loop."""

    def __init__(self, engine: ClassifyEngine):
        super().__init__("jaxserve-classify")
        self.engine = engine
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._started: Any = None  # the batch dispatched last, collected after the next dispatch
        self._start()

    # ---- event-loop side -------------------------------------------------------------------------
    def validate(self, token_ids: list[int], param: str = "input") -> None:
        """Raise the input's validation error now (reads only fixed limits: safe off the thread)."""
        self.engine.batcher.validate(token_ids, param)

    async def classify(self, request_id: str, token_ids: list[int], priority: int = 0,
                       token_types: list[int] | None = None) -> ClassifyResult:
        self.validate(token_ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._send(("add", ClassifyItem(request_id, list(token_ids), priority, token_types), loop, future))
        try:
            return await future
        except asyncio.CancelledError:
            self.abort(request_id)  # the client went away: drop the input if it still waits
            raise

    @property
    def num_requests(self) -> int:
        """Inputs queued or running."""
        return len(self._futures)

    @property
    def num_waiting(self) -> int:
        return self.engine.batcher.num_waiting

    # ---- engine thread ---------------------------------------------------------------------------
    def _tick(self) -> bool:
        # Dispatch the next batch before collecting the last, so the host work of one overlaps the
        # device work of the other.
        following = self.engine.dispatch() if self.engine.has_unfinished() else None
        if self._started is not None:
            for result in self.engine.collect(self._started):
                self._resolve(result.request_id, result)
        self._started = following
        return self._started is not None or self.engine.has_unfinished()

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, item, loop, future = command
            try:
                if item.request_id in self._futures:
                    raise InvalidRequestError("rid", f"{item.request_id!r} is already running")
                self.engine.batcher.add(item)
            except Exception as e:  # validation errors go back to the caller
                post(loop, future, e)
                return
            self._futures[item.request_id] = (loop, future)
        elif command[0] == "abort":
            # A caller that went away ignores this; one still waiting (shutdown) gets the error.
            self.engine.abort(command[1])
            self._resolve(command[1], RequestAbortedError(f"request {command[1]!r} was aborted"))

    def _fail(self, error: EngineDeadError) -> None:
        for request_id in list(self._futures):
            self._resolve(request_id, error)

    def _refuse(self, command: tuple, error: EngineDeadError) -> None:
        if command[0] == "add":
            post(command[2], command[3], error)

    def _close(self) -> None:
        for request_id in list(self._futures):
            self._resolve(request_id, EngineDeadError("the engine shut down"))

    def _resolve(self, request_id: str, value: ClassifyResult | BaseException) -> None:
        entry = self._futures.pop(request_id, None)
        if entry is not None:
            post(*entry, value)
