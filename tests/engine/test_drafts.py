"""Prompt-lookup drafts (jaxserve.engine.ngram) against a brute-force search, and which sampled tokens
a verify step keeps (jaxserve.engine.programs.kept_tokens)."""

from __future__ import annotations

import numpy as np

from jaxserve.engine.ngram import NgramDrafter


def brute_force(tokens: list[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest matching suffix n-gram, as if
    the sequence went on repeating from there."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # an occurrence followed by a token
            if tokens[start:start + n] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[len(tokens):]
    return []


def test_copies_what_followed_the_last_occurrence():
    d = NgramDrafter(3)
    d.sync([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert d.propose(2) == [4, 5]
    assert d.propose(10) == [4, 5, 9, 1, 2, 3, 4, 5, 9, 1]  # past the end: the repeat continues
    d.sync([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 7, 1, 2, 3])
    assert d.propose(1) == [7]  # the latest occurrence wins
    run = NgramDrafter(2)
    run.sync([5, 7, 7, 7])
    assert run.propose(4) == [7, 7, 7, 7]
    alternating = NgramDrafter(2)
    alternating.sync([1, 2, 1, 2, 1])
    assert alternating.propose(5) == [2, 1, 2, 1, 2]
    assert NgramDrafter(3).propose(4) == []
    fresh = NgramDrafter(2)
    fresh.sync([5, 6, 7])
    assert fresh.propose(3) == []  # nothing repeats; the suffix never matches itself
    assert fresh.propose(0) == []


def test_longest_match_first_and_min_size():
    tokens = [1, 5, 7, 2, 3, 6, 3, 1, 2, 3]  # "2 3" was followed by 6; "3" alone, latest, by 1
    d = NgramDrafter(3)
    d.sync(tokens)
    assert d.propose(1) == [6]
    only_long = NgramDrafter(3, min_ngram_size=3)
    only_long.sync(tokens)
    assert only_long.propose(1) == []


def test_incremental_equals_brute_force_and_survives_cut_back():
    rng = np.random.default_rng(0)
    for trial in range(30):
        tokens = rng.integers(0, 6, 80).tolist()
        max_n = int(rng.integers(1, 5))
        d = NgramDrafter(max_n)
        for end in range(1, len(tokens) + 1, int(rng.integers(1, 4))):
            d.sync(tokens[:end])
            assert d.propose(5) == brute_force(tokens[:end], 5, max_n), (trial, end)
        d.sync(tokens[:20])  # a stop string cut the sequence back
        assert d.propose(5) == brute_force(tokens[:20], 5, max_n)


def test_a_verify_step_keeps_drafts_up_to_the_first_miss_or_end():
    import jax.numpy as jnp

    from jaxserve.engine.programs import kept_tokens

    # Rows: all drafts kept (+ bonus); a miss at position 1 followed by a "match" computed from the
    # wrong context (must not count); an end id inside the kept drafts; no drafts; a padding row.
    token = np.array([[5, 6, 7, 8], [5, 9, 7, 8], [5, 6, 7, 8], [4, 0, 0, 0], [0, 0, 0, 0]])
    draft = np.array([[5, 6, 7, -1], [5, 6, 7, -1], [5, 6, 7, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]])
    in_row = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    ends = np.zeros_like(in_row)
    ends[2, 1] = True  # token 6 ends row 2
    kept = np.asarray(kept_tokens(jnp.asarray(token), jnp.asarray(draft), jnp.asarray(in_row), jnp.asarray(ends)))
    assert kept.sum(axis=1).tolist() == [4, 2, 2, 1, 0]
    assert kept[1].tolist() == [True, True, False, False]


def test_llm_speculative_config_is_checked_before_anything_loads():
    import pytest

    from jaxserve import LLM

    for bad, message in (({"method": "eagle"}, "method must be 'ngram'"),
                         ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                         ({"method": "ngram", "draft_model": "x"}, "unknown keys")):
        with pytest.raises(ValueError, match=message):
            LLM(speculative_config=bad)
