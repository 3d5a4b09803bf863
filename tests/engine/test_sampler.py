"""The on-device sampler against NumPy references: exact tests for bias, bans, penalties and logprobs,
fixed-seed statistical tests (chi-square) for temperature, top-k, top-p and min-p.

Shapes are shared between tests so the whole file compiles the sampler only a handful of times.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2, gumbel_r, kstest

from jaxserve.engine.request import MAX_TOP_LOGPROBS
from jaxserve.engine.rows import MAX_BANNED_IDS, MAX_LOGIT_BIAS, RowParams
from jaxserve.engine.sampler import (
    SampleOutput,
    SamplingBatch,
    _apply_top_k,
    _apply_top_p,
    _gumbel_noise,
    _needs_more_than_argmax,
    make_sampling_batch,
    sample,
)

V = 64  # vocabulary of the small tests
B = 8  # batch of the small tests
NUM_DRAWS = 4000  # rows of the statistical tests (one row per step)
P_MIN = 1e-3  # chi-square p-value below which a distribution is rejected (seeds are fixed)

SAMPLE = jax.jit(sample)


def _logits(seed: int, rows: int = B, vocab: int = V, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Row:
    """A row's parameters and the state the engine keeps for it on the device: its token history
    (penalty counts and prompt mask), the step being sampled and its grammar mask."""

    params: RowParams
    output_tokens: tuple[int, ...] = ()
    prompt_tokens: tuple[int, ...] = ()
    step: int = 0
    allowed_mask: np.ndarray | None = None

    def __getattr__(self, name: str):  # the parameters read like a RowParams
        return getattr(self.params, name)


def make_row(*, output_tokens=(), prompt_tokens=(), step=0, allowed_mask=None, **params) -> Row:
    return Row(RowParams(**params, constrained=allowed_mask is not None), tuple(output_tokens), tuple(prompt_tokens),
               step, allowed_mask)


def replace(r: Row, **changes) -> Row:
    state = {k: changes.pop(k) for k in ("output_tokens", "prompt_tokens", "step", "allowed_mask") if k in changes}
    return dataclasses.replace(r, params=dataclasses.replace(r.params, **changes), **state)


def _batch(rows: list[Row], vocab: int, size: int) -> SamplingBatch:
    return make_sampling_batch([r.params for r in rows], vocab, size, [r.output_tokens for r in rows],
                               [r.prompt_tokens for r in rows], [r.step for r in rows],
                               [r.allowed_mask for r in rows])


def _run(logits: np.ndarray, rows: list[Row]) -> SampleOutput:
    return jax.tree.map(np.asarray, SAMPLE(jnp.asarray(logits), _batch(rows, logits.shape[-1], logits.shape[0])))


def _draw(logits_row: np.ndarray, r: Row, n: int = NUM_DRAWS) -> np.ndarray:
    """n draws of one request, one per step, made as one batch of n rows."""
    rows = [dataclasses.replace(r, step=i) for i in range(n)]
    return _run(np.tile(logits_row, (n, 1)), rows).token


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x[np.isfinite(x)].max()
    return x - m - np.log(np.exp(x - m).sum())


def _assert_distribution(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Support within probs > 0, and a chi-square goodness of fit over that support."""
    support = np.flatnonzero(probs > 0)
    assert set(np.unique(tokens)) <= set(support.tolist()), "sampled a token of probability 0"
    observed = np.bincount(tokens, minlength=len(probs))[support].astype(np.float64)
    expected = probs[support] / probs[support].sum() * len(tokens)
    # Chi-square wants >= 5 expected draws per cell: pool the rarest tokens into one cell.
    order = np.argsort(expected)
    num_pooled = 0
    while num_pooled < len(order) and (
        expected[order[num_pooled]] < 5 or 0 < expected[order[:num_pooled]].sum() < 5
    ):
        num_pooled += 1
    if num_pooled:
        pooled, rest = order[:num_pooled], order[num_pooled:]
        observed = np.append(observed[rest], observed[pooled].sum())
        expected = np.append(expected[rest], expected[pooled].sum())
    assert expected.min() >= 5, "test design: too few draws for a chi-square test"
    stat = ((observed - expected) ** 2 / expected).sum()
    assert chi2.sf(stat, len(expected) - 1) > P_MIN, (observed, expected.round(1))


