"""vLLM's `allowed_token_ids`: every sampled token is one of a fixed set.

A grammar around the request's own constraint (or none): its mask is the inner grammar's, AND the
set's. It rides the structured-output path (a mask uploaded per step), so such a request is a
constrained row like any other. Alone, an end-of-sequence token ends the output only if it is in
the set (and then as any EOS does: ignore_eos and min_tokens hold), as in vLLM. With a constraint,
where the constraint is complete and the set allows nothing it allows, the output may end: a
finished match is not made an error by a set without an end token.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jaxserve.structured.matcher import Grammar, Matcher


class AllowedTokensGrammar:
    kind = "allowed_token_ids"

    def __init__(self, inner: Grammar | None, allowed: Iterable[int], vocab_size: int, eos_ids: Iterable[int] = ()):
        self.inner = inner
        self.eos_ids = tuple(eos_ids)
        ids = np.fromiter(set(allowed), dtype=np.int64)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"allowed token ids must be a non-empty set in [0, {vocab_size})")
        self.allowed = frozenset(int(i) for i in ids)
        self.mask = np.zeros((vocab_size + 31) // 32, np.uint32)
        np.bitwise_or.at(self.mask, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        self.nbytes = self.mask.nbytes + (inner.nbytes if inner is not None else 0)

    def matcher(self) -> "AllowedTokensMatcher":
        return AllowedTokensMatcher(self)


class AllowedTokensMatcher:
    def __init__(self, grammar: AllowedTokensGrammar):
        self.g = grammar
        self.inner: Matcher | None = grammar.inner.matcher() if grammar.inner is not None else None
        self.empty = False  # the inner grammar allowed none of the set at the last mask

    def fill_mask(self, out: np.ndarray) -> None:
        words = self.g.mask.size
        if self.inner is None:
            out.fill(0)
            out[:words] = self.g.mask
            return
        self.inner.fill_mask(out)
        ends = [e for e in self.g.eos_ids if out[e >> 5] >> np.uint32(e & 31) & 1]  # the constraint may end here
        out[:words] &= self.g.mask
        out[words:] = 0
        self.empty = not out.any()
        if self.empty and ends:
            for e in ends:
                out[e >> 5] |= np.uint32(1 << (e & 31))
            self.empty = False

    def advance(self, token: int) -> bool:
        if token not in self.g.allowed:
            return False
        return self.inner.advance(token) if self.inner is not None else True

    def is_accepting(self) -> bool:
        # Alone: never "complete", so a sampled EOS (one in the set) meets the usual EOS rules
        # (ignore_eos, min_tokens) rather than ending the output as a finished match would.
        return self.inner.is_accepting() if self.inner is not None else False

    def error(self) -> str | None:
        if self.inner is not None and (why := self.inner.error()) is not None:
            return why
        return "allowed_token_ids: the output's constraint allows none of these tokens here" if self.empty else None
