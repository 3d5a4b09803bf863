"""The bytes each token id stands for: what a grammar engine matches output against.

A tokenizer's vocabulary stores tokens in its own spelling, not as text: GPT-2-style byte-level
BPE maps every byte to a printable character ("Ġ" is a space), SentencePiece writes spaces as "▁"
and rare bytes as "<0x0A>" pieces. A regex or JSON grammar is about the *bytes* of the output, so
each token must be translated back exactly as the tokenizer's decoder would, or the grammar would
allow tokens that decode to something else. Special tokens (chat markers, EOS) have no text and are
never allowed inside constrained output; EOS is handled separately (allowed in accepting states).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for every byte, inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _decoder_types(spec: dict[str, Any] | None) -> set[str]:
    if not spec:
        return set()
    if spec.get("type") == "Sequence":
        return set().union(*(_decoder_types(d) for d in spec.get("decoders", [])))
    return {spec.get("type", "")}


@dataclasses.dataclass(frozen=True)
class TokenVocabulary:
    """tokens[i]: the bytes of token i, or None for special tokens (never inside a grammar)."""

    tokens: tuple[bytes | None, ...]
    eos_ids: tuple[int, ...]
    fingerprint: str  # identifies the vocabulary in compiled-grammar cache keys

    @property
    def size(self) -> int:
        return len(self.tokens)

    def by_bytes(self) -> dict[bytes, list[int]]:
        """bytes -> token ids (several ids may share a spelling), special tokens left out."""
        out: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.tokens):
            if b is not None and b:
                out.setdefault(b, []).append(i)
        return out


def token_vocabulary(hf_tokenizer: Any, eos_ids: list[int] | tuple[int, ...]) -> TokenVocabulary:
    """Translate a Hugging Face fast tokenizer's vocabulary into token bytes."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    kinds = _decoder_types(spec.get("decoder"))
    byte_level = _byte_level_decoder() if "ByteLevel" in kinds else None
    byte_fallback = "ByteFallback" in kinds
    special = set(hf_tokenizer.all_special_ids)
    added = {i: t for i, t in hf_tokenizer.added_tokens_decoder.items()}
    special |= {i for i, t in added.items() if t.special}
    size = len(hf_tokenizer)
    # A model's config may name EOS ids its tokenizer does not have (a padded embedding): a
    # grammar can only end on tokens the tokenizer knows.
    eos_ids = [i for i in eos_ids if 0 <= i < size]
    pieces = hf_tokenizer.convert_ids_to_tokens(list(range(size)))
    tokens: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            tokens.append(None)
        elif i in added:  # added tokens are stored as their literal text
            tokens.append(piece.encode())
        elif byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            tokens.append(bytes([int(m.group(1), 16)]))
        elif byte_level is not None and all(c in byte_level for c in piece):
            tokens.append(bytes(byte_level[c] for c in piece))
        else:
            tokens.append(piece.replace("▁", " ").encode())
    digest = hashlib.sha256()
    for t in tokens:
        digest.update(b"\x00" if t is None else b"\x01" + len(t).to_bytes(4, "little") + t)
    digest.update(repr(sorted(eos_ids)).encode())
    return TokenVocabulary(tuple(tokens), tuple(sorted(set(eos_ids))), digest.hexdigest()[:32])