def _keep_top_k(probs: np.ndarray, k: int) -> np.ndarray:
    kth = np.sort(probs)[::-1][k - 1]
    return np.where(probs >= kth, probs, 0.0)


def _keep_top_p(probs: np.ndarray, p: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")
    ranked = probs[order] / probs.sum()
    before = np.cumsum(ranked) - ranked
    threshold = ranked[before < p][-1]
    return np.where(probs / probs.sum() >= threshold, probs, 0.0)


def _np_processed(logits: np.ndarray, row: Row) -> np.ndarray:
    """NumPy (float64) reimplementation of bias -> bans -> penalties -> temperature."""
    x = logits.astype(np.float64).copy()
    for token, bias in row.logit_bias.items():
        x[token] += bias
    x[list(row.banned_ids)] = -np.inf
    counts = np.bincount(np.asarray(row.output_tokens, int), minlength=len(x))
    seen = counts > 0
    seen[list(row.prompt_tokens)] = True
    rp = row.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
    x = x - row.frequency_penalty * counts - row.presence_penalty * (counts > 0)
    return x / (row.temperature if row.temperature > 0 else 1.0)


# --------------------------------------------------------------------------- greedy, seeds, batches


def test_greedy_is_argmax_whatever_the_filters():
    logits = _logits(0)
    rows = [make_row(temperature=0.0, top_k=k, top_p=p, seed=i) for i, (k, p) in enumerate([(0, 1.0), (3, 0.5)] * 4)]
    out = _run(logits, rows)
    np.testing.assert_array_equal(out.token, logits.argmax(-1))


@pytest.mark.parametrize("neighbour", [
    make_row(temperature=0.7, seed=3),
    make_row(temperature=0.0, banned_ids=[5]),
    make_row(temperature=0.0, presence_penalty=0.5, output_tokens=[1]),
    make_row(temperature=0.0, allowed_mask=np.full(2, 0xFFFF, np.uint32)),
], ids=["draw", "ban", "penalty", "grammar"])
def test_argmax_only_rows_get_the_same_bits_from_either_branch(neighbour):
    # A batch of plain greedy rows takes the argmax-only branch; one neighbour needing more sends
    # the same rows through every stage. Their tokens and logprobs must not change by a bit.
    logits = _logits(16)
    logits[4, 7] = logits[4].max()  # a tie: the first index wins in both branches
    flags = [(-1, True), (0, False), (0, True), (-1, False), (0, False), (-1, True), (0, True)]
    plain = [make_row(temperature=0.0, num_logprobs=n, processed_logprobs=p, logit_bias={3: 4.0} if p else None)
             for n, p in flags]
    alone = _run(logits, plain)
    crowded = _run(logits, [*plain, neighbour])
    for field in ("token", "logprob", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(crowded, field)[:7], getattr(alone, field)[:7])
    biased = logits[:7] + 4.0 * np.array([p for _, p in flags])[:, None] * (np.arange(V) == 3)
    np.testing.assert_array_equal(alone.token[:7], biased.argmax(-1))
    assert (biased.argmax(-1) != logits[:7].argmax(-1)).sum() == 3  # the bias matters
    assert not _needs_more_than_argmax(_batch(plain, V, B))
    assert _needs_more_than_argmax(_batch([*plain, neighbour], V, B))


def test_a_batch_that_needs_only_argmax_passes_one_branch_point():
    # Each top-level cond is a host sync per token on XLA:GPU (see "One branch point"): everything
    # between the bias and the logprobs sits behind one, whose argmax-only branch holds no cond of
    # its own; the top-N logprobs keep theirs.
    batch = _batch([make_row(temperature=0.0)], V, B)
    jaxpr = jax.make_jaxpr(sample)(jnp.asarray(_logits(17)), batch).jaxpr
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 2
    argmax_only, everything = conds[0].params["branches"]
    assert not [e for e in argmax_only.jaxpr.eqns if e.primitive.name in ("cond", "while", "scatter-add", "scatter")]
    assert sum(e.primitive.name == "cond" for e in everything.jaxpr.eqns) == 3  # grammar, penalties, draw
    no_top_n, top_n = conds[1].params["branches"]
    assert any(e.primitive.name == "top_k" for e in top_n.jaxpr.eqns)


def test_seeded_row_is_independent_of_its_neighbours():
    logits = _logits(1)
    row = make_row(temperature=0.9, top_k=20, top_p=0.9, seed=1234, num_logprobs=3, processed_logprobs=True)
    neighbours = [
        make_row(temperature=0.0, num_logprobs=MAX_TOP_LOGPROBS),
        make_row(temperature=1.5, seed=7, frequency_penalty=1.0, output_tokens=[1, 2, 2]),
        make_row(temperature=0.5, min_p=0.3, repetition_penalty=1.3, prompt_tokens=[5, 6], seed=99),
        make_row(temperature=1.0, banned_ids=list(range(0, 16, 2)), logit_bias={3: 5.0}),
    ]
    alone, crowded = [], []
    for step in range(24):
        r = replace(row, step=step)
        alone.append(_run(logits[3:4], [r]))
        crowded.append(_run(logits, [*neighbours[:3], r, *neighbours[3:]]))
    alone_tokens = [o.token[0] for o in alone]
    assert [o.token[3] for o in crowded] == alone_tokens
    assert len(set(alone_tokens)) > 1, "the draw should vary with the step"
    for a, c in zip(alone, crowded):
        np.testing.assert_allclose(c.logprob[3], a.logprob[0], rtol=1e-6)
        np.testing.assert_array_equal(c.top_ids[3], a.top_ids[0])


def test_seed_and_step_change_the_draw_and_replay_is_identical():
    uniform = np.zeros((1, V), np.float32)

    def tokens(seed: int) -> list[int]:
        return [int(_run(uniform, [make_row(seed=seed, step=s)]).token[0]) for s in range(16)]

    first = tokens(5)
    assert len(set(first)) > 8  # 16 uniform draws out of 64 are rarely this repetitive
    assert tokens(5) == first  # a recomputed (preempted) request resamples identically
    assert tokens(6) != first
    assert tokens(5 + 2**32) == first  # seeds are reduced to 32 bits on the host


def test_the_noise_is_gumbel_and_independent_across_tokens_seeds_and_steps():
    """The draw's noise is a hash of the token id under the row's key, not threefry per token: its
    values must still be standard Gumbel, and no two neighbours (tokens, seeds, steps) correlated."""
    vocab = 4096
    seeds = jnp.asarray(np.repeat(np.arange(8), 8), jnp.uint32)  # 8 seeds x 8 consecutive steps
    steps = jnp.asarray(np.tile(np.arange(8), 8), jnp.int32)
    noise = np.asarray(jax.jit(_gumbel_noise, static_argnums=2)(seeds, steps, vocab), np.float64)
    assert noise.shape == (64, vocab) and np.isfinite(noise).all()
    assert kstest(noise.ravel(), gumbel_r.cdf).pvalue > P_MIN
    # Each correlation is over >= 229,000 pairs: a standard error of ~0.002, so 0.01 is 5 of them.
    assert abs(np.corrcoef(noise[:, :-1].ravel(), noise[:, 1:].ravel())[0, 1]) < 0.01  # token, token + 1
    same_seed = noise.reshape(8, 8, vocab)
    assert abs(np.corrcoef(same_seed[:, :-1].ravel(), same_seed[:, 1:].ravel())[0, 1]) < 0.01  # step, step + 1
    assert abs(np.corrcoef(same_seed[:-1].ravel(), same_seed[1:].ravel())[0, 1]) < 0.01  # seed, seed + 1
    # Uniform ranks in every row: the row's argmax lands anywhere (no token favoured).
    winners = noise.argmax(-1)
    assert len(set(winners.tolist())) > 60


# ----------------------------------------------------------------------------------- distributions


def test_temperature_scales_the_distribution():
    logits = _logits(2, rows=1)[0]
    for t in (0.5, 2.0):
        tokens = _draw(logits, make_row(temperature=t, seed=11))
        _assert_distribution(tokens, _softmax(logits / t))


def test_top_k_samples_the_renormalised_top_k():
    logits = _logits(3, rows=1, scale=0.5)[0]
    tokens = _draw(logits, make_row(temperature=1.0, top_k=7, seed=21))
    probs = _keep_top_k(_softmax(logits), 7)
    assert np.count_nonzero(probs) == 7
    _assert_distribution(tokens, probs)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    logits = _logits(4, rows=1)[0]
    tokens = _draw(logits, make_row(temperature=1.0, top_p=0.6, seed=31))
    probs = _keep_top_p(_softmax(logits), 0.6)
    kept = np.count_nonzero(probs)
    mass = np.sort(_softmax(logits))[::-1].cumsum()
    assert mass[kept - 1] >= 0.6 > mass[kept - 2]  # the nucleus is the smallest one reaching p
    _assert_distribution(tokens, probs)


@pytest.mark.parametrize("cut", [dict(top_p=0.55), dict(top_k=2)])
def test_ties_at_the_boundary_are_kept_together(cut):
    # Probabilities 0.4, then four tied at 0.1, then 0.2 spread thinly. top_p=0.55 needs the first
    # tied token and top_k=2 ends inside the tie; thresholds are values, so all four tied tokens
    # stay (nucleus mass 0.8, five tokens) whatever order a sort would have put them in.
    probs = np.full(V, 0.2 / (V - 5))
    probs[10] = 0.4
    probs[[3, 20, 40, 63]] = 0.1
    tokens = _draw(np.log(probs).astype(np.float32), make_row(temperature=1.0, seed=41, **cut))
    expected = np.zeros(V)
    expected[[10, 3, 20, 40, 63]] = [0.4, 0.1, 0.1, 0.1, 0.1]
    _assert_distribution(tokens, expected)


def test_filter_thresholds_equal_the_sort_based_definition():
    # The bisection against the textbook definition on rows full of ties, signed zeros and -inf.
    rng = np.random.default_rng(16)
    x = np.round(rng.standard_normal((32, V)) * 2, 1).astype(np.float32)
    x[:, :4] = [0.0, -0.0, -np.inf, -np.inf]
    top_k = rng.integers(1, V + 1, 32)
    # Row 0: the k-th value is a zero of either sign. Row 1: the top two are one ulp apart.
    x[:2, 4:] = np.minimum(x[:2, 4:], -0.5)
    x[0, 4], top_k[0] = 2.0, 2
    x[1, 4:6], top_k[1] = [4.0, np.nextafter(np.float32(4.0), np.float32(0))], 1
    kept_k = np.stack([row >= np.sort(row)[::-1][k - 1] for row, k in zip(x, top_k)])
    got_k = np.asarray(jax.jit(_apply_top_k)(x, jnp.asarray(top_k, jnp.int32))) > -np.inf
    np.testing.assert_array_equal(got_k, kept_k & (x > -np.inf))

    top_p = np.empty(32, np.float32)
    kept_p = np.empty_like(kept_k)
    for i, row in enumerate(x):
        probs = _softmax(row)
        ranked = np.sort(probs)[::-1]
        before = np.cumsum(ranked) - ranked
        j = rng.integers(1, 20)
        top_p[i] = (before[j] + before[j + 1]) / 2  # far from any boundary: float order can't matter
        kept_p[i] = probs >= ranked[before < top_p[i]][-1]
    got_p = jax.jit(_apply_top_p)(x, jnp.asarray(top_p), jnp.ones(32, bool))
    np.testing.assert_array_equal(np.asarray(got_p) > -np.inf, kept_p)


def test_top_p_applies_to_the_renormalised_top_k():
    logits = _logits(5, rows=1, scale=0.7)[0]
    tokens = _draw(logits, make_row(temperature=0.8, top_k=12, top_p=0.7, seed=51))
    probs = _keep_top_p(_keep_top_k(_softmax(logits / 0.8), 12), 0.7)
    assert 1 < np.count_nonzero(probs) < 12
    _assert_distribution(tokens, probs)


def test_min_p_drops_tokens_below_a_fraction_of_the_max():
    logits = _logits(6, rows=1)[0]
    tokens = _draw(logits, make_row(temperature=1.0, min_p=0.1, seed=61))
    full = _softmax(logits)
    probs = np.where(full >= 0.1 * full.max(), full, 0.0)
    assert 1 < np.count_nonzero(probs) < V
    _assert_distribution(tokens, probs)


# ------------------------------------------------------------------------ bias, bans and penalties


def _penalty_rows(logits: np.ndarray) -> list[Row]:
    # Histories drawn from each row's top tokens, so the penalised logits show up in the top-20.
    rng = np.random.default_rng(7)
    rows = []
    kinds = [
        dict(frequency_penalty=0.7),
        dict(presence_penalty=1.1),
        dict(frequency_penalty=-0.5, presence_penalty=0.4),
        dict(repetition_penalty=1.4),
        dict(repetition_penalty=0.8),
        dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, temperature=0.7),
        dict(logit_bias={0: 3.0, 5: -2.5, 63: 100.0}),
        dict(logit_bias={1: -100.0}, banned_ids=[2, 2, 9], repetition_penalty=1.5, temperature=1.3),
    ]
    for i, kind in enumerate(kinds):
        top = np.argsort(-logits[i])[:12]
        output = rng.choice(top, size=10).tolist()  # repeats => counts > 1
        prompt = rng.choice(top, size=6).tolist()
        params = dict(temperature=0.0, num_logprobs=MAX_TOP_LOGPROBS, processed_logprobs=True, seed=i)
        params.update(kind)
        rows.append(make_row(**params, output_tokens=output, prompt_tokens=prompt))
    return rows


