"""ModelRunner: the only owner of device arrays. It compiles one jitted step per bucket ahead of
time and runs a scheduler's plan through it.

One step function serves prefill and decode: the scheduled tokens of up to `max_seqs`
sequences, concatenated ([tokens] ragged, padded to the bucket), attend over the paged cache
through the ragged paged-attention interface. A decode bucket is `tokens == max_seqs == B`
(one token per sequence); a prefill bucket is T tokens from up to `max_prefill_seqs` chunks.
The step writes the new K/V into the (donated) cache, samples one token per sequence from the
logits at its last scheduled token, and returns only the sampled ids and logprobs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxserve.engine import attention
from jaxserve.engine.kv_cache import KVCache
from jaxserve.engine.sampler import MAX_TOP_LOGPROBS, SampleOutput, SamplingBatch, sample, token_logprobs
from jaxserve.models import products
from jaxserve.models.decoder import AttentionFn, Decoder
from jaxserve.parallel import ShardingPlan, mesh_of
from jaxserve.parallel.multihost import is_leader

log = logging.getLogger("jaxserve.engine")

PROMPT_LOGPROBS_CHUNK = 128  # rows of prompt logprobs computed at a time (bounds the step's scratch memory)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """Host-built inputs of one step; every shape is fixed by the bucket (tokens T, seqs S)."""

    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slots: jax.Array  # [T] int32 flat KV slot (page * page_size + offset), -1 for padding
    page_tables: jax.Array  # [S, max_pages_per_seq] int32
    cu_q_lens: jax.Array  # [S + 1] int32
    kv_lens: jax.Array  # [S] int32, KV length after this step
    num_seqs: jax.Array  # [] int32
    sample_rows: jax.Array  # [S] int32: the token whose logits sample each sequence's next token
    sampling: SamplingBatch  # [S] rows
    prompt_targets: jax.Array  # [T] int32: the next prompt token, whose logprob this row reports (-1: none)
    prompt_top_n: jax.Array  # [T] int32: top-N prompt logprobs wanted at this row (0: only the target)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptLogprobs:
    """Per scheduled token: logprob of the following prompt token and the top-N alternatives."""

    logprob: jax.Array  # [T] float32
    top_ids: jax.Array  # [T, MAX_TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [T, MAX_TOP_LOGPROBS] float32


@dataclasses.dataclass(frozen=True)
class Bucket:
    kind: str  # "prefill" | "decode"
    tokens: int
    seqs: int


class ModelRunner:
    def __init__(
        self,
        decoder: Decoder,
        num_pages: int,
        page_size: int,
        max_pages_per_seq: int,
        *,
        kv_dtype: Any = None,
        attention_backend: str = "reference",
        matmul_backend: str = "xla",
        sampling_shape: Callable[[int], SamplingBatch] | None = None,
    ):
        self.cfg = decoder.cfg
        self.graphdef, self.params = nnx.split(decoder)
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.attention_backend = attention_backend
        self.products = products.for_backend(matmul_backend)
        cpu = jax.devices()[0].platform == "cpu"
        # XLA:CPU computes a bfloat16 product with a single row in a plain loop at ~1.3 GB/s, about
        # 10x slower than the same product with two rows (which goes to the matmul library), so on
        # the CPU a bfloat16 step with XLA's products never multiplies a single row: one-token steps
        # get a padding token and a one-sequence head gets a padding row. (The native kernel streams
        # one row at the memory's rate.)
        native = matmul_backend == "cpu" and cpu and _native_products_available()
        self.min_rows = 2 if cpu and not native and jnp.dtype(decoder.dtype) == jnp.bfloat16 else 1
        self._sampling_shape = sampling_shape
        self._compiled: dict[Bucket, Any] = {}
        # Multi-host: the leader sends each step here before running it (set by the Engine).
        self.channel: Any = None
        # Tensor parallelism is the loaded parameters' layout: weights on a mesh mean a sharded
        # step; weights on one device mean the plain single-device step.
        self.mesh = mesh_of(self.params)
        self._kv_sharding: jax.sharding.Sharding | None = None
        kv_dtype = kv_dtype or decoder.dtype
        if self.mesh is None:
            self.kv = KVCache.create(self.cfg, num_pages, page_size, kv_dtype)
            self._step = jax.jit(self._step_fn, donate_argnums=(1,))
            return
        plan = ShardingPlan(self.mesh, self.cfg)
        kv_sharding, replicated = plan.kv_cache(), plan.replicated()
        self._kv_sharding = kv_sharding
        self.kv = KVCache.create(self.cfg, num_pages, page_size, kv_dtype, kv_sharding)
        # GSPMD partitions the step from these annotations (and inserts the collectives); the host
        # inputs and the sampled tokens are replicated, so every device agrees on every token.
        params_sharding = jax.tree_util.tree_map(lambda a: a.sharding, self.params)
        self._step = jax.jit(self._step_fn, donate_argnums=(1,),
                             in_shardings=(params_sharding, kv_sharding, replicated),
                             out_shardings=(kv_sharding, replicated, replicated))

    # ---- the jitted step ----------------------------------------------------------------------
    def _step_fn(self, params: nnx.State, kv: KVCache, inp: StepInputs) -> tuple[KVCache, SampleOutput, PromptLogprobs]:
        with products.use(self.products):  # read while tracing: the compiled step keeps it
            return self._step_body(params, kv, inp)

    def _step_body(self, params: nnx.State, kv: KVCache, inp: StepInputs) -> tuple[KVCache, SampleOutput, PromptLogprobs]:
        model: Decoder = nnx.merge(self.graphdef, params)
        tokens, positions, slots, t = inp.tokens, inp.positions, inp.slots, inp.tokens.shape[0]
        if t < self.min_rows:  # padding tokens: position 0, slot -1 (nothing written), past cu_q_lens
            pad = self.min_rows - t
            tokens, positions, slots = jnp.pad(tokens, (0, pad)), jnp.pad(positions, (0, pad)), jnp.pad(
                slots, (0, pad), constant_values=-1)
        attend = attention.paged_attend(
            slots, inp.page_tables, inp.cu_q_lens, inp.kv_lens, inp.num_seqs,
            scale=self.cfg.scale, softcap=self.cfg.attn_logit_softcap, page_size=self.page_size,
            backend=self.attention_backend,
        )
        if self._kv_sharding is not None:
            attend = _keep_cache_layout(attend, self._kv_sharding)
        hidden, kv = model.hidden_states(tokens[None], positions[None], attend, kv)
        hidden = hidden[:, :t]
        rows = hidden[0, inp.sample_rows]  # [S, hidden]
        s = rows.shape[0]
        if s < self.min_rows:
            rows = jnp.pad(rows, ((0, self.min_rows - s), (0, 0)))
        logits = model.logits(rows)[:s]  # [S, vocab] float32
        return kv, sample(logits, inp.sampling), self._prompt_logprobs(model, hidden[0], inp)

    @staticmethod
    def _prompt_logprobs(model: Decoder, hidden: jax.Array, inp: StepInputs) -> PromptLogprobs:
        """Logits for every scheduled token cost [tokens x vocab]; the cond computes them only in
        steps where some prompt asked for logprobs (echo, logprob_start_len), so other steps pay
        nothing and no separate program has to be compiled. They are computed in chunks of rows:
        XLA reserves a program's scratch memory for both branches of a cond on every run, and a
        2048-token step over a 128k vocabulary would otherwise hold ~6 GB of logits and top-k
        scratch that the KV cache could use."""
        wanted = inp.prompt_targets >= 0
        t = hidden.shape[0]
        chunk = max(c for c in range(1, min(t, PROMPT_LOGPROBS_CHUNK) + 1) if t % c == 0)

        def compute() -> PromptLogprobs:
            def rows(args: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
                h, target, top_n = args
                return token_logprobs(model.logits(h), target, top_n)

            split = lambda a: a.reshape(t // chunk, chunk, *a.shape[1:])  # noqa: E731
            lp, ids, top = jax.lax.map(rows, (split(hidden), split(jnp.maximum(inp.prompt_targets, 0)),
                                              split(jnp.where(wanted, inp.prompt_top_n, -1))))
            return PromptLogprobs(lp.reshape(t), ids.reshape(t, -1), top.reshape(t, -1))

        def skip() -> PromptLogprobs:
            t = inp.prompt_targets.shape[0]
            return PromptLogprobs(jnp.zeros(t, jnp.float32), jnp.full((t, MAX_TOP_LOGPROBS), -1, jnp.int32),
                                  jnp.full((t, MAX_TOP_LOGPROBS), -jnp.inf, jnp.float32))

        return jax.lax.cond(jnp.any(wanted), compute, skip)

    # ---- ahead-of-time compilation --------------------------------------------------------------
    def abstract_inputs(self, bucket: Bucket, sampling: SamplingBatch) -> StepInputs:
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        t, s = bucket.tokens, bucket.seqs
        return StepInputs(
            tokens=i32(t), positions=i32(t), slots=i32(t), page_tables=i32(s, self.max_pages_per_seq),
            cu_q_lens=i32(s + 1), kv_lens=i32(s), num_seqs=i32(), sample_rows=i32(s),
            sampling=jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sampling),
            prompt_targets=i32(t), prompt_top_n=i32(t),
        )

    def compile(self, buckets: list[Bucket], sampling_for: Callable[[int], SamplingBatch]) -> dict[Bucket, float]:
        """Compile every bucket now (progress bar; seconds per shape logged). With the persistent
        compilation cache warm, this is mostly cache reads."""
        seconds: dict[Bucket, float] = {}
        with tqdm(buckets, desc="compiling steps", unit="shape", disable=None) as bar:
            for bucket in bar:
                bar.set_postfix_str(f"{bucket.kind} tokens={bucket.tokens} seqs={bucket.seqs}")
                start = time.perf_counter()
                lowered = self._step.lower(self.params, self.kv, self.abstract_inputs(bucket, sampling_for(bucket.seqs)))
                self._compiled[bucket] = lowered.compile()
                seconds[bucket] = time.perf_counter() - start
                log.info("compiled %s step tokens=%d seqs=%d in %.2fs", bucket.kind, bucket.tokens, bucket.seqs,
                         seconds[bucket])
        return seconds

    def run(self, bucket: Bucket, inputs: StepInputs) -> tuple[SampleOutput, PromptLogprobs]:
        """Dispatch one step (asynchronously: the results are futures until read)."""
        compiled = self._compiled.get(bucket)
        if compiled is None:
            raise RuntimeError(f"step shape {bucket} was not compiled at start-up")
        if self.channel is not None and is_leader():
            self.channel.send(bucket, inputs)
        self.kv, out, prompt = compiled(self.params, self.kv, inputs)
        return out, prompt


def _native_products_available() -> bool:
    from pallas_kernels import cpu_matmul

    return cpu_matmul.available()


def _keep_cache_layout(attend: AttentionFn, kv_sharding: jax.sharding.Sharding) -> AttentionFn:
    """Pin the cache carried through the layer scan to its own sharding. Left free, GSPMD may
    re-split a replicated cache inside the loop (to follow the q heads) and all-gather the whole
    cache back after it: a full-cache collective on every step."""

    def pinned(q: jax.Array, k: jax.Array, v: jax.Array, cache: Any, window: jax.Array, layer: jax.Array):
        out, cache = attend(q, k, v, cache, window, layer)
        return out, jax.lax.with_sharding_constraint(cache, kv_sharding)

    return pinned


def build_inputs(
    bucket: Bucket,
    chunks: list[tuple[list[int], int, list[int]]],
    page_size: int,
    max_pages_per_seq: int,
    sampling: SamplingBatch,
    prompt_targets: list[tuple[list[int], int] | None] | None = None,
) -> StepInputs:
    """Pack (new token ids, first position, page table) per sequence into padded step arrays.
    prompt_targets, per chunk: (the next prompt token for each of its rows or -1, top-N) or None."""
    t, s = bucket.tokens, bucket.seqs
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.full(t, -1, np.int32)
    page_tables = np.zeros((s, max_pages_per_seq), np.int32)
    cu = np.zeros(s + 1, np.int32)
    kv_lens = np.zeros(s, np.int32)
    sample_rows = np.zeros(s, np.int32)
    targets = np.full(t, -1, np.int32)
    top_n = np.zeros(t, np.int32)
    offset = 0
    for i, (ids, start, pages) in enumerate(chunks):
        if prompt_targets and prompt_targets[i] is not None:
            row_targets, n_top = prompt_targets[i]
            targets[offset : offset + len(ids)] = row_targets
            top_n[offset : offset + len(ids)] = n_top
        n = len(ids)
        pos = np.arange(start, start + n, dtype=np.int32)
        table = np.asarray(pages, np.int32)
        tokens[offset : offset + n] = ids
        positions[offset : offset + n] = pos
        slots[offset : offset + n] = table[pos // page_size] * page_size + pos % page_size
        page_tables[i, : len(table)] = table
        cu[i + 1] = offset + n
        kv_lens[i] = start + n
        sample_rows[i] = offset + n - 1
        offset += n
    cu[len(chunks) + 1 :] = offset
    return StepInputs(
        tokens=tokens, positions=positions, slots=slots, page_tables=page_tables, cu_q_lens=cu, kv_lens=kv_lens,
        num_seqs=np.int32(len(chunks)), sample_rows=sample_rows, sampling=sampling, prompt_targets=targets,
        prompt_top_n=top_n,
    )
