"""`reasoning_max_tokens`: a think block ended by force after that many tokens.

A matcher around the request's own (or no) constraint: it watches the output's bytes for the
think block's `<think>` and `</think>`, counts the tokens in between, and at the cap allows only
the tokens that spell `</think>`, one per step, before handing the mask back. The inner grammar
(jaxserve.structured.compose) lets a think block end anywhere, so it follows along.

Why not llguidance's own `max_tokens` on the think lexeme: it ends a capped lexeme without
forcing what follows it, so the answer could start with the block still open.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.structured.matcher import Grammar, Matcher

START, END = b"<think>", b"</think>"


class ReasoningCapGrammar:
    kind = "reasoning_cap"
    nbytes = 0

    def __init__(self, inner: Grammar | None, token_bytes: Sequence[bytes | None], end_ids: Sequence[int],
                 max_tokens: int, opened: bool, vocab_size: int):
        if not end_ids:
            raise ValueError("the tokenizer cannot spell </think>")
        self.inner = inner
        self.token_bytes = token_bytes
        self.end_ids = tuple(end_ids)
        self.max_tokens = max_tokens
        self.opened = opened
        self.vocab_size = vocab_size

    def matcher(self) -> ReasoningCapMatcher:
        return ReasoningCapMatcher(self)


class ReasoningCapMatcher:
    def __init__(self, grammar: ReasoningCapGrammar):
        self.g = grammar
        self.inner: Matcher | None = grammar.inner.matcher() if grammar.inner is not None else None
        self.state = "thinking" if grammar.opened else "before"  # before -> thinking -> done
        self.count = 0  # tokens inside the block
        self.text = b""  # before: the output so far; thinking: its last bytes (to find </think>)
        self.forced: list[int] = []

    def fill_mask(self, out: np.ndarray) -> None:
        if self.forced:
            out.fill(0)
            t = self.forced[0]
            out[t >> 5] = np.uint32(1 << (t & 31))
        elif self.inner is not None:
            self.inner.fill_mask(out)
        else:
            out.fill(0xFFFFFFFF)
            n = self.g.vocab_size
            out[(n + 31) // 32:] = 0
            if n % 32:
                out[n // 32] = np.uint32((1 << (n % 32)) - 1)

    def advance(self, token: int) -> bool:
        ok = self.inner.advance(token) if self.inner is not None else True
        if self.forced:
            if token != self.forced[0]:
                return False
            self.forced.pop(0)
        piece = self.g.token_bytes[token] if 0 <= token < len(self.g.token_bytes) else None
        self._watch(piece or b"")
        return ok

    def _watch(self, piece: bytes) -> None:
        if self.state == "before":
            self.text += piece
            lead = self.text.lstrip()
            if lead.startswith(START):
                self.state, self.text = "thinking", lead[len(START):]
            elif not START.startswith(lead):
                self.state = "done"  # the answer began without a think block
            return
        if self.state != "thinking":
            return
        self.count += 1
        self.text = (self.text + piece)[-(len(END) + len(piece)):]
        if END in self.text:
            self.state, self.forced = "done", []
        elif self.count >= self.g.max_tokens and not self.forced:
            self.forced = list(self.g.end_ids)

    def is_accepting(self) -> bool:
        if self.forced:
            return False
        return self.inner.is_accepting() if self.inner is not None else True

    def error(self) -> str | None:
        return self.inner.error() if self.inner is not None else None
