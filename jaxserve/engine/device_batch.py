"""The persistent device batch: one row per slot of everything a running sequence's steps read
besides its tokens, kept on the device and changed only by the scheduler's diff.

A sequence gets a slot when it is admitted (jaxserve.engine.scheduler) and its row is written
once (`set_rows`): sampling parameters, logit bias, bans, end ids. After that a step sends only
what changed: new page-table entries, this step's grammar masks, and the step's tokens and
positions. Penalty counts are updated on the device from the sampled tokens (`record_tokens`),
never rebuilt from token histories on the host, so nothing a step sends grows with
max_model_len. Each decoding row's last sampled token is kept too (`last_token`): a decode step
dispatched before the host has read the previous one's tokens (jaxserve.engine.core) takes its
rows' tokens from there. Steps read their rows through `slots` (a gather of a few numbers per row; the
[slots, V] arrays only inside the sampler branches that need them).

Slot `num_slots - 1` is never given to a sequence: padding rows of a bucket read it (greedy, no
logprobs, page table all null page). Updates pad with slot `num_slots`, out of range, which every
scatter drops.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.engine.rows import ROW_ARRAYS, empty_rows, mask_words
from jaxserve.engine.sampler import SamplingBatch

Array = jax.Array


@struct.dataclass
class DeviceBatch:
    rows: dict[str, Array]  # jaxserve.engine.rows.ROW_ARRAYS, [num_slots, ...] each
    counts: Array  # i32[num_slots, V]: output-token counts (frequency / presence / repetition penalties)
    prompt_mask: Array  # bool[num_slots, V]: prompt tokens (repetition penalty)
    allowed: Array  # u32[num_slots, ceil(V / 32)]: grammar masks of constrained rows, rewritten every step
    page_tables: Array  # i32[num_slots, max_pages_per_seq]
    last_token: Array  # i32[num_slots]: the token each row's last decode iteration sampled

    @property
    def num_slots(self) -> int:
        return self.page_tables.shape[0]


def abstract_batch(num_slots: int, vocab_size: int, max_pages_per_seq: int, sharding: Any = None) -> DeviceBatch:
    """The batch's shapes and dtypes (ShapeDtypeStructs with `sharding`)."""
    def spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return DeviceBatch(
        rows={name: spec((num_slots, *shape), dtype) for name, (dtype, shape) in ROW_ARRAYS.items()},
        counts=spec((num_slots, vocab_size), jnp.int32),
        prompt_mask=spec((num_slots, vocab_size), jnp.bool_),
        allowed=spec((num_slots, mask_words(vocab_size)), jnp.uint32),
        page_tables=spec((num_slots, max_pages_per_seq), jnp.int32),
        last_token=spec((num_slots,), jnp.int32),
    )


def create_batch(num_slots: int, vocab_size: int, max_pages_per_seq: int, sharding: Any = None) -> DeviceBatch:
    """Every slot a padding row (made on the device, in `sharding`)."""
    shapes = abstract_batch(num_slots, vocab_size, max_pages_per_seq)
    padding = empty_rows(1)

    def make() -> DeviceBatch:
        rows = {name: jnp.broadcast_to(jnp.asarray(padding[name][0]), s.shape) for name, s in shapes.rows.items()}
        zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
        return DeviceBatch(rows, zeros(shapes.counts), zeros(shapes.prompt_mask), zeros(shapes.allowed),
                           zeros(shapes.page_tables), zeros(shapes.last_token))

    return jax.jit(make, out_shardings=sharding)()


# ---- updates (each jitted by the runner with the batch donated; padding slot = num_slots: dropped) ----

def set_rows(batch: DeviceBatch, slots: Array, rows: dict[str, Array]) -> DeviceBatch:
    """New sequences in `slots` [A]: their parameters; counts, prompt mask, grammar mask and page
    table start empty."""
    new_rows = {name: batch.rows[name].at[slots].set(rows[name], mode="drop") for name in batch.rows}
    clear = lambda a: a.at[slots].set(jnp.zeros(a.shape[1:], a.dtype), mode="drop")  # noqa: E731
    return DeviceBatch(new_rows, clear(batch.counts), clear(batch.prompt_mask), clear(batch.allowed),
                       clear(batch.page_tables), clear(batch.last_token))


def add_tokens(batch: DeviceBatch, slots: Array, ids: Array, prompt: Array) -> DeviceBatch:
    """Token ids [C] of the rows `slots` [C] that penalties need: output tokens (prompt False)
    are counted, prompt tokens (prompt True) marked."""
    counted = jnp.where(prompt, batch.counts.shape[0], slots)  # out of range: dropped
    marked = jnp.where(prompt, slots, batch.counts.shape[0])
    counts = batch.counts.at[counted, ids].add(1, mode="drop")
    prompt_mask = batch.prompt_mask.at[marked, ids].set(True, mode="drop")
    return batch.replace(counts=counts, prompt_mask=prompt_mask)