def test_bias_bans_and_penalties_match_numpy_exactly():
    logits = _logits(8)
    rows = _penalty_rows(logits)
    out = _run(logits, rows)
    for i, row in enumerate(rows):
        expected = _log_softmax(_np_processed(logits[i], row))
        top = np.argsort(-expected, kind="stable")[:MAX_TOP_LOGPROBS]
        np.testing.assert_array_equal(out.top_ids[i], top, err_msg=f"row {i}: {row}")
        np.testing.assert_allclose(out.top_logprobs[i], expected[top], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
        if row.temperature == 0:
            assert out.token[i] == expected.argmax()
        np.testing.assert_allclose(out.logprob[i], expected[out.token[i]], rtol=1e-5, atol=1e-5)


def test_banned_ids_are_never_sampled():
    banned = [0, 7, 8, 9, 30, 63] + list(range(40, 42))
    logits = np.zeros(V, np.float32)
    logits[banned] = 5.0  # the banned tokens would otherwise dominate
    tokens = _draw(logits, make_row(temperature=1.0, banned_ids=banned, seed=71), n=NUM_DRAWS)
    probs = np.where(np.isin(np.arange(V), banned), 0.0, 1.0)
    _assert_distribution(tokens, probs)
    greedy = _run(logits[None], [make_row(temperature=0.0, banned_ids=banned, logit_bias={3: 1.0})])
    assert greedy.token[0] == 3


def test_a_row_with_everything_banned_ignores_the_ban_and_stays_finite():
    # Only eight tokens are finite (say the model masks the rest) and the host bans all eight:
    # nothing is left, so the ban is lifted for that row instead of producing NaN.
    logits = np.full((B, V), -np.inf, np.float32)
    finite = [2, 5, 11, 17, 23, 31, 47, 60]
    logits[:, finite] = _logits(10)[:, :8]
    rows = [
        make_row(temperature=0.0, banned_ids=finite, num_logprobs=3, processed_logprobs=True),
        make_row(temperature=1.0, banned_ids=finite, num_logprobs=3, seed=3),
        make_row(temperature=0.0, banned_ids=finite[:7]),  # one token left: the ban holds
    ]
    out = _run(logits, rows)
    assert out.token[0] == logits[0].argmax()
    assert out.token[1] in finite
    assert out.token[2] == finite[7]
    assert np.isfinite(out.logprob[:2]).all() and np.isfinite(out.top_logprobs[:2, :3]).all()
    np.testing.assert_allclose(out.logprob[0], _log_softmax(logits[0])[out.token[0]], rtol=1e-5)


def _packed(tokens: list[int], vocab: int = V) -> np.ndarray:
    bits = np.zeros(((vocab + 31) // 32) * 32, np.uint8)
    bits[tokens] = 1
    return np.packbits(bits, bitorder="little").view(np.uint32)


def test_grammar_mask_limits_constrained_rows_only():
    allowed = [1, 33, 62]  # across words 0 and 1
    logits = np.zeros(V, np.float32)
    logits[[0, 5, 40]] = 8.0  # strongly preferred, but outside the grammar
    tokens = _draw(logits, make_row(temperature=1.0, seed=5, allowed_mask=_packed(allowed)), n=NUM_DRAWS)
    _assert_distribution(tokens, np.isin(np.arange(V), allowed).astype(float))
    rows = [make_row(temperature=0.0, allowed_mask=_packed(allowed), num_logprobs=2),
            make_row(temperature=0.0, num_logprobs=2)]  # unconstrained neighbour: untouched
    out = _run(np.stack([logits, logits] + [logits] * (B - 2)), rows)
    assert out.token[0] in allowed and out.token[1] in (0, 5, 40)
    # Logprobs stay those of the model's raw distribution (vLLM's default), grammar or not.
    np.testing.assert_allclose(out.logprob[0], _log_softmax(logits)[out.token[0]], rtol=1e-5)


def test_bans_give_way_to_the_grammar_never_the_reverse():
    logits = _logits(12)[0]
    grammar = [3, 9]
    rows = [
        make_row(temperature=0.0, allowed_mask=_packed(grammar), banned_ids=[3]),  # 9 is left
        make_row(temperature=1.0, seed=2, allowed_mask=_packed(grammar), banned_ids=[3, 9]),  # nothing left
        make_row(temperature=0.0, allowed_mask=_packed([7]), logit_bias={7: -100.0}),  # bias cannot escape
    ]
    out = _run(np.tile(logits, (B, 1)), rows)
    assert out.token[0] == 9
    assert out.token[1] in grammar
    assert out.token[2] == 7


def test_grammar_mask_shape_is_checked():
    with pytest.raises(ValueError, match="allowed_mask has shape"):
        make_sampling_batch([RowParams(constrained=True)], V, 1, allowed_masks=[np.zeros(3, np.uint32)])


def test_row_loops_sample_exactly_what_the_batch_forms_do():
    """The TPU programs' loop forms (row_loops) against the batch-wide forms every other test checks:
    the same tokens and logprobs, bit for bit, for rows of every kind, over 3 blocks of the draw and
    with slots in another order than the rows (the per-slot state is read through `slots`)."""
    rows_n = 24
    logits = _logits(14, rows=rows_n)
    logits[5, 8:] = -np.inf  # row 5: the ban below leaves nothing finite, so it is lifted
    kinds = [
        make_row(temperature=0.0, num_logprobs=3),
        make_row(temperature=0.8, seed=1, top_k=5, num_logprobs=2, processed_logprobs=True),
        make_row(temperature=1.0, seed=2, top_p=0.7, min_p=0.05),
        make_row(temperature=1.2, seed=3, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4,
                 output_tokens=[1, 2, 2, 9], prompt_tokens=[4, 9, 30]),
        make_row(temperature=0.0, logit_bias={7: 4.0, 50: -3.0}, banned_ids=[0, 7, 63]),
        make_row(temperature=1.0, seed=4, banned_ids=list(range(8))),
        make_row(temperature=0.7, seed=5, allowed_mask=_packed([3, 9, 40]), banned_ids=[9]),
        make_row(temperature=0.0, allowed_mask=_packed([12, 13]), repetition_penalty=2.0, prompt_tokens=[12]),
    ]
    rows = [replace(kinds[i % len(kinds)], step=i) for i in range(rows_n)]
    batch = _batch(rows, V, rows_n)
    slots = np.random.default_rng(0).permutation(rows_n).astype(np.int32)  # row i reads slot slots[i]
    per_slot = {}
    for name in ("counts", "prompt_mask", "allowed"):
        table = getattr(batch, name)
        moved = np.zeros_like(table)
        moved[slots] = table
        per_slot[name] = moved
    batch = batch.replace(slots=slots, **per_slot)

    loops = jax.jit(lambda x, b: sample(x, b, row_loops=True))(jnp.asarray(logits), batch)
    plain = SAMPLE(jnp.asarray(logits), batch)
    for field in ("token", "logprob", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(loops, field)), np.asarray(getattr(plain, field)), field)
    # and the batch forms read the moved state correctly: same as the rows in their own slots
    np.testing.assert_array_equal(np.asarray(plain.token), _run(logits, rows).token)
    assert np.asarray(plain.token)[5] < 8 and np.isfinite(np.asarray(plain.logprob)).all()


# ---------------------------------------------------------------------------------------- logprobs


def test_logprobs_raw_processed_and_top_n():
    logits = _logits(11)
    row = make_row(temperature=0.6, logit_bias={4: 2.0}, frequency_penalty=0.5, output_tokens=[4, 4, 9], seed=5)
    rows = [
        replace(row, num_logprobs=5, processed_logprobs=False),
        replace(row, num_logprobs=5, processed_logprobs=True),
        replace(row, num_logprobs=0),
        replace(row, num_logprobs=-1),
        replace(row, num_logprobs=MAX_TOP_LOGPROBS, temperature=0.0, processed_logprobs=True),
    ]
    out = _run(logits, rows)
    for i, r in enumerate(rows):
        source = _np_processed(logits[i], r) if r.processed_logprobs else logits[i]
        expected = _log_softmax(source)
        np.testing.assert_allclose(out.logprob[i], expected[out.token[i]], rtol=1e-5, atol=1e-6)
        n = max(r.num_logprobs, 0)
        top = np.argsort(-expected)[:n]
        np.testing.assert_array_equal(out.top_ids[i, :n], top)
        np.testing.assert_allclose(out.top_logprobs[i, :n], expected[top], rtol=1e-5, atol=1e-6)
        assert np.all(np.diff(out.top_logprobs[i, :n]) <= 0)
        assert (out.top_ids[i, n:] == -1).all() and np.isneginf(out.top_logprobs[i, n:]).all()


def test_no_row_asks_for_top_n():
    out = _run(_logits(12), [make_row(num_logprobs=0, seed=s) for s in range(B)])
    assert (out.top_ids == -1).all() and np.isneginf(out.top_logprobs).all()
    assert np.isfinite(out.logprob).all()


# ------------------------------------------------------------------------------ padding, compiling


def test_padding_rows_are_harmless_even_with_nan_logits():
    logits = _logits(13)
    rows = [
        make_row(temperature=1.0, top_p=0.8, seed=1, num_logprobs=4),
        make_row(temperature=0.0, repetition_penalty=1.3, output_tokens=[3], prompt_tokens=[1]),
        make_row(temperature=0.7, top_k=5, seed=2, num_logprobs=2, processed_logprobs=True),
    ]
    clean = _run(logits, rows)
    dirty_logits = logits.copy()
    dirty_logits[len(rows):] = np.nan  # whatever the model produced for padding rows
    dirty = _run(dirty_logits, rows)
    for field in ("token", "logprob", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(dirty, field)[: len(rows)], getattr(clean, field)[: len(rows)])
    np.testing.assert_array_equal(clean.token[len(rows):], logits[len(rows):].argmax(-1))  # greedy
    assert (clean.top_ids[len(rows):] == -1).all()


def test_builder_pads_and_validates():
    batch = _batch([make_row(seed=-1, logit_bias={3: 1.5}, banned_ids=[4], output_tokens=[1, 2, 2], prompt_tokens=[5],
                        frequency_penalty=0.1)], V, 4)
    assert isinstance(batch, SamplingBatch)
    assert batch.seed[0] == 2**32 - 1 and batch.seed.dtype == np.uint32
    np.testing.assert_array_equal(np.nonzero(batch.counts[0])[0], [1, 2])
    assert batch.counts[0, 2] == 2 and batch.prompt_mask[0].sum() == 1 and batch.prompt_mask[0, 5]
    np.testing.assert_array_equal(batch.bias_ids[0, :2], [3, -1])
    np.testing.assert_array_equal(batch.slots, np.arange(4))
    assert (batch.temperature[1:] == 0).all() and (batch.num_logprobs[1:] == -1).all()
    big = MAX_LOGIT_BIAS + MAX_BANNED_IDS  # a vocabulary where only the widths are too small
    bad = [
        ([RowParams()] * 3, V, 2),
        ([RowParams(num_logprobs=MAX_TOP_LOGPROBS + 1)], V, B),
        ([RowParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})], big, B),
        ([RowParams(banned_ids=[V])], V, B),
        ([RowParams(banned_ids=list(range(MAX_BANNED_IDS + 1)))], big, B),
        ([RowParams(end_ids=[-3])], V, B),
    ]
    for rows, vocab, size in bad:
        with pytest.raises(ValueError):
            make_sampling_batch(rows, vocab, size)


