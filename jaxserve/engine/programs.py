"""The compiled programs of one model on one cache layout: the prefill and decode steps and the
device-batch updates (jaxserve.engine.step_inputs names them). They hold no device arrays, so the
same programs compile for the running engine (jaxserve.engine.runner.ModelRunner, which owns the
weights, the KV cache and the device batch) and for hardware that is not here (jaxserve.plan
compiles them for abstract TPU devices).

Steps. A prefill step takes the scheduled tokens of up to S chunks, concatenated ([T] ragged,
padded to the bucket), attends over the paged cache through the ragged attention, and samples one
token per chunk from the logits at its last token. A decode step runs up to `decode_steps`
iterations of one token per row inside one `lax.while_loop`, feeding each sampled token back on
the device; a row stops inside the loop when it samples an end id past min_tokens or reaches its
length, and the loop stops when every row has or the host's iteration count is done. A row whose
token the host sends as -1 starts from its last sampled token, kept in the device batch (a step
dispatched ahead, before the host read the last one's tokens: jaxserve.engine.core), and runs
nothing if that token ended it. Both write
the new K/V into the donated cache, read sampling parameters from the device batch through each
row's slot, count the sampled tokens there for the penalties, and return only the sampled ids and
logprobs.

A verify step (speculative decoding) takes, for each decoding row, its last token followed by its
draft tokens, laid out ragged as a prefill's chunks, and samples at every position exactly as a
decode step would (same seed, same step number, so the same Gumbel noise): a row keeps the tokens
up to and including the first one that differs from the draft that followed it (or the one after
the whole draft), stopping early at an end id. Position j's token is sampled given the tokens
before it, and those are the drafts the row keeps, which equal what it sampled there: so every
row, greedy or seeded, produces the very tokens decode steps would, and a draft is accepted with
the probability the model gives it (what speculative sampling's rejection step gives for a draft
that proposes one token with certainty, with the draws of plain decoding). The K/V written for
rejected positions is never read: the host advances the row only past the kept tokens, and the
next step overwrites those slots.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxserve.engine import attention, device_batch
from jaxserve.engine.device_batch import DeviceBatch
from jaxserve.engine.kv_cache import KVCache
from jaxserve.engine.request import MAX_TOP_LOGPROBS
from jaxserve.engine.sampler import SampleOutput, sample, token_logprobs
from jaxserve.engine.step_inputs import Key, Payload
from jaxserve.models.config import DecoderConfig
from jaxserve.models.decoder import Decoder
from jaxserve.parallel import ShardingPlan

PROMPT_LOGPROBS_CHUNK = 128  # rows of prompt logprobs computed at a time (bounds the step's scratch memory)

STEP_KINDS = ("prefill", "decode", "verify")


@struct.dataclass
class PromptLogprobs:
    """Per scheduled token: logprob of the following prompt token and the top-N alternatives."""

    logprob: jax.Array  # [T] float32
    top_ids: jax.Array  # [T, MAX_TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [T, MAX_TOP_LOGPROBS] float32
    rank: jax.Array  # [T] int32: the prompt token's rank in the vocabulary (1 = the most likely)


@struct.dataclass
class StepOutput:
    """What a step returns to the host: for each of its K iterations (1 for prefill) and rows, the
    sampled token and logprobs, and how many iterations each row ran."""

    sample: SampleOutput  # leaves [K, S, ...]
    num_sampled: jax.Array  # [S] int32
    prompt: PromptLogprobs | None = None  # prefill steps


class StepPrograms:
    def __init__(self, graphdef: nnx.GraphDef, cfg: DecoderConfig, *, page_size: int, decode_steps: int = 1,
                 attention_backend: str = "reference", min_rows: int = 1, mesh: jax.sharding.Mesh | None = None,
                 params_sharding: Any = None):
        """mesh / params_sharding: the parameters' layout (tensor parallelism); None for the plain
        single-device step. min_rows: pad one-row products to this many rows (see ModelRunner)."""
        self.graphdef = graphdef
        self.cfg = cfg
        self.page_size = page_size
        self.decode_steps = decode_steps
        self.attention_backend = attention_backend
        self.min_rows = min_rows
        self.mesh = mesh
        # The sampler's TPU forms (jaxserve.engine.sampler, "Program size"): same values, programs
        # that compile in half the time on TPU and slightly slower elsewhere.
        self.row_loops = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform == "tpu"
        # The steps take the parameters as a flat list of arrays, unflattened inside the trace: a
        # per-layer model has hundreds of nnx Variables, and flattening them in Python on every
        # call cost ~3.6 ms of host time per step (SmolLM2, 30 layers); a list of arrays is
        # flattened by jit's C++ dispatch. Set from the first parameters lowered (`trace`).
        self.param_treedef: Any = None
        self.kv_sharding: jax.sharding.Sharding | None = None
        self.replicated: jax.sharding.Sharding | None = None
        if mesh is not None:
            plan = ShardingPlan(mesh, cfg)
            self.kv_sharding, self.replicated = plan.kv_cache(), plan.replicated()
        self.jitted = self._jit(params_sharding)

    def _jit(self, params_sharding: Any) -> dict[str, Any]:
        """One jitted function per command kind. Under a mesh GSPMD partitions the steps from these
        annotations (and inserts the collectives); the device batch, the host inputs and the
        sampled tokens are replicated, so every device agrees on every token."""
        step_shardings: dict[str, Any] = {}
        update_shardings: dict[str, Any] = {}
        if self.mesh is not None:
            replicated = self.replicated
            step_shardings = dict(in_shardings=(jax.tree.leaves(params_sharding), self.kv_sharding, replicated,
                                                replicated),
                                  out_shardings=(self.kv_sharding, replicated, replicated))
            update_shardings = dict(in_shardings=(replicated, replicated), out_shardings=replicated)
        updates = {
            "rows": lambda b, p: device_batch.set_rows(b, p["slots"], {k: v for k, v in p.items() if k != "slots"}),
            "tokens": lambda b, p: device_batch.add_tokens(b, p["slots"], p["ids"], p["prompt"]),
            "pages": lambda b, p: device_batch.set_pages(b, p["slots"], p["index"], p["pages"]),
            "masks": lambda b, p: device_batch.set_masks(b, p["slots"], p["masks"]),
            "bans": lambda b, p: device_batch.set_bans(b, p["slots"], p["ids"]),
        }
        jitted = {kind: jax.jit(fn, donate_argnums=(0,), **update_shardings) for kind, fn in updates.items()}
        copy_shardings = {}
        if self.mesh is not None:
            copy_shardings = dict(in_shardings=(self.kv_sharding, self.replicated), out_shardings=self.kv_sharding)
        jitted["copy"] = jax.jit(copy_pages, donate_argnums=(0,), **copy_shardings)
        jitted["prefill"] = jax.jit(self._prefill_fn, donate_argnums=(1, 2), **step_shardings)
        jitted["decode"] = jax.jit(self._decode_fn, donate_argnums=(1, 2), **step_shardings)
        jitted["verify"] = jax.jit(self._verify_fn, donate_argnums=(1, 2), **step_shardings)
        return jitted

    def flat_params(self, params: Any) -> list[Any]:
        """The parameters as the steps take them: their leaves (see `param_treedef`)."""
        leaves, treedef = jax.tree.flatten(params)
        if self.param_treedef is None:
            self.param_treedef = treedef
        elif treedef != self.param_treedef:
            raise ValueError("these parameters are not the ones the steps were traced for")
        return leaves

    def trace(self, key: Key, params: Any, kv: KVCache, batch: DeviceBatch,
              spec: dict[str, tuple[tuple[int, ...], Any]]) -> jax.stages.Traced:
        """The program of `key` traced for these arguments (arrays or ShapeDtypeStructs; params as
        the model's nnx state)."""
        payload = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in spec.items()}
        fn = self.jitted[key[0]]
        if key[0] in STEP_KINDS:
            return fn.trace(self.flat_params(params), kv, batch, payload)
        if key[0] == "copy":
            return fn.trace(kv, payload)
        return fn.trace(batch, payload)

    def lower(self, key: Key, params: Any, kv: KVCache, batch: DeviceBatch,
              spec: dict[str, tuple[tuple[int, ...], Any]]) -> jax.stages.Lowered:
        """The program of `key` lowered for these arguments (see `trace`)."""
        return self.trace(key, params, kv, batch, spec).lower()

    def _model(self, params: list[Any]) -> Decoder:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.param_treedef, params))

    def _forward(self, model: Decoder, kv: KVCache, tokens: jax.Array, positions: jax.Array, kv_slots: jax.Array,
                 page_tables: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array,
                 decode: bool, embeds: tuple[jax.Array, jax.Array] | None = None,
                 rope: jax.Array | None = None, lora: jax.Array | None = None,
                 long_rope: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """The model over one row of [t] tokens attending through the paged cache: hidden [t, H].
        embeds: ([t, H] values, [t] mask) replacing token embeddings (Decoder.hidden_states);
        rope: an M-RoPE model's [t, 3] rotary positions; lora: each token's LoRA adapter slot [t]
        (a model with adapters); long_rope: whether each token rotates by LongRoPE's long factors
        [t] (a LongRoPE model)."""
        t = tokens.shape[0]
        if t < self.min_rows:  # padding tokens: position 0, slot -1 (nothing written), past cu_q_lens
            pad = self.min_rows - t
            tokens, positions = jnp.pad(tokens, (0, pad)), jnp.pad(positions, (0, pad))
            kv_slots = jnp.pad(kv_slots, (0, pad), constant_values=-1)
            if embeds is not None:
                embeds = (jnp.pad(embeds[0], ((0, pad), (0, 0))), jnp.pad(embeds[1], (0, pad)))
            if rope is not None:
                rope = jnp.pad(rope, ((0, pad), (0, 0)))
            if lora is not None:
                lora = jnp.pad(lora, (0, pad), constant_values=-1)
            if long_rope is not None:
                long_rope = jnp.pad(long_rope, (0, pad))
        attend = attention.paged_attention(
            kv_slots, page_tables, cu_q_lens, kv_lens, num_seqs, scale=self.cfg.scale,
            softcap=self.cfg.attn_logit_softcap, backend=self.attention_backend,
            # A one-token step padded to min_rows tokens still takes the decode kernel (on its rows).
            decode=decode, cache_sharding=self.kv_sharding,
        )
        if embeds is not None:
            embeds = (embeds[0][None], embeds[1][None])
        hidden, kv = model.hidden_states(tokens[None], positions[None], attend, kv, embeds,
                                         None if rope is None else rope[None], None if lora is None else lora[None],
                                         None if long_rope is None else long_rope[None])
        return hidden[0, :t], kv

    def _logits(self, model: Decoder, rows: jax.Array) -> jax.Array:
        s = rows.shape[0]
        if s < self.min_rows:
            rows = jnp.pad(rows, ((0, self.min_rows - s), (0, 0)))
        return model.logits(rows)[:s]  # [S, vocab] float32

    def _ragged_forward(self, model: Decoder, kv: KVCache, batch: DeviceBatch,
                        inp: Payload) -> tuple[jax.Array, KVCache, jax.Array]:
        """The model over a ragged step's chunks (prefill, verify): hidden [T, H], the new cache,
        and each token's row [T] (padding tokens: the last row, with nothing written)."""
        t, s = inp["tokens"].shape[0], inp["row_slots"].shape[0]
        cu = inp["cu_q_lens"]
        token_row = jnp.minimum(jnp.searchsorted(cu[1:], jnp.arange(t), side="right"), s - 1)
        valid = jnp.arange(t) < cu[inp["num_seqs"]]
        row_slots = inp["row_slots"]
        kv_slots = device_batch.page_slots(batch, row_slots[token_row], inp["positions"], valid, self.page_size)
        embeds = (inp["embeds"], inp["embedded"]) if "embeds" in inp else None
        hidden, kv = self._forward(model, kv, inp["tokens"], inp["positions"], kv_slots,
                                   batch.page_tables[row_slots], cu, inp["kv_lens"], inp["num_seqs"], False, embeds,
                                   inp.get("rope_positions"), _lora_slots(model, batch, row_slots[token_row]),
                                   _long_rope(model, batch, row_slots[token_row]))
        return hidden, kv, token_row

    def _prefill_fn(self, params: list[Any], kv: KVCache, batch: DeviceBatch,
                    inp: Payload) -> tuple[KVCache, DeviceBatch, StepOutput]:
        model = self._model(params)
        batch = _page_updates(batch, inp)
        s = inp["row_slots"].shape[0]
        row_slots = inp["row_slots"]
        hidden, kv, _ = self._ragged_forward(model, kv, batch, inp)
        sampled = sample(self._logits(model, hidden[inp["sample_rows"]]),
                         device_batch.sampling_rows(batch, row_slots, inp["steps"]), row_loops=self.row_loops)
        samples = inp["samples"] & (jnp.arange(s) < inp["num_seqs"])
        batch = device_batch.record_tokens(batch, row_slots, sampled.token, samples)
        prompt = _prompt_logprobs(model, hidden, inp["prompt_targets"], inp["prompt_top_n"])
        out = StepOutput(jax.tree_util.tree_map(lambda a: a[None], sampled), samples.astype(jnp.int32), prompt)
        return kv, batch, out

    def _decode_fn(self, params: list[Any], kv: KVCache, batch: DeviceBatch,
                   inp: Payload) -> tuple[KVCache, DeviceBatch, StepOutput]:
        model = self._model(params)
        batch = _page_updates(batch, inp)
        s = inp["tokens"].shape[0]
        row_slots, remaining = inp["row_slots"], inp["remaining"]
        page_tables = batch.page_tables[row_slots]
        cu = jnp.arange(s + 1, dtype=jnp.int32)
        k = self.decode_steps
        empty = SampleOutput(
            token=jnp.zeros((k, s), jnp.int32), logprob=jnp.zeros((k, s), jnp.float32),
            top_ids=jnp.full((k, s, MAX_TOP_LOGPROBS), -1, jnp.int32),
            top_logprobs=jnp.full((k, s, MAX_TOP_LOGPROBS), -jnp.inf, jnp.float32))

        def body(carry: tuple) -> tuple:
            j, kv, batch, tokens, positions, steps, active, outs, num_sampled = carry
            kv_slots = device_batch.page_slots(batch, row_slots, positions, active, self.page_size)
            lengths = jnp.where(active, positions + 1, 0)
            # An M-RoPE model's generated tokens sit at index + the row's delta on all three axes.
            rope = jnp.repeat((positions + inp["rope_delta"])[:, None], 3, axis=1) if "rope_delta" in inp else None
            hidden, kv = self._forward(model, kv, tokens, positions, kv_slots, page_tables, cu, lengths,
                                       inp["num_seqs"], True, rope=rope, lora=_lora_slots(model, batch, row_slots),
                                       long_rope=_long_rope(model, batch, row_slots))
            sampled = sample(self._logits(model, hidden), device_batch.sampling_rows(batch, row_slots, steps),
                             row_loops=self.row_loops)
            batch = device_batch.record_tokens(batch, row_slots, sampled.token, active)
            batch = device_batch.set_last_tokens(batch, row_slots, sampled.token, active)
            # (min_logprob: a draft model's loop ends a row at a draft below its confidence threshold.)
            ended = (device_batch.ends_row(batch, row_slots, steps, sampled.token) | (j + 1 >= remaining)
                     | (sampled.logprob < inp["min_logprob"]))
            outs = jax.tree_util.tree_map(lambda buf, new: buf.at[j].set(new), outs, sampled)
            num_sampled = num_sampled + active.astype(jnp.int32)
            return (j + 1, kv, batch, sampled.token, positions + 1, steps + 1, active & ~ended, outs, num_sampled)

        def more(carry: tuple) -> jax.Array:
            j, active = carry[0], carry[6]
            return (j < jnp.minimum(inp["num_steps"], k)) & jnp.any(active)

        tokens = device_batch.step_tokens(batch, row_slots, inp["tokens"])
        # A row of a step dispatched ahead whose last token ended it in the step before (an end id
        # past min_tokens; a live row's last token never is one): the host drops the row, so it
        # runs no iteration and writes nothing, and a step of such rows only returns.
        ended = (inp["tokens"] < 0) & device_batch.ends_row(batch, row_slots, inp["steps"] - 1, tokens)
        active = (jnp.arange(s) < inp["num_seqs"]) & ~ended
        carry = (jnp.int32(0), kv, batch, tokens, inp["positions"], inp["steps"], active, empty,
                 jnp.zeros(s, jnp.int32))
        if k == 1:  # one iteration: no loop around the model
            carry = body(carry)
        else:
            carry = jax.lax.while_loop(more, body, carry)
        _, kv, batch, _, _, _, _, outs, num_sampled = carry
        return kv, batch, StepOutput(outs, num_sampled)


    def _verify_fn(self, params: list[Any], kv: KVCache, batch: DeviceBatch,
                   inp: Payload) -> tuple[KVCache, DeviceBatch, StepOutput]:
        model = self._model(params)
        batch = _page_updates(batch, inp)
        tokens, cu = inp["tokens"], inp["cu_q_lens"]
        t, s = tokens.shape[0], inp["row_slots"].shape[0]
        width = t // s  # most tokens a row verifies: its last token and its drafts
        index = jnp.arange(t)
        hidden, kv, token_row = self._ragged_forward(model, kv, batch, inp)
        valid = index < cu[inp["num_seqs"]]
        slots = inp["row_slots"][token_row]
        steps = inp["steps"][token_row] + index - cu[token_row]
        following = jnp.minimum(index + 1, t - 1)
        draft = jnp.where(valid & (index + 1 < cu[token_row + 1]), tokens[following], -1)
        sampled = sample(self._logits(model, hidden), device_batch.sampling_rows(batch, slots, steps),
                         row_loops=self.row_loops)

        # Per row [S, width]: position j holds the row's token cu[i] + j.
        j = jnp.arange(width)[None, :]
        at = jnp.minimum(cu[:s, None] + j, t - 1)
        in_row = (j < (cu[1:] - cu[:-1])[:, None]) & (jnp.arange(s) < inp["num_seqs"])[:, None]
        token = sampled.token[at]
        ends = device_batch.ends_row(batch, slots[at].reshape(-1), steps[at].reshape(-1),
                                     token.reshape(-1)).reshape(s, width)
        emitted = kept_tokens(token, draft[at], in_row, ends)
        batch = device_batch.record_tokens(batch, slots[at].reshape(-1), token.reshape(-1), emitted.reshape(-1))
        rows = jax.tree_util.tree_map(lambda a: jnp.swapaxes(a[at], 0, 1), sampled)  # [width, S, ...]
        return kv, batch, StepOutput(rows, jnp.sum(emitted, axis=1).astype(jnp.int32))


def kept_tokens(token: jax.Array, draft: jax.Array, in_row: jax.Array, ends: jax.Array) -> jax.Array:
    """Which of a verify step's sampled tokens [S, W] each row keeps: position j's token was
    sampled after the row's drafts 1..j, so it counts only while every earlier position sampled
    its draft (`draft` [S, W]: the draft that follows position j, -1 past the last); the first
    position that did not is the row's last (its token is the correction, or after the whole
    draft the bonus), and so is the first whose token ends the row (`ends`). `in_row`: the row's
    real positions."""
    width = token.shape[1]
    kept_drafts = jnp.sum(jnp.cumprod(in_row & (token == draft), axis=1), axis=1)
    emitted = in_row & (jnp.arange(width)[None, :] <= kept_drafts[:, None])
    ended_before = jnp.cumsum(ends & emitted, axis=1) - (ends & emitted)
    return emitted & (ended_before == 0)


def copy_pages(kv: KVCache, inp: Payload) -> KVCache:
    """Copy whole KV pages src[i] -> dst[i] in every layer (a forked beam's partial last page);
    padding pairs copy the null page onto itself."""
    src, dst = inp["src"], inp["dst"]
    return KVCache(kv.k.at[:, :, dst].set(kv.k[:, :, src]), kv.v.at[:, :, dst].set(kv.v[:, :, src]))


def _lora_slots(model: Decoder, batch: DeviceBatch, slots: jax.Array) -> jax.Array | None:
    """The LoRA adapter of each of these batch rows (None for a model without adapters, whose
    steps never read the rows' adapters)."""
    return batch.rows["lora"][slots] if model.lora_slots else None


def _long_rope(model: Decoder, batch: DeviceBatch, slots: jax.Array) -> jax.Array | None:
    """Whether each of these batch rows rotates by LongRoPE's long factors (None for any other
    model)."""
    return batch.rows["long_rope"][slots] if model.cfg.rope.kind == "longrope" else None


def _page_updates(batch: DeviceBatch, inp: Payload) -> DeviceBatch:
    return device_batch.set_pages(batch, inp["page_slots"], inp["page_index"], inp["page_ids"])


def _prompt_logprobs(model: Decoder, hidden: jax.Array, targets: jax.Array, top_n: jax.Array) -> PromptLogprobs:
    """Logits for every scheduled token cost [tokens x vocab]; the cond computes them only in
    steps where some prompt asked for logprobs (echo, logprob_start_len), so other steps pay
    nothing and no separate program has to be compiled. They are computed in chunks of rows:
    XLA reserves a program's scratch memory for both branches of a cond on every run, and a
    2048-token step over a 128k vocabulary would otherwise hold ~6 GB of logits and top-k
    scratch that the KV cache could use."""
    wanted = targets >= 0
    t = hidden.shape[0]
    chunk = max(c for c in range(1, min(t, PROMPT_LOGPROBS_CHUNK) + 1) if t % c == 0)

    def compute() -> PromptLogprobs:
        def rows(args: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            h, target, n = args
            logits = model.logits(h)
            # vLLM's rank: how many tokens are at least as likely as this one (ties share the worse rank).
            chosen = jnp.take_along_axis(logits, target[:, None], axis=-1)
            rank = jnp.sum(logits >= chosen, axis=-1, dtype=jnp.int32)
            return (*token_logprobs(logits, target, n), rank)

        split = lambda a: a.reshape(t // chunk, chunk, *a.shape[1:])  # noqa: E731
        lp, ids, top, rank = jax.lax.map(rows, (split(hidden), split(jnp.maximum(targets, 0)),
                                                split(jnp.where(wanted, top_n, -1))))
        return PromptLogprobs(lp.reshape(t), ids.reshape(t, -1), top.reshape(t, -1), rank.reshape(t))

    def skip() -> PromptLogprobs:
        return PromptLogprobs(jnp.zeros(t, jnp.float32), jnp.full((t, MAX_TOP_LOGPROBS), -1, jnp.int32),
                              jnp.full((t, MAX_TOP_LOGPROBS), -jnp.inf, jnp.float32), jnp.zeros(t, jnp.int32))

    return jax.lax.cond(jnp.any(wanted), compute, skip)



