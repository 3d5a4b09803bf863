"""Host side of classification: validation, a priority queue, and packing inputs into steps.

Classification is prefill-only: one forward pass per input, no KV cache kept afterwards. Inputs
wait in a queue ordered by (priority, arrival) -- lower priority values run first, as in the
generation scheduler -- and each step takes them in that order while they fit its limits
(--max-num-seqs inputs, the largest token bucket), packing them into one row of tokens padded to
the smallest bucket that holds them. Plain Python/NumPy: no jax here, so this unit-tests in
milliseconds; `ClassifyRunner` turns a `PackedStep` into device arrays.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from typing import NamedTuple

import numpy as np

from jaxserve.engine.buckets import MIN_PREFILL_BUCKET, powers_of_two
from jaxserve.errors import InvalidRequestError, RequestTooLongError


@dataclasses.dataclass(frozen=True)
class PackingSpec:
    """How a model reads a packed input (what differs between decoders and BERT-style encoders)."""

    pool: str  # "last": the last non-padding token (decoders); "first": [CLS] / <s> (encoders)
    pad_token_id: int | None = None
    # RoBERTa numbers positions from pad_token_id + 1 and gives padding tokens position pad_token_id
    # (fairseq's make_positions); everyone else counts from 0.
    roberta_positions: bool = False

    def positions(self, ids: np.ndarray) -> np.ndarray:
        if not self.roberta_positions:
            return np.arange(len(ids), dtype=np.int32)
        mask = (ids != self.pad_token_id).astype(np.int32)
        return (np.cumsum(mask) * mask + self.pad_token_id).astype(np.int32)

    def pool_index(self, ids: np.ndarray) -> int:
        """Index of the token that represents the sequence. HF's decoder classifiers read the
        rightmost token that is not pad_token_id (index 0 if there is none)."""
        if self.pool == "first":
            return 0
        if self.pad_token_id is None:
            return len(ids) - 1
        kept = np.flatnonzero(ids != self.pad_token_id)
        return int(kept[-1]) if len(kept) else 0


class Bucket(NamedTuple):
    tokens: int  # packed tokens per step
    seqs: int  # most inputs per step (rows of the output)


def classify_buckets(max_tokens: int, max_seqs: int, sizes: tuple[int, ...] | None = None) -> tuple[Bucket, ...]:
    """Token buckets: `sizes`, by default powers of two from 16 to max_tokens (itself the largest);
    each holds at most min(max_seqs, tokens) inputs, since every input has at least one token."""
    if max_tokens < 1 or max_seqs < 1:
        raise ValueError(f"max_tokens ({max_tokens}) and max_seqs ({max_seqs}) must be >= 1")
    if sizes is None:
        sizes = powers_of_two(min(MIN_PREFILL_BUCKET, max_tokens), max_tokens)
    if not sizes or any(a >= b for a, b in zip(sizes, sizes[1:])) or sizes[0] < 1 or sizes[-1] != max_tokens:
        raise ValueError(f"token buckets must rise strictly from >= 1 to max_tokens={max_tokens}, got {sizes}")
    return tuple(Bucket(t, min(max_seqs, t)) for t in sizes)


@dataclasses.dataclass
class ClassifyItem:
    request_id: str
    token_ids: list[int]
    priority: int = 0
    token_types: list[int] | None = None  # a text pair's segment of each token (cross-encoders); None: all 0


@dataclasses.dataclass
class PackedStep:
    """One step's inputs; shapes fixed by `bucket`."""

    bucket: Bucket
    request_ids: list[str]
    num_tokens: list[int]  # per input
    tokens: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    segments: np.ndarray  # [T] int32: input index, -1 for padding
    pool_rows: np.ndarray  # [S] int32: the row of each input's pooled token (0 for unused rows)
    token_types: np.ndarray  # [T] int32: 0, or 1 for the second text of a pair


