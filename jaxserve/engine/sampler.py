"""Per-row sampling inside the jitted engine step.

`sample(logits, batch)` is one pure, jittable function over a pytree of per-row arrays, so the
step that runs the model also picks the next tokens and only a few numbers per row (the token, its
logprob and the requested top-N logprobs) ever leave the device. Every row carries its own
parameters; everything is computed row-wise, so rows in one batch never affect each other's
tokens or logprobs (the `jnp.any` predicates below only skip work that is the identity for rows
that do not need it).

Processing order (as vLLM's v1 sampler), per row:

    raw logits -> [raw logprobs] -> logit_bias -> grammar mask -> banned ids -> penalties (repetition, then
    frequency and presence) -> temperature -> [processed logprobs] -> min_p -> top_k -> top_p
    -> sample (greedy: argmax; otherwise Gumbel-max with noise from the row's own key)

Decisions worth knowing:

- **Greedy** rows are those with temperature < `GREEDY_TEMPERATURE` (1e-5, vLLM's epsilon): dividing
  by a vanishing temperature overflows float32. Their processed logprobs use temperature 1.
- **Reproducibility**: a row's key is `fold_in(key(seed), step)`, so a (seed, request) pair gives
  the same tokens whatever else is in the batch, and a request recomputed after preemption (same
  seed, same step numbers) resamples identically.
- **Drawing** is Gumbel-max (argmax of logits + per-row Gumbel noise over the vocabulary). One
  uniform against the CDF would need B random numbers instead of B * V, but the CDF is a sum over
  the whole vocabulary, so the last-bit differences between batch shapes moved the chosen token
  whenever the uniform landed in the long tail -- and "same seed, same tokens, whatever else is in
  the batch" is a promise users test. What keeps the B * V numbers cheap: threefry runs once per
  row, for the row's key, and each token's noise is its id hashed under that key.
- **No sort**: top_k and top_p thresholds are found by a 32-step bisection over the logits' bit
  patterns (exact), because XLA's sort of a real vocabulary is the slowest thing a sampler can do on
  the CPU. Each filter runs only when some sampled row in the batch uses it.
- **One branch point** for batches that need nothing between the bias and the logprobs but argmax
  (every row greedy, nothing banned, masked or penalised: greedy requests, evaluation runs and the
  serving benchmarks). XLA:GPU runs a `lax.cond` by copying its predicate to the host and waiting
  for the device to drain (`ConditionalThunk`), so each cond in the decode loop costs a sync per
  token and leaves the GPU idle until the host launches the next kernels. Such a batch passes one
  cond (then the argmax) where it passed three (grammar, penalties, draw): with the loop's condition
  and the top-N logprobs' cond, three syncs a token instead of five. The other branch runs the
  stages below, each still skipped when no row uses it. On the CPU and TPU a cond costs no sync;
  there it is the same work. Top-N keeps a cond of its own: moved one cond deeper, its sort over
  vocabulary-sharded logits (tensor parallelism on TPU) aborts libtpu 0.0.48's compiler ("Stable
  sort expects more than 1 operand"), and computing it whenever the other branch runs would cost the
  CPU's sampled batches a `lax.top_k` every step (1.3 ms at 16 rows over 49k tokens).
- **Everything banned**: if after `banned_ids` a row has no finite logit left, the ban is lifted for
  that row for this step (sampling proceeds from the biased logits as if nothing were banned), so a
  row never yields NaN logprobs or an arbitrary token 0. The host builds `banned_ids` from
  bad_words, min_tokens (EOS / stop ids) and ignore_eos; a ban that leaves nothing is a request that
  cannot be honoured, and the model's own choice is the least surprising answer.
- **Ties** are resolved by value, never by sort position: top_k keeps every token whose value
  equals the k-th largest, and top_p keeps every token tied with the last one needed to reach
  mass p. Kept sets may therefore be larger than k / the minimal nucleus, but they never depend on
  the (unspecified) order of equal values.
- **Sparse shapes**: logit_bias is `MAX_LOGIT_BIAS` (id, value) pairs per row — OpenAI's own limit
  of 300 entries, so every valid request fits one compiled shape — and `banned_ids` a fixed number
  of ids per row (jaxserve.engine.rows). Padding is -1 (remapped on device to the out-of-range id
  V, which the scatters drop). The packer refuses rows that do not fit rather than drop entries.
- **Per-slot state**: the penalty counts, prompt masks and grammar masks live in the device batch,
  one row per slot ([slots, V]); a batch row reads its slot's (`slots`) only inside the branch that
  needs them, so a step without penalties or grammars never touches the [slots, V] arrays.
- **Structured output**: a constrained row brings a packed bitmask of the tokens its grammar allows
  (`allowed`, bit t % 32 of word t // 32, filled on the host by the row's matcher). It is unpacked
  with shifts (no gather) under a `lax.cond`, so batches without constrained rows pay nothing.
  Unlike bans, the grammar mask is never lifted: if bans would leave a constrained row nothing, the
  bans give way and the grammar stays.
- **Penalties** read the row's output-token counts and prompt mask (kept up to date on the
  device, never rebuilt from token histories on the host); a `lax.cond` skips them when no row in
  the batch is penalised.
- **Program size**: the sampler is in every compiled step, so its compile time is start-up time
  per bucket. XLA:TPU turns three of its batch-wide forms into outsized programs: gathers of
  vocabulary-wide per-slot rows (penalty state, grammar masks), the bans' scatter, and the draw
  over many rows at once. `row_loops=True` (the engine sets it for TPU programs) computes the same
  values in loops over rows (blocks of 8 for the draw): at 64 rows over a 128k vocabulary, one v6e
  chip, the sampler went from 165k instruction bundles and 13.8 s of compile to 83k and 5.0 s.
  XLA:CPU is the other way round (the loops add fusions, ~8 ms of compile each), so other
  platforms keep the batch-wide forms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.engine.request import MAX_TOP_LOGPROBS
from jaxserve.engine.rows import RowParams, mask_words, pack_rows

Array = jax.Array

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy

_NEG_INF = float("-inf")
_DRAW_BLOCK = 8


@struct.dataclass
class SamplingBatch:
    """Per-row sampling parameters; the [B] arrays have one entry per batch row, the per-slot
    arrays one row per slot of the device batch, read through `slots`. Token-id arrays are padded
    with -1. Tests build one with `make_sampling_batch`; the engine gathers it from its device batch."""

    temperature: Array  # f32[B]; < GREEDY_TEMPERATURE => greedy
    top_k: Array  # i32[B]; <= 0 (or >= V) => off
    top_p: Array  # f32[B]; >= 1 => off
    min_p: Array  # f32[B]; 0 => off
    frequency_penalty: Array  # f32[B]; OpenAI: logit -= freq * count over output tokens
    presence_penalty: Array  # f32[B]; OpenAI: logit -= pres * (count > 0) over output tokens
    repetition_penalty: Array  # f32[B]; HF/vLLM over prompt + output tokens; 1 => off
    bias_ids: Array  # i32[B, NB]; logit_bias token ids
    bias_values: Array  # f32[B, NB]; added to the logits of bias_ids
    banned_ids: Array  # i32[B, NBan]; set to -inf this step
    seed: Array  # u32[B]; per-row seed (the host draws one when the user gave none)
    step: Array  # i32[B]; index of the token being sampled within the row's output
    num_logprobs: Array  # i32[B]; -1 none, 0 chosen token only, N also top-N
    processed_logprobs: Array  # bool[B]; False: raw model distribution; True: after bias/penalties/temperature
    constrained: Array  # bool[B]; the row's tokens are limited to its slot's `allowed`
    slots: Array  # i32[B]; the row's slot in the per-slot arrays below
    counts: Array  # i32[slots, V]; each slot's output-token counts (frequency/presence/repetition)
    prompt_mask: Array  # bool[slots, V]; each slot's prompt tokens (repetition)
    allowed: Array  # u32[slots, ceil(V / 32)]; packed grammar mask (bit t % 32 of word t // 32)


@struct.dataclass
class SampleOutput:
    token: Array  # i32[B]
    # f32[B]: logprob of the chosen token (raw or processed per row). Always filled, whatever
    # num_logprobs says: best_of ranks samples by cumulative logprob even when none are reported.
    logprob: Array
    top_ids: Array  # i32[B, MAX_TOP_LOGPROBS]; -1 beyond the row's num_logprobs
    top_logprobs: Array  # f32[B, MAX_TOP_LOGPROBS]; -inf beyond the row's num_logprobs


def sample(logits: Array, batch: SamplingBatch, *, row_loops: bool = False) -> SampleOutput:
    """Sample one token per row from logits [B, V] (any float dtype; computed in float32).

    row_loops: do the vocabulary-wide work that XLA:TPU compiles into outsized programs (gathers of
    per-slot rows, the bans' scatter, the draw) in loops over rows or blocks of rows. The values are
    the same either way; set it for TPU programs (see "Program size" in the module docstring)."""
    raw = logits.astype(jnp.float32)  # [B, V]
    x = _apply_bias(raw, batch.bias_ids, batch.bias_values)
    token, scaled = jax.lax.cond(_needs_more_than_argmax(batch),
                                 functools.partial(_process_and_draw, row_loops=row_loops), _argmax_only, x, batch)
    lp_logits = jnp.where(batch.processed_logprobs[:, None], scaled, raw)
    logprob, top_ids, top_logprobs = token_logprobs(lp_logits, token, batch.num_logprobs)
    return SampleOutput(token=token, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs)


def _needs_more_than_argmax(batch: SamplingBatch) -> Array:
    """Whether any row needs a step between the bias and the logprobs other than argmax: a grammar,
    a ban, a penalty or a draw (see "One branch point" in the module docstring)."""
    is_random = batch.temperature >= GREEDY_TEMPERATURE
    bans = jnp.any(batch.banned_ids >= 0, axis=-1)
    return jnp.any(batch.constrained | bans | _penalised(batch) | is_random)


def _argmax_only(x: Array, batch: SamplingBatch) -> tuple[Array, Array]:
    # Every row is greedy (temperature 1 for its processed logprobs, and x / 1 == x exactly), with
    # nothing banned, masked or penalised: _process_and_draw would return these very values.
    return _argmax(x), x


def _process_and_draw(x: Array, batch: SamplingBatch, row_loops: bool) -> tuple[Array, Array]:
    """The token and the temperature-scaled logits, for a batch where some row needs more than
    argmax; each stage still runs only when some row uses it."""
    x = jax.lax.cond(jnp.any(batch.constrained), functools.partial(_apply_grammar, row_loops=row_loops),
                     lambda v, _: v, x, batch)
    x = _apply_bans(x, batch.banned_ids, row_loops)
    x = _apply_penalties(x, batch, row_loops)

    is_random = batch.temperature >= GREEDY_TEMPERATURE  # [B]
    temperature = jnp.where(is_random, batch.temperature, 1.0)
    scaled = x / temperature[:, None]  # [B, V]; also the processed-logprob distribution
    # Materialise once: left to itself XLA:CPU fuses the bias/ban/penalty/temperature chain into
    # each of the reductions that read it (argmax, logsumexp, filters), which made the whole
    # sampler about twice as slow.
    scaled = jax.lax.optimization_barrier(scaled)

    greedy_token = _argmax(scaled)
    # Filtering and drawing are the expensive parts; an all-greedy batch skips both.
    token = jax.lax.cond(
        jnp.any(is_random),
        lambda: jnp.where(is_random, _draw(scaled, batch, is_random, greedy_token, row_loops), greedy_token),
        lambda: greedy_token,
    )
    return token, scaled


def _padding_to_vocab(ids: Array, vocab_size: int) -> Array:
    # Negative indices wrap in jnp scatters (-1 would hit token V-1). Ids from V up are out of range
    # and mode="drop" discards them, which makes padding a no-op; each padding column gets its own
    # (V + column), so the indices stay unique and the scatters may say so (see _scatter_rows).
    column = jnp.arange(ids.shape[-1], dtype=ids.dtype)
    return jnp.where(ids < 0, vocab_size + column, ids)


def _scatter_rows(x: Array, ids: Array) -> Any:
    """x.at[row, ids[row, j]] for every row of ids [R, N]; the caller declares the indices unique.

    The promise keeps these scatters small on TPU (without it XLA:TPU emits code for colliding
    updates), and it holds: logit_bias ids are a dict's keys, padding is distinct
    (_padding_to_vocab), and the only repeats a ban list can hold (a bad word that is also an end
    id) write the same -inf, which no order of the writes can change."""
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    return x.at[rows, ids]


def _apply_bias(x: Array, bias_ids: Array, bias_values: Array) -> Array:
    ids = _padding_to_vocab(bias_ids, x.shape[-1])
    return _scatter_rows(x, ids).add(bias_values.astype(x.dtype), mode="drop", unique_indices=True)


def _slot_rows(row_loops: bool, slots: Array, *tables: Array) -> tuple[Array, ...]:
    """table[slots] for each per-slot table [slots, N]; with row_loops one row copy at a time.

    XLA:TPU compiles a gather of whole vocabulary-wide rows into a large program: the penalty
    state's two gathers were 41k instruction bundles at 64 rows over a 128k vocabulary, a loop of
    row copies 7k, and it moves the same bytes. Elsewhere the gather is the smaller program."""

    if row_loops:
        return jax.lax.map(lambda slot: tuple(t[slot] for t in tables), slots)
    return tuple(t[slots] for t in tables)


def _apply_grammar(x: Array, batch: SamplingBatch, row_loops: bool) -> Array:
    rows, vocab_size = x.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)
    (words,) = _slot_rows(row_loops, batch.slots, batch.allowed)
    bits = (words[:, :, None] >> shifts) & jnp.uint32(1)  # [B, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab_size].astype(bool)
    return jnp.where(batch.constrained[:, None] & ~allowed, _NEG_INF, x)


def _apply_bans(x: Array, banned_ids: Array, row_loops: bool) -> Array:
    """Banned ids to -inf. A ban that leaves a row nothing finite is lifted for that row (see the
    module docstring). With row_loops one row at a time: XLA:TPU compiles the scatter of the whole batch
    into ~20k instruction bundles (2.5 s of every step's compile at 64 rows over a 128k vocabulary),
    a loop of one-row scatters into a quarter of that."""
    ids = _padding_to_vocab(banned_ids, x.shape[-1])

    def ban(x: Array, ids: Array) -> Array:
        banned = _scatter_rows(x, ids).set(_NEG_INF, mode="drop", unique_indices=True)
        return jnp.where(jnp.all(banned == _NEG_INF, axis=-1, keepdims=True), x, banned)

    if row_loops:
        return jax.lax.map(lambda row: ban(row[0][None], row[1][None])[0], (x, ids))
    return ban(x, ids)


def _penalised(batch: SamplingBatch) -> Array:
    return (batch.repetition_penalty != 1.0) | (batch.frequency_penalty != 0.0) | (batch.presence_penalty != 0.0)


def _apply_penalties(x: Array, batch: SamplingBatch, row_loops: bool) -> Array:
    return jax.lax.cond(jnp.any(_penalised(batch)), lambda v: _penalise(v, batch, row_loops), lambda v: v, x)


def _penalise(x: Array, batch: SamplingBatch, row_loops: bool) -> Array:
    counts, in_prompt = _slot_rows(row_loops, batch.slots, batch.counts, batch.prompt_mask)  # [B, V] each
    in_output = counts > 0

    rp = batch.repetition_penalty[:, None]
    repeated = jnp.where(x > 0, x / rp, x * rp)
    x = jnp.where(in_prompt | in_output, repeated, x)
    return (
        x
        - batch.frequency_penalty[:, None] * counts.astype(x.dtype)
        - batch.presence_penalty[:, None] * in_output.astype(x.dtype)
    )


def _draw(scaled: Array, batch: SamplingBatch, is_random: Array, fallback: Array, row_loops: bool) -> Array:
    """Sample from the min_p / top_k / top_p filtered, temperature-scaled logits.

    With row_loops, rows are drawn _DRAW_BLOCK at a time in a loop: rows never interact, and XLA:TPU
    compiles the filters and the Gumbel noise for a few rows into a much smaller program than for
    many (at a 128k vocabulary the draw of 64 rows at once was 56k instruction bundles and 7.3 s of
    every step's compile; in blocks of 8 it costs what 8 rows cost). The filters' "does any row need
    it" tests become per block, which only skips more work."""
    rows = scaled.shape[0]
    per_row = (scaled, batch.min_p, batch.top_k, batch.top_p, is_random, batch.seed, batch.step, fallback)
    if not row_loops or rows % _DRAW_BLOCK or rows == _DRAW_BLOCK:
        return _draw_rows(*per_row)

    blocks = [a.reshape(rows // _DRAW_BLOCK, _DRAW_BLOCK, *a.shape[1:]) for a in per_row]
    return jax.lax.map(lambda part: _draw_rows(*part), blocks).reshape(rows)


def _draw_rows(scaled: Array, min_p: Array, top_k: Array, top_p: Array, is_random: Array, seed: Array,
               step: Array, fallback: Array) -> Array:
    vocab_size = scaled.shape[-1]
    x = _apply_min_p(scaled, min_p)
    # Greedy rows never need filtering (the argmax always survives it), so they don't trigger it.
    k_active = is_random & (top_k > 0) & (top_k < vocab_size)
    x = jax.lax.cond(
        jnp.any(k_active),
        lambda v: _apply_top_k(v, jnp.where(k_active, top_k, vocab_size)),
        lambda v: v,
        x,
    )
    p_active = is_random & (top_p < 1.0)
    x = jax.lax.cond(jnp.any(p_active), lambda v: _apply_top_p(v, top_p, p_active), lambda v: v, x)
    return _gumbel_max(x, seed, step, fallback)


def _row_key(seed: Array, step: Array) -> Array:
    # One key per row, derived from nothing but the row's own seed and step: that is what makes a
    # draw independent of the batch it lands in and identical when a preempted request is redone.
    # Threefry is pinned because the "rbg" implementations give different bits under vmap.
    key = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), step)
    return jax.random.bits(key, (2,), jnp.uint32)


def _mix32(h: Array) -> Array:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 in which every input bit flips each
    output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _gumbel_noise(seed: Array, step: Array, vocab_size: int) -> Array:
    """[B, V] standard Gumbel noise: threefry gives each row a 64-bit key (B threefry calls, not
    B * V), and each token's bits are its id hashed under that key (two finaliser rounds, the
    second keyed by the key's other word so rows are not shifted copies of one sequence). With
    threefry for every token the sampler took 16.4 ms a step for 16 sampled rows on 2 CPU cores;
    with the hash 4.5 ms (benchmarks/RESULTS.md). 24 bits per uniform, centred in its interval: u in [2^-25, 1 - 2^-25],
    noise in [-2.85, 17.3], the range of a float32 uniform's Gumbel."""
    words = jax.vmap(_row_key)(seed, step)  # [B, 2]
    ids = jnp.arange(vocab_size, dtype=jnp.uint32)[None, :]
    bits = _mix32(_mix32(ids ^ words[:, :1]) + words[:, 1:])
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))
    return -jnp.log(-jnp.log(u))


def _gumbel_max(x: Array, seed: Array, step: Array, fallback: Array) -> Array:
    """argmax(x + Gumbel noise): an exact sample from softmax(x), filtered tokens (-inf) excluded.

    Gumbel-max rather than one uniform against the CDF (cheaper on the CPU): the same request's
    logits differ in the last bits between batch shapes (XLA sums in a shape-dependent order), and
    a CDF over the whole vocabulary turns such differences into a different token whenever the
    uniform lands in the long tail; argmax only flips on a near-exact tie between the top two.

    The perturbed logits are materialised once, then searched by _argmax's two reductions: fused
    into jnp.argmax's (value, index) reduction, the noise ran in XLA:CPU's scalar reduction loop,
    2-3x slower than computing it on its own.
    """
    perturbed = jax.lax.optimization_barrier(x + _gumbel_noise(seed, step, x.shape[-1]))
    return jnp.where(jnp.isfinite(jnp.max(x, axis=-1)), _argmax(perturbed), fallback)


def _apply_min_p(x: Array, min_p: Array) -> Array:
    # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p): no softmax needed; min_p = 0 gives
    # -inf, which keeps everything.
    threshold = jnp.max(x, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(x >= threshold, x, _NEG_INF)


def _apply_top_k(x: Array, k: Array) -> Array:
    """Keep the tokens whose value is >= the k-th largest (k = V keeps everything)."""
    keys = _sortable_keys(x)
    kth = _largest_threshold(keys, lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) >= k[:, None])
    return jnp.where(keys >= kth, x, _NEG_INF)


def _apply_top_p(x: Array, top_p: Array, active: Array) -> Array:
    """Keep the smallest set of highest tokens whose mass under softmax(x) reaches top_p.

    x arrives already top-k filtered, so the nucleus is taken from the renormalised top-k
    distribution, as vLLM does.
    """
    keys = _sortable_keys(x)
    probs = jax.nn.softmax(x, axis=-1)

    def mass_reaches_p(t: Array) -> Array:
        return jnp.sum(jnp.where(keys >= t, probs, 0.0), axis=-1, keepdims=True) >= top_p[:, None]

    # top_p >= 1 is off outright: float rounding can leave the total mass a hair below 1.
    keep = (keys >= _largest_threshold(keys, mass_reaches_p)) | ~active[:, None]
    return jnp.where(keep, x, _NEG_INF)


def _sortable_keys(x: Array) -> Array:
    """uint32 keys ordered exactly as the float32 values (-0.0 and +0.0 share one)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    sign = jnp.uint32(0x80000000)
    return jnp.where(bits >= sign, ~bits, bits | sign)


def _largest_threshold(keys: Array, holds: Callable[[Array], Array]) -> Array:
    """The largest key t [B, 1] for which holds(t) is true, for a predicate true at the row's
    smallest key and monotone (true below some point, false above).

    A bisection over the 32-bit keys: exact after 32 passes over [B, V], with no sort. XLA's sort of
    a 50k-token vocabulary costs ~100 ms per batch on a 2-core CPU; these passes cost a few.
    Because the thresholds are values, tokens tied at the boundary are kept or dropped together.
    """
    lo = jnp.min(keys, axis=-1, keepdims=True)  # holds
    hi = jnp.max(keys, axis=-1, keepdims=True) + 1  # the predicate is false past the largest key

    def halve(_: int, bounds: tuple[Array, Array]) -> tuple[Array, Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def _first_index(mask: Array) -> Array:
    """Index of the first True per row, V where there is none."""
    vocab_size = mask.shape[-1]
    return jnp.min(jnp.where(mask, jnp.arange(vocab_size, dtype=jnp.int32), vocab_size), axis=-1)


def _argmax(x: Array) -> Array:
    # A max and a first-index search run several times faster on XLA:CPU than argmax's variadic
    # (value, index) reduction. The clip keeps a NaN row's token in range.
    first = _first_index(x == jnp.max(x, axis=-1, keepdims=True))
    return jnp.minimum(first, x.shape[-1] - 1)


def token_logprobs(lp_logits: Array, token: Array, num_logprobs: Array) -> tuple[Array, Array, Array]:
    """Chosen-token logprob and top-N of log_softmax(lp_logits), without materialising it."""
    batch_size, vocab_size = lp_logits.shape
    lse = jax.nn.logsumexp(lp_logits, axis=-1)  # [B]
    chosen = jnp.take_along_axis(lp_logits, token[:, None], axis=-1)[:, 0] - lse

    def top_n() -> tuple[Array, Array]:
        # log_softmax is a per-row shift, so top-k of the logits is top-k of the logprobs.
        k = min(MAX_TOP_LOGPROBS, vocab_size)
        values, ids = jax.lax.top_k(lp_logits, k)
        pad = MAX_TOP_LOGPROBS - k
        values = jnp.pad(values - lse[:, None], ((0, 0), (0, pad)), constant_values=_NEG_INF)
        ids = jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
        wanted = jnp.arange(MAX_TOP_LOGPROBS)[None, :] < num_logprobs[:, None]
        return jnp.where(wanted, ids, -1), jnp.where(wanted, values, _NEG_INF)

    def no_top_n() -> tuple[Array, Array]:
        shape = (batch_size, MAX_TOP_LOGPROBS)
        return jnp.full(shape, -1, jnp.int32), jnp.full(shape, _NEG_INF, jnp.float32)

    top_ids, top_logprobs = jax.lax.cond(jnp.any(num_logprobs > 0), top_n, no_top_n)
    return chosen, top_ids, top_logprobs


# ----------------------------------------------------------------------------- tests' builder


def make_sampling_batch(
    rows: Sequence[RowParams],
    vocab_size: int,
    batch_size: int,
    output_tokens: Sequence[Sequence[int]] = (),
    prompt_tokens: Sequence[Sequence[int]] = (),
    steps: Sequence[int] = (),
    allowed_masks: Sequence[np.ndarray | None] = (),
) -> SamplingBatch:
    """A NumPy `SamplingBatch` of `rows` padded to `batch_size`, each row its own slot, with the
    penalty state the engine keeps on the device computed here from each row's token history
    (output_tokens[i], prompt_tokens[i]), the sampling step of each row (steps[i], default 0)
    and its grammar mask (allowed_masks[i]: u32[ceil(V / 32)], or None). Padding rows are greedy
    with no logprobs."""
    packed = pack_rows(rows, batch_size, vocab_size)
    counts = np.zeros((batch_size, vocab_size), np.int32)
    prompt_mask = np.zeros((batch_size, vocab_size), bool)
    for i, ids in enumerate(output_tokens):
        np.add.at(counts[i], np.asarray(ids, np.int64), 1)
    for i, ids in enumerate(prompt_tokens):
        prompt_mask[i, np.asarray(ids, np.int64)] = True
    words = mask_words(vocab_size)
    allowed = np.zeros((batch_size, words), np.uint32)
    constrained = np.zeros(batch_size, bool)
    for i, mask in enumerate(allowed_masks):
        if mask is not None:
            if mask.shape != (words,):
                raise ValueError(f"row {i}: allowed_mask has shape {mask.shape}, expected ({words},)")
            allowed[i], constrained[i] = mask, True
    step = np.zeros(batch_size, np.int32)
    step[: len(steps)] = steps
    return SamplingBatch(
        temperature=packed["temperature"], top_k=packed["top_k"], top_p=packed["top_p"], min_p=packed["min_p"],
        frequency_penalty=packed["frequency_penalty"], presence_penalty=packed["presence_penalty"],
        repetition_penalty=packed["repetition_penalty"], bias_ids=packed["bias_ids"],
        bias_values=packed["bias_values"], banned_ids=packed["banned_ids"], seed=packed["seed"], step=step,
        num_logprobs=packed["num_logprobs"], processed_logprobs=packed["processed_logprobs"],
        constrained=constrained, slots=np.arange(batch_size, dtype=np.int32), counts=counts,
        prompt_mask=prompt_mask, allowed=allowed,
    )