def test_parameter_values_do_not_recompile():
    logits = jnp.asarray(_logits(14))
    variants = [
        [make_row()] * B,
        [make_row(temperature=0.0, num_logprobs=5)] * B,
        _penalty_rows(_logits(14)),
        [make_row(top_k=3, top_p=0.5, min_p=0.2, seed=s, step=s) for s in range(B)],
        [make_row(temperature=0.3, logit_bias={1: 2.0}, banned_ids=[4], seed=2**32 - 1)] * 3,
    ]
    compiled = None
    for rows in variants:
        SAMPLE(logits, _batch(rows, V, B)).token.block_until_ready()
        # The jit cache also holds the other tests' shapes: count from after the first call.
        compiled = compiled or SAMPLE._cache_size()
        assert SAMPLE._cache_size() == compiled


def test_full_size_vocab_in_bfloat16():
    vocab = 49152
    logits = np.asarray(jnp.asarray(_logits(15, rows=2, vocab=vocab, scale=3.0), jnp.bfloat16).astype(jnp.float32))
    best = int(logits[0].argmax())
    rows = [
        make_row(temperature=0.0, banned_ids=[best], num_logprobs=MAX_TOP_LOGPROBS),
        make_row(temperature=0.8, top_p=0.9, top_k=50, seed=9, num_logprobs=2, processed_logprobs=True),
    ]
    out = jax.tree.map(np.asarray, SAMPLE(jnp.asarray(logits, jnp.bfloat16), _batch(rows, vocab, 2)))
    unbanned = logits[0].copy()
    unbanned[best] = -np.inf
    assert out.token[0] == unbanned.argmax()  # bfloat16 ties: the first of the tied maxima
    assert logits[1, out.token[1]] >= np.sort(logits[1])[::-1][49]  # within the top 50 (ties included)
    raw = np.sort(_log_softmax(logits[0]))[::-1][:MAX_TOP_LOGPROBS]  # raw logprobs ignore the ban
    np.testing.assert_allclose(out.top_logprobs[0], raw, rtol=1e-5, atol=1e-5)