class ClassifyBatcher:
    def __init__(self, spec: PackingSpec, max_model_len: int, vocab_size: int, buckets: tuple[Bucket, ...]):
        if not buckets:
            raise ValueError("at least one bucket is needed")
        if buckets[-1].tokens < max_model_len:
            raise ValueError(f"the largest bucket ({buckets[-1].tokens} tokens) must hold a whole input of "
                             f"max_model_len={max_model_len} tokens")
        self.spec = spec
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.buckets = buckets
        self._queue: list[tuple[int, int, ClassifyItem]] = []  # heap of (priority, arrival, item)
        self._arrivals = itertools.count()
        self._queued: dict[str, ClassifyItem] = {}

    # ---- admission ---------------------------------------------------------------------------
    def validate(self, token_ids: list[int], param: str = "input") -> None:
        """Raise InvalidRequestError / RequestTooLongError (the message names the numbers)."""
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError(param, "the input has no tokens")
        if n > self.max_model_len:
            raise RequestTooLongError(
                param, f"the input has {n} tokens, more than the maximum context length of {self.max_model_len} "
                "tokens; shorten the input")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(param, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def add(self, item: ClassifyItem) -> None:
        if item.request_id in self._queued:
            raise InvalidRequestError("rid", f"{item.request_id!r} is already queued")
        self.validate(item.token_ids)
        if item.token_types is not None and len(item.token_types) != len(item.token_ids):
            raise ValueError(f"{len(item.token_types)} token types for {len(item.token_ids)} tokens")
        self._queued[item.request_id] = item
        heapq.heappush(self._queue, (item.priority, next(self._arrivals), item))

    def abort(self, request_id: str) -> bool:
        """Drop a queued input (lazily: its heap entry is skipped when it comes up)."""
        return self._queued.pop(request_id, None) is not None

    @property
    def num_waiting(self) -> int:
        return len(self._queued)

    def has_waiting(self) -> bool:
        return bool(self._queued)

    # ---- packing -----------------------------------------------------------------------------
    def next_step(self) -> PackedStep | None:
        """Take inputs in (priority, arrival) order while they fit one step; None if none wait.
        Stops at the first input that does not fit rather than passing it, so a long input is
        never starved by shorter ones behind it."""
        largest = self.buckets[-1]
        taken: list[ClassifyItem] = []
        total = 0
        while self._queue:
            _, _, item = self._queue[0]
            if self._queued.get(item.request_id) is not item:  # aborted
                heapq.heappop(self._queue)
                continue
            n = len(item.token_ids)
            if len(taken) == largest.seqs or total + n > largest.tokens:
                break
            heapq.heappop(self._queue)
            del self._queued[item.request_id]
            taken.append(item)
            total += n
        if not taken:
            return None
        return self.pack(taken)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> Bucket:
        i = bisect.bisect_left([b.tokens for b in self.buckets], num_tokens)
        for bucket in self.buckets[i:]:
            if bucket.seqs >= num_seqs:
                return bucket
        raise ValueError(f"{num_seqs} inputs of {num_tokens} tokens fit no bucket (largest {self.buckets[-1]})")

    def pack(self, items: list[ClassifyItem]) -> PackedStep:
        total = sum(len(it.token_ids) for it in items)
        bucket = self.bucket_for(total, len(items))
        tokens = np.zeros(bucket.tokens, np.int32)
        positions = np.zeros(bucket.tokens, np.int32)
        segments = np.full(bucket.tokens, -1, np.int32)
        pool_rows = np.zeros(bucket.seqs, np.int32)
        token_types = np.zeros(bucket.tokens, np.int32)
        offset = 0
        for i, item in enumerate(items):
            ids = np.asarray(item.token_ids, np.int32)
            n = len(ids)
            tokens[offset : offset + n] = ids
            positions[offset : offset + n] = self.spec.positions(ids)
            segments[offset : offset + n] = i
            if item.token_types is not None:
                token_types[offset : offset + n] = item.token_types
            pool_rows[i] = offset + self.spec.pool_index(ids)
            offset += n
        return PackedStep(bucket, [it.request_id for it in items], [len(it.token_ids) for it in items],
                          tokens, positions, segments, pool_rows, token_types)


def probabilities(logits: np.ndarray, activation: str = "softmax") -> np.ndarray:
    """The class scores of `logits` under `activation` (ClassifierConfig.class_activation):
    softmax over the classes, sigmoid of each, or the logits as they are."""
    x = np.asarray(logits, np.float64)
    if activation == "identity":
        return x
    if activation == "sigmoid":
        e = np.exp(-np.abs(x))  # never overflows; 1/(1+e^-x) on each side of 0 (no underflow to 0 either)
        return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    if activation != "softmax":
        raise ValueError(f"activation must be softmax, sigmoid or identity, got {activation!r}")
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers' Normalize uses


def finish_embedding(pooled: np.ndarray, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """A pooled vector as the client gets it: cut to its first `dimensions` values (Matryoshka),
    then L2-normalised if asked (cutting first keeps a cut vector unit-length)."""
    x = np.asarray(pooled, np.float32)
    if dimensions is not None:
        x = x[:dimensions]
    if normalize:
        x = x / max(float(np.linalg.norm(x.astype(np.float64))), NORMALIZE_EPS)
    return x.astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity, as sentence-transformers' cos_sim computes it (normalise, then dot)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(a @ b / (max(np.linalg.norm(a), NORMALIZE_EPS) * max(np.linalg.norm(b), NORMALIZE_EPS)))
