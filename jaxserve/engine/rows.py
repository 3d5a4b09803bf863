"""A running sequence's row of the device batch, on the host: its sampling parameters packed into
fixed-width numpy arrays, sent to the device once, when the sequence gets its slot (no jax).

Widths are static so that every valid request fits one compiled shape: logit_bias holds OpenAI's
limit of 300 (id, value) pairs; banned ids and end ids hold MAX_BANNED_IDS each (the request layer
refuses more). Padding is -1. A row that does not fit raises ValueError naming the numbers: nothing
is dropped silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from jaxserve.engine.request import MAX_TOP_LOGPROBS, Sequence as Seq

MAX_LOGIT_BIAS = 300  # (id, value) pairs per row: OpenAI's limit on logit_bias entries
MAX_BANNED_IDS = 256  # banned ids per row: bad words + EOS/stop ids under min_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class RowParams:
    """One row's parameters, already validated by the request layer (ranges are not rechecked)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    banned_ids: Sequence[int] = ()  # never sampled (single-token bad words, or this step's bans)
    # End the row when sampled at or after min_tokens, and are banned before it: the stop token ids
    # and, unless ignore_eos, the EOS ids.
    end_ids: Sequence[int] = ()
    min_tokens: int = 0
    seed: int = 0
    num_logprobs: int = -1  # -1 none, 0 the chosen token's only, N also the top N
    processed_logprobs: bool = False
    constrained: bool = False  # a grammar limits its tokens (its mask is sent every step)
    lora: int = -1  # the LoRA adapter's slot (jaxserve.models.lora); -1: the base model
    long_rope: bool = False  # a LongRoPE model's row rotates by the long factors (Sequence.long_rope)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


# field -> (dtype, trailing shape): the arrays of a packed block of rows, [rows, *shape] each
ROW_ARRAYS: dict[str, tuple[type, tuple[int, ...]]] = {
    "temperature": (np.float32, ()),
    "top_k": (np.int32, ()),
    "top_p": (np.float32, ()),
    "min_p": (np.float32, ()),
    "frequency_penalty": (np.float32, ()),
    "presence_penalty": (np.float32, ()),
    "repetition_penalty": (np.float32, ()),
    "bias_ids": (np.int32, (MAX_LOGIT_BIAS,)),
    "bias_values": (np.float32, (MAX_LOGIT_BIAS,)),
    "banned_ids": (np.int32, (MAX_BANNED_IDS,)),
    "end_ids": (np.int32, (MAX_BANNED_IDS,)),
    "min_tokens": (np.int32, ()),
    "seed": (np.uint32, ()),
    "num_logprobs": (np.int32, ()),
    "processed_logprobs": (np.bool_, ()),
    "constrained": (np.bool_, ()),
    "lora": (np.int32, ()),
    "long_rope": (np.bool_, ()),
}


def empty_rows(size: int) -> dict[str, np.ndarray]:
    """`size` padding rows: greedy, no logprobs, nothing banned."""
    rows = {name: np.zeros((size, *shape), dtype) for name, (dtype, shape) in ROW_ARRAYS.items()}
    for name in ("bias_ids", "banned_ids", "end_ids"):
        rows[name].fill(-1)
    rows["top_p"].fill(1.0)
    rows["repetition_penalty"].fill(1.0)
    rows["num_logprobs"].fill(-1)
    rows["lora"].fill(-1)
    return rows


def pack_rows(rows: Sequence[RowParams], size: int, vocab_size: int) -> dict[str, np.ndarray]:
    """`rows` packed into arrays of `size` rows (the rest padding). Raises ValueError, naming the
    numbers, for anything that does not fit the shapes."""
    if len(rows) > size:
        raise ValueError(f"{len(rows)} rows do not fit {size}")
    out = empty_rows(size)
    for i, row in enumerate(rows):
        if not -1 <= row.num_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"row {i}: num_logprobs {row.num_logprobs} is outside [-1, {MAX_TOP_LOGPROBS}]")
        for name in ("temperature", "top_k", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty", "min_tokens", "num_logprobs", "processed_logprobs", "constrained", "lora",
                     "long_rope"):
            out[name][i] = getattr(row, name)
        out["seed"][i] = row.seed & 0xFFFFFFFF
        if row.logit_bias:
            ids = checked_ids(row.logit_bias.keys(), MAX_LOGIT_BIAS, vocab_size, f"row {i}: logit_bias")
            out["bias_ids"][i, : len(ids)] = ids
            out["bias_values"][i, : len(ids)] = list(row.logit_bias.values())
        for name in ("banned_ids", "end_ids"):
            ids = checked_ids(getattr(row, name), MAX_BANNED_IDS, vocab_size, f"row {i}: {name}")
            out[name][i, : len(ids)] = ids
    return out


def checked_ids(ids: Iterable[int], width: int, vocab_size: int, what: str) -> np.ndarray:
    arr = np.fromiter(ids, np.int64)
    if len(arr) > width:
        raise ValueError(f"{what}: {len(arr)} ids exceed the compiled width {width}")
    if len(arr) and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"{what}: ids must lie in [0, {vocab_size}), got {arr.min()}..{arr.max()}")
    return arr.astype(np.int32)


def mask_words(vocab_size: int) -> int:
    """32-bit words in a packed mask over the vocabulary."""
    return (vocab_size + 31) // 32


def row_params(seq: Seq, eos_ids: Iterable[int], lora_slot: Callable[[str], int] | None = None) -> RowParams:
    """The row of a running sequence: its request's parameters, its own seed, the bans that never
    change (single-token bad words), the ids that end it, and its LoRA adapter's slot
    (`lora_slot(name)`, jaxserve.engine.lora_slots; the engine checked the name when the request
    came)."""
    p = seq.params
    want = p.logprobs if p.logprobs is not None else (0 if p.best_of and p.best_of > p.n else -1)
    end_ids = p.end_ids(eos_ids)
    # A beam's row reports its best next tokens for the host's beam search (jaxserve.engine.beam);
    # the token it samples itself is never used, so it samples greedily (no noise to draw).
    beam = seq.params.use_beam_search
    return RowParams(
        temperature=0.0 if beam else p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias or {}, banned_ids=current_bans(seq),
        end_ids=sorted(end_ids), min_tokens=p.min_tokens, seed=seq.seed, num_logprobs=MAX_TOP_LOGPROBS if beam else want,
        processed_logprobs=p.processed_logprobs, constrained=seq.matcher is not None,
        lora=-1 if p.lora is None or lora_slot is None else lora_slot(p.lora), long_rope=seq.long_rope,
    )


def current_bans(seq: Seq) -> list[int]:
    """The bad words' last tokens banned for the next token: a one-token word always, a longer one
    when the output ends with the rest of it."""
    out = seq.output_ids
    banned: set[int] = set()
    for words in seq.params.bad_words_ids or []:
        prefix = words[:-1]
        if not prefix or out[len(out) - len(prefix):] == prefix:
            banned.add(words[-1])
    return sorted(banned)