def set_pages(batch: DeviceBatch, slots: Array, index: Array, pages: Array) -> DeviceBatch:
    """page_tables[slots[i], index[i]] = pages[i]."""
    return batch.replace(page_tables=batch.page_tables.at[slots, index].set(pages, mode="drop"))


def set_masks(batch: DeviceBatch, slots: Array, masks: Array) -> DeviceBatch:
    """This step's grammar masks [G, W] of the constrained rows `slots` [G]."""
    return batch.replace(allowed=batch.allowed.at[slots].set(masks, mode="drop"))


def set_bans(batch: DeviceBatch, slots: Array, ids: Array) -> DeviceBatch:
    """This step's banned ids [G, NBan] of the rows `slots` [G] (whose bans depend on their last tokens)."""
    rows = dict(batch.rows, banned_ids=batch.rows["banned_ids"].at[slots].set(ids, mode="drop"))
    return batch.replace(rows=rows)


# ---- what a step reads and writes -------------------------------------------------------------

def sampling_rows(batch: DeviceBatch, slots: Array, steps: Array) -> SamplingBatch:
    """The sampling parameters of batch rows `slots` [B] sampling their `steps`-th output token:
    end ids are banned until min_tokens."""
    r = {name: a[slots] for name, a in batch.rows.items()}
    early = (steps < r["min_tokens"])[:, None]
    banned = jnp.concatenate([r["banned_ids"], jnp.where(early, r["end_ids"], -1)], axis=1)
    return SamplingBatch(
        temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"], min_p=r["min_p"],
        frequency_penalty=r["frequency_penalty"], presence_penalty=r["presence_penalty"],
        repetition_penalty=r["repetition_penalty"], bias_ids=r["bias_ids"], bias_values=r["bias_values"],
        banned_ids=banned, seed=r["seed"], step=steps, num_logprobs=r["num_logprobs"],
        processed_logprobs=r["processed_logprobs"], constrained=r["constrained"], slots=slots,
        counts=batch.counts, prompt_mask=batch.prompt_mask, allowed=batch.allowed,
    )


def ends_row(batch: DeviceBatch, slots: Array, steps: Array, tokens: Array) -> Array:
    """Whether sampling `tokens` [B] as output token number `steps` ends each row: an end id (EOS
    unless ignore_eos, stop token ids) once min_tokens are reached."""
    end_ids = batch.rows["end_ids"][slots]
    hit = jnp.any(end_ids == tokens[:, None], axis=1)
    return hit & (steps >= batch.rows["min_tokens"][slots])


def record_tokens(batch: DeviceBatch, slots: Array, tokens: Array, valid: Array) -> DeviceBatch:
    """Count each valid row's sampled token (the penalties of its next steps see it)."""
    counted = jnp.where(valid, slots, batch.counts.shape[0])
    return batch.replace(counts=batch.counts.at[counted, tokens].add(1, mode="drop"))


def set_last_tokens(batch: DeviceBatch, slots: Array, tokens: Array, valid: Array) -> DeviceBatch:
    """Keep each valid row's sampled token as its last (rows are distinct slots; padding rows,
    never valid, all read the padding slot and write its own value back)."""
    last = jnp.where(valid, tokens, batch.last_token[slots])
    return batch.replace(last_token=batch.last_token.at[slots].set(last))


def step_tokens(batch: DeviceBatch, slots: Array, tokens: Array) -> Array:
    """A decode step's input tokens: the host's, or where it sent -1 (it has not read them yet)
    the row's last sampled token."""
    return jnp.where(tokens < 0, batch.last_token[slots], tokens)


def page_slots(batch: DeviceBatch, slots: Array, positions: Array, valid: Array, page_size: int) -> Array:
    """Flat KV slot (page * page_size + offset) of each token at `positions` of the rows `slots`
    (one per token), -1 where not `valid`."""
    pages = batch.page_tables[slots, positions // page_size]
    return jnp.where(valid, pages * page_size + positions % page_size, -1)


def padding_slot(num_slots: int) -> int:
    """The slot the padding rows of a bucket read (never given to a sequence)."""
    return num_slots - 1


def dropped_slot(num_slots: int) -> np.int32:
    """The slot id padding entries of an update carry: out of range, so the scatter drops them."""
    return np.int32(num_slots)
