"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (plain Python, no jax).

Copy-heavy outputs (editing a document, answering from a retrieved passage, code that repeats
names) keep reproducing spans of the prompt or of themselves; when the last n tokens occurred
before, the tokens that followed them then are a cheap guess at what follows now. The verify
step (jaxserve.engine.programs) scores the guess in one forward pass and keeps the longest prefix
the model agrees with, so a wrong guess costs a little compute and never changes the output.

Lookup is O(max n) per step: one dict per n-gram length maps an n-gram to the position just after
its latest occurrence, updated as tokens arrive. An n-gram enters its dict only once a token
follows it, so the sequence's own last n tokens never match themselves. Longer matches are tried
first (more context, better guesses), down to `min_ngram_size`. A match close to the end (a
sequence repeating itself, "ab ab ab") continues with its period, so a repetition gets a whole
draft rather than the one or two tokens that followed its latest occurrence.
"""

from __future__ import annotations

# The index holds one entry per position per n-gram size, built for the whole prompt on the
# sequence's first decode step (inside the scheduler): a 32k-token prompt took 61 ms and 10 MiB
# at size 3, and 0.7 s and ~210 MiB at size 32. Matches longer than a few tokens add little.
MAX_NGRAM_SIZE = 8


class NgramDrafter:
    def __init__(self, max_ngram_size: int, min_ngram_size: int = 1):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min {min_ngram_size} <= max {max_ngram_size}")
        self.max_n = max_ngram_size
        self.min_n = min_ngram_size
        self.tokens: list[int] = []
        # index[n - 1][ngram] = the position right after the latest occurrence of ngram that is
        # followed by a token.
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram_size)]

    def sync(self, token_ids: list[int]) -> None:
        """Catch up with the sequence's tokens (they only grow, or are cut back by a stop string)."""
        if len(token_ids) < len(self.tokens):  # cut back: rebuild (rare: stop strings end the sequence)
            self.tokens, self.index = [], [{} for _ in range(self.max_n)]
        for token in token_ids[len(self.tokens):]:
            self._append(token)

    def _append(self, token: int) -> None:
        # Every n-gram ending at the current last token is now followed by `token`.
        end = len(self.tokens)
        for n in range(1, min(self.max_n, end) + 1):
            self.index[n - 1][tuple(self.tokens[end - n:end])] = end
        self.tokens.append(token)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens to follow the sequence (empty when nothing matches)."""
        if num_tokens <= 0:
            return []
        tokens, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self.index[n - 1].get(tuple(tokens[end - n:]))
            if start is not None:
                # The match predicts tokens[end + i] = tokens[start + i]; past the end that is a
                # predicted token itself, so a repeat near the end continues with its period.
                draft = tokens[start:start + num_tokens]
                period = end - start
                while len(draft) < num_tokens:
                    draft.append(draft[len(draft) - period])
                return draft
        return []
