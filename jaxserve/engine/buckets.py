"""The one table of static shapes: every jitted step is compiled for exactly these sizes.

A prefill step is padded to a token-count bucket, a decode step to a batch-size bucket. Powers of
two keep the padding waste under 2x with few compilations; the configured maxima are always the
largest buckets so that anything the scheduler emits has a shape.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

from jaxserve.config import SchedulerConfig

MIN_PREFILL_BUCKET = 16  # smaller prefill steps cost the same as 16 tokens on any accelerator


class Shape(NamedTuple):
    kind: str  # "prefill" (size = tokens) or "decode" (size = sequences)
    size: int


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2*low, 4*low, ... below `high`, then `high` itself (it need not be a power of two)."""
    sizes = []
    size = low
    while size < high:
        sizes.append(size)
        size *= 2
    return (*sizes, high)


def _validate(name: str, buckets: tuple[int, ...], maximum: int, max_name: str) -> tuple[int, ...]:
    if not buckets:
        raise ValueError(f"{name} must not be empty")
    if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
        raise ValueError(f"{name} must be positive integers, got {buckets}")
    if any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {buckets}")
    if buckets[-1] != maximum:
        raise ValueError(f"the largest of {name} {buckets} must equal {max_name}={maximum}")
    return tuple(buckets)


def in_flag_words(error: ValueError) -> str:
    """A bucket table's complaint in a command line's words: `--decode-buckets`, not `decode_buckets`
    (the server's and the planner's flags have the same names)."""
    message = str(error)
    for name in ("decode_buckets", "prefill_buckets", "max_num_seqs", "max_num_batched_tokens"):
        message = message.replace(name, "--" + name.replace("_", "-"))
    return message


class BucketTable:
    """Decode batch-size buckets and prefill token-count buckets for one SchedulerConfig."""

    def __init__(self, config: SchedulerConfig):
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        decode = config.decode_buckets
        if decode is None:
            decode = powers_of_two(1, config.max_num_seqs)
        prefill = config.prefill_buckets
        if prefill is None:
            low = min(MIN_PREFILL_BUCKET, config.max_num_batched_tokens)
            prefill = powers_of_two(low, config.max_num_batched_tokens)
        self.decode_buckets = _validate("decode_buckets", tuple(decode), config.max_num_seqs, "max_num_seqs")
        self.prefill_buckets = _validate(
            "prefill_buckets", tuple(prefill), config.max_num_batched_tokens, "max_num_batched_tokens"
        )

    @property
    def max_decode_batch(self) -> int:
        return self.decode_buckets[-1]

    @property
    def max_prefill_tokens(self) -> int:
        return self.prefill_buckets[-1]

    def decode_bucket(self, batch: int) -> int:
        """Smallest decode bucket holding `batch` sequences."""
        return smallest_at_least(self.decode_buckets, batch, "decode batch")

    def prefill_bucket(self, num_tokens: int) -> int:
        """Smallest prefill bucket holding `num_tokens` tokens."""
        return smallest_at_least(self.prefill_buckets, num_tokens, "prefill tokens")

    def all_shapes(self) -> list[Shape]:
        """Every shape to compile ahead of time, prefill first, small to large."""
        return [Shape("prefill", n) for n in self.prefill_buckets] + [Shape("decode", n) for n in self.decode_buckets]

    def __repr__(self) -> str:
        return f"BucketTable(prefill={list(self.prefill_buckets)}, decode={list(self.decode_buckets)})"


def smallest_at_least(buckets: tuple[int, ...], n: int, what: str) -> int:
    """The smallest of `buckets` (increasing) holding `n`; ValueError naming `what` past the largest."""
    if n < 0:
        raise ValueError(f"{what} must be non-negative, got {n}")
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
