"""Prompt positions whose input is an embedding instead of a token: images (a vision model's
output for each placeholder token) and `input_embeds` / `prompt_embeds` sent by the client.

Plain NumPy (no jax): the scheduler and the step builder read these, the runner only receives the
rows a prefill chunk covers. A span's embeddings replace the token embeddings at its positions;
its token ids (the model's image token, or 0) only keep the prompt's length and positions.

The prefix cache keys pages by token ids, and every image's placeholder ids are the same: so a
span's positions are keyed by its content hash instead (`cache_ids`), and two requests share
pages exactly when they share the text and the images before them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

_KEY_SPACE = 2**62


@dataclasses.dataclass(frozen=True, eq=False)
class EmbedSpan:
    """Prompt positions offset .. offset + len(embeds) take `embeds` [n, hidden] as their input."""

    offset: int
    embeds: np.ndarray  # [num_tokens, hidden]
    key: str  # content hash: equal keys mean equal embeddings

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclasses.dataclass(frozen=True, eq=False)
class ImageItem:
    """An image of a prompt before its vision encoding: `num_tokens` placeholder positions from
    `offset`, and what the model's image processor made of it (`data`, the engine's vision
    encoder's input)."""

    offset: int
    num_tokens: int
    key: str  # the image's hash (jaxserve.multimodal.media.image_hash)
    data: Any


def embeds_key(embeds: np.ndarray) -> str:
    """Content hash of client-sent embeddings (shape, dtype and bytes)."""
    h = hashlib.sha256(f"{embeds.shape}|{embeds.dtype}|".encode())
    h.update(np.ascontiguousarray(embeds).tobytes())
    return h.hexdigest()


def cache_ids(prompt_ids: Sequence[int], spans: Sequence[EmbedSpan]) -> list[int]:
    """The prompt's prefix-cache keys: its token ids, with each span's positions replaced by
    negative ids derived from the span's hash and the position inside it (token ids are never
    negative, so a span never matches text)."""
    keys = list(prompt_ids)
    for span in spans:
        # The whole key (a suffix may tell two readings of one image apart) and the span's length.
        digest = hashlib.sha256(f"{span.key}|{span.num_tokens}".encode()).hexdigest()
        base = int(digest[:16], 16) % _KEY_SPACE
        keys[span.offset:span.end] = [-1 - (base + j) % _KEY_SPACE for j in range(span.num_tokens)]
    return keys


def check_spans(spans: Sequence[EmbedSpan], num_prompt_tokens: int, hidden_size: int) -> None:
    """Raise ValueError unless the spans lie inside the prompt, in order, without overlap, each
    [n, hidden_size]."""
    end = 0
    for span in spans:
        if span.embeds.ndim != 2 or span.embeds.shape[1] != hidden_size:
            raise ValueError(f"embeddings of shape {span.embeds.shape}; the model takes [tokens, {hidden_size}]")
        if span.offset < end or span.end > num_prompt_tokens or span.num_tokens == 0:
            raise ValueError(f"embedding span {span.offset}..{span.end} is empty, overlaps another or lies "
                             f"outside the {num_prompt_tokens}-token prompt")
        end = span.end


def fill_chunk(spans: Sequence[EmbedSpan], start: int, end: int, out: np.ndarray, mask: np.ndarray) -> None:
    """Write the embeddings of prompt positions start .. end into `out` [end - start, hidden] and
    set `mask` [end - start] where a position takes one."""
    for span in spans:
        lo, hi = max(start, span.offset), min(end, span.end)
        if lo < hi:
            out[lo - start:hi - start] = span.embeds[lo - span.offset:hi - span.offset]
            mask[lo - start:hi - start] = True
