"""Compiled grammars and the per-sequence matchers that walk them.

A `Grammar` is shared by every request with the same constraint (it lives in the compiler's LRU);
each generated sequence gets its own `Matcher`. Once per step the engine asks each constrained
sequence's matcher for the packed bitmask of allowed next tokens (bit `t % 32` of word `t // 32`),
uploads it with the step, and after sampling advances the matcher by the token drawn. The EOS
tokens are allowed only where the grammar accepts, so a finished sequence is always a complete
match.

Two engines sit behind one interface: outlines-core (a precomputed token-level DFA: building it
costs up to seconds per regex, a mask then costs ~2-5 us) for regexes, choices and JSON schemas it
honours fully; llguidance (an Earley parser with a lazily built lexer: no build step, ~10-100 us
per mask) for grammars, "any JSON object", and schemas only it enforces.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Matcher(Protocol):
    def fill_mask(self, out: np.ndarray) -> None:
        """Overwrite out (uint32 [words]) with the allowed next tokens."""

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar did not allow it."""

    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS may end it here)."""

    def error(self) -> str | None:
        """Why the matcher cannot continue (e.g. a parser limit), if it cannot."""


class Grammar(Protocol):
    kind: str
    nbytes: int  # memory held, for the compiler's cache budget

    def matcher(self) -> Matcher: ...


class OutlinesGrammar:
    def __init__(self, index: Any, eos_ids: tuple[int, ...], kind: str, nbytes: int):
        self.index = index
        self.eos_ids = eos_ids
        self.kind = kind
        self.nbytes = nbytes

    def matcher(self) -> "OutlinesMatcher":
        return OutlinesMatcher(self)


class OutlinesMatcher:
    def __init__(self, grammar: OutlinesGrammar):
        from outlines_core import Guide

        self.grammar = grammar
        self.guide = Guide(grammar.index)

    def fill_mask(self, out: np.ndarray) -> None:
        out.fill(0)
        self.guide.write_mask_into(out.ctypes.data, out.size, 4)
        if self.is_accepting():
            # The index knows one EOS id; models with several (Llama 3's <|eot_id|> and
            # <|end_of_text|>) may end with any of them.
            for eos in self.grammar.eos_ids:
                out[eos >> 5] |= np.uint32(1 << (eos & 31))

    def advance(self, token: int) -> bool:
        if token in self.grammar.eos_ids:
            return self.is_accepting()
        try:
            self.guide.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def is_accepting(self) -> bool:
        return self.grammar.index.is_final_state(self.guide.get_state())

    def error(self) -> str | None:
        return None


class LLGuidanceGrammar:
    def __init__(self, tokenizer: Any, grammar: str, kind: str, mask_words: int):
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.kind = kind
        self.mask_words = mask_words  # the tokenizer's vocabulary in 32-token words
        self.nbytes = len(grammar)

    def matcher(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self)


class LLGuidanceMatcher:
    def __init__(self, grammar: LLGuidanceGrammar):
        import llguidance

        self.grammar = grammar
        self.m = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)

    def fill_mask(self, out: np.ndarray) -> None:
        words = self.grammar.mask_words
        if out.size < words:
            raise ValueError(f"mask of {out.size} words is smaller than the vocabulary's {words}")
        out[words:] = 0  # rows past the tokenizer's vocabulary (padded embeddings) are never allowed
        self.m.unsafe_compute_mask_ptr(out.ctypes.data, words * 4)

    def advance(self, token: int) -> bool:
        return self.m.consume_token(token)

    def is_accepting(self) -> bool:
        return self.m.is_accepting()

    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None
