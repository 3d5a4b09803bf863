"""vLLM's allowed_token_ids as a mask grammar (jaxserve.structured.allowed_tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.structured.allowed_tokens import AllowedTokensGrammar


def _allowed(mask: np.ndarray) -> list[int]:
    return [t for t in range(mask.size * 32) if mask[t >> 5] >> (t & 31) & 1]


class _Only:
    """An inner grammar allowing a fixed set, accepting after one token."""

    nbytes = 0

    def __init__(self, ids):
        self.ids = ids

    def matcher(self):
        outer = self

        class M:
            steps = 0

            def fill_mask(self, out):
                out.fill(0)
                for t in outer.ids:
                    out[t >> 5] |= np.uint32(1 << (t & 31))

            def advance(self, token):
                self.steps += 1
                return token in outer.ids

            def is_accepting(self):
                return self.steps > 0

            def error(self):
                return None

        return M()


def test_alone_it_allows_exactly_the_set():
    m = AllowedTokensGrammar(None, [3, 40, 40, 99], vocab_size=100).matcher()
    out = np.full(5, 0xFFFFFFFF, np.uint32)  # a padded mask: words past the vocabulary stay closed
    m.fill_mask(out)
    assert _allowed(out) == [3, 40, 99]
    # Never "complete" alone: a listed EOS ends the output by the usual EOS rules (ignore_eos, min_tokens).
    assert m.advance(40) and not m.advance(41) and not m.is_accepting() and m.error() is None


def test_with_a_grammar_it_is_the_intersection():
    m = AllowedTokensGrammar(_Only({3, 7}), [7, 9], vocab_size=64).matcher()
    out = np.zeros(2, np.uint32)
    m.fill_mask(out)
    assert _allowed(out) == [7] and not m.is_accepting()
    assert m.advance(7) and m.is_accepting()
    disjoint = AllowedTokensGrammar(_Only({3}), [9], vocab_size=64).matcher()
    disjoint.fill_mask(out)
    assert not out.any() and "allows none of these tokens" in disjoint.error()
    # A complete match may end although the set lists no end token: EOS (2) is let through.
    done = AllowedTokensGrammar(_Only({2, 3}), [9], vocab_size=64, eos_ids=[2]).matcher()
    done.fill_mask(out)
    assert _allowed(out) == [2] and done.error() is None


@pytest.mark.parametrize("ids", [[], [-1], [64]])
def test_ids_outside_the_vocabulary_are_refused(ids):
    with pytest.raises(ValueError):
        AllowedTokensGrammar(None, ids, vocab_size=64)
