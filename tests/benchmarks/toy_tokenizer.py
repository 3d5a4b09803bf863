"""A tiny greedy longest-match tokenizer whose random token sequences do not round-trip (adjacent
pieces merge, like BPE merges), to exercise the exact-length prompt builder without a real model."""

from __future__ import annotations

from typing import Sequence

# ids 0-1 are special; 2-27 single letters; then merges of two and three letters.
_PIECES = ["<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "ab", "cd", "ef", "abc", "the", "th", "he", "in", "ng",
           "ing", "an", "en", "on", "er", "re", "st", "at", "es", "or", "te", "ou", "it", "is", "ar", "al", "ion"]


class ToyTokenizer:
    def __init__(self) -> None:
        self.pieces = list(_PIECES)
        self.vocab_size = len(self.pieces)
        self.special_ids = frozenset({0, 1})
        self._by_piece = {p: i for i, p in enumerate(self.pieces) if i not in self.special_ids}
        self._longest = max(len(p) for p in self._by_piece)

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for n in range(min(self._longest, len(text) - i), 0, -1):
                if text[i:i + n] in self._by_piece:
                    ids.append(self._by_piece[text[i:i + n]])
                    i += n
                    break
            else:
                raise ValueError(f"cannot encode {text[i]!r}")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.pieces[i] for i in ids)
