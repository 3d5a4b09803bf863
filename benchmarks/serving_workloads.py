"""Workloads for the serving benchmark: random token prompts, a JSONL prompt file, shared-prefix
prompts. Every generator is seeded and deterministic, and produces prompts of exact token lengths.

A prompt is kept both as text and as token ids. The ids are the tokenizer's own encoding of the
text (random ids are decoded, re-encoded and corrected until the text round-trips to exactly the
target length, as vLLM's random dataset does), so a server that takes text and one that takes ids
see the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

# Decode/re-encode rounds before giving up on an exact length; in practice 2-4 suffice.
_MAX_FIX_ROUNDS = 20


class WorkloadError(ValueError):
    """A workload cannot be built as asked; the message names the flag or file at fault."""


class BenchTokenizer(Protocol):
    """What the workloads need from a tokenizer (no special tokens are ever added)."""

    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: list[int]
    output_len: int
    # Token ids this prompt shares with others (shared-prefix workloads); 0 elsewhere.
    prefix_len: int = 0

    @property
    def input_len(self) -> int:
        return len(self.token_ids)


class HFTokenizerAdapter:
    """Adapts a Hugging Face (fast) tokenizer, or jaxserve's Tokenizer wrapping one."""

    def __init__(self, tokenizer: Any):
        hf = getattr(tokenizer, "hf", tokenizer)
        self._hf = hf
        self.vocab_size = len(hf)
        added = getattr(hf, "added_tokens_decoder", {}) or {}
        self.special_ids = frozenset(hf.all_special_ids) | frozenset(i for i, t in added.items() if t.special)

    def encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def load_tokenizer(spec: str, cache_dir: Path | None = None) -> HFTokenizerAdapter:
    """A tokenizer from a Hugging Face directory or a .gguf file (converted once, then cached)."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise WorkloadError(f"--tokenizer: {spec} does not exist (give a Hugging Face tokenizer directory or "
                            "a .gguf file)")
    from jaxserve.tokenizer import load_tokenizer as jaxserve_tokenizer

    if path.is_file() and path.suffix == ".gguf":
        return HFTokenizerAdapter(jaxserve_tokenizer(path.parent, path.name, cache_dir=cache_dir))
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists() and ggufs:
            return HFTokenizerAdapter(jaxserve_tokenizer(path, ggufs[0].name, cache_dir=cache_dir))
        return HFTokenizerAdapter(jaxserve_tokenizer(path))
    raise WorkloadError(f"--tokenizer: {spec} is neither a directory nor a .gguf file")


# ---- exact-length text ------------------------------------------------------------------------
def _ordinary_ids(tokenizer: BenchTokenizer) -> np.ndarray:
    # Special tokens would be rendered as control strings (<|im_end|>) that servers refuse or
    # treat specially; prompts are made of ordinary tokens only.
    special = np.fromiter(tokenizer.special_ids, int, len(tokenizer.special_ids))
    ids = np.setdiff1d(np.arange(tokenizer.vocab_size), special)
    if ids.size == 0:
        raise WorkloadError("the tokenizer has no ordinary (non-special) tokens")
    return ids


def exact_text(tokenizer: BenchTokenizer, prefix: list[int], length: int, rng: np.random.Generator,
               pool: np.ndarray) -> tuple[str, list[int]]:
    """Text that encodes to exactly `length` tokens starting with `prefix` (the prefix's own ids).

    Random ids rarely round-trip (neighbours merge into longer tokens, byte tokens decode to
    U+FFFD), so the tail is re-encoded and cut or topped up until it does. If no exact text is
    found the closest one is returned; callers report actual lengths, never the intended ones."""
    if length < len(prefix):
        raise WorkloadError(f"a prompt of {length} tokens cannot hold a {len(prefix)}-token prefix")
    ids = prefix + rng.choice(pool, length - len(prefix)).tolist()
    best: tuple[str, list[int]] | None = None
    for _ in range(_MAX_FIX_ROUNDS):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text)
        if len(again) == length and again[: len(prefix)] == prefix:
            return text, again
        if best is None or abs(len(again) - length) < abs(len(best[1]) - length):
            best = (text, again)
        n_tail = length - len(prefix)
        if again[: len(prefix)] == prefix:
            # Keep what re-encoded cleanly; re-draw the last few tokens so a merge at the same
            # place does not repeat forever.
            tail = again[len(prefix):][: max(0, n_tail - 4)]
        else:
            tail = []  # the tail merged into the prefix: start it afresh
        ids = prefix + tail + rng.choice(pool, n_tail - len(tail)).tolist()
    assert best is not None
    return best


# ---- workloads --------------------------------------------------------------------------------
def sample_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """n lengths uniform in [mean*(1-r), mean*(1+r)] (integers, inclusive; at least 1): vLLM's rule."""
    if not 0 <= range_ratio < 1:
        raise WorkloadError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(np.floor(mean * (1 - range_ratio))))
    high = max(low, int(np.ceil(mean * (1 + range_ratio))))
    return rng.integers(low, high + 1, n).tolist()


def random_prompts(tokenizer: BenchTokenizer, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0) -> list[Prompt]:
    """Prompts of random ordinary tokens, input and output lengths drawn around the given means."""
    rng = np.random.default_rng(seed)
    pool = _ordinary_ids(tokenizer)
    inputs = sample_lengths(input_len, range_ratio, num_prompts, rng)
    outputs = sample_lengths(output_len, range_ratio, num_prompts, rng)
    prompts = []
    for n_in, n_out in zip(inputs, outputs):
        text, ids = exact_text(tokenizer, [], n_in, rng, pool)
        prompts.append(Prompt(text, ids, n_out))
    return prompts


def shared_prefix_prompts(tokenizer: BenchTokenizer, num_prompts: int, prefix_len: int, num_prefixes: int,
                          suffix_len: int, output_len: int, range_ratio: float = 0.0,
                          seed: int = 0) -> list[Prompt]:
    """num_prefixes random prefixes of prefix_len tokens, each followed by a unique random suffix
    (length around suffix_len); prompt i uses prefix i % num_prefixes, so a server with prefix
    caching computes each prefix once."""
    if num_prefixes < 1:
        raise WorkloadError(f"--shared-prefix-groups must be >= 1, got {num_prefixes}")
    if prefix_len < 1:
        raise WorkloadError(f"--shared-prefix-len must be >= 1, got {prefix_len}")
    rng = np.random.default_rng(seed)
    pool = _ordinary_ids(tokenizer)
    prefixes = [exact_text(tokenizer, [], prefix_len, rng, pool)[1] for _ in range(num_prefixes)]
    suffixes = sample_lengths(suffix_len, range_ratio, num_prompts, rng)
    outputs = sample_lengths(output_len, range_ratio, num_prompts, rng)
    prompts = []
    for i, (n_suffix, n_out) in enumerate(zip(suffixes, outputs)):
        prefix = prefixes[i % num_prefixes]
        text, ids = exact_text(tokenizer, prefix, prefix_len + n_suffix, rng, pool)
        prompts.append(Prompt(text, ids, n_out, prefix_len=prefix_len))
    return prompts


def jsonl_prompts(path: Path, tokenizer: BenchTokenizer, num_prompts: int, output_len: int) -> list[Prompt]:
    """Prompts from a JSONL file, in file order (cycled when num_prompts exceeds the lines).

    Each line is an object with "prompt" (a string) and optionally "output_len" (or
    "max_tokens"), which overrides --output-len for that line."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"--dataset-path: {path} is not a file")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise WorkloadError(f'{path}:{lineno}: each line must be an object with a non-empty "prompt" string')
        n_out = row.get("output_len", row.get("max_tokens", output_len))
        if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
            raise WorkloadError(f"{path}:{lineno}: output_len must be a positive integer, got {n_out!r}")
        rows.append(Prompt(row["prompt"], tokenizer.encode(row["prompt"]), n_out))
    if not rows:
        raise WorkloadError(f"{path}: no prompts in the file")
    return [rows[i % len(rows)] for i in range(num_prompts)]


def request_intervals(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before sending each request (the first goes at once).

    Gaps are gamma-distributed with mean 1/request_rate and shape `burstiness` (vLLM's arrival
    model): burstiness 1 is a Poisson process; below 1 is burstier, above 1 more regular. An
    infinite rate sends everything at once."""
    if request_rate <= 0:
        raise WorkloadError(f"--request-rate must be positive (or inf), got {request_rate}")
    if burstiness <= 0:
        raise WorkloadError(f"--burstiness must be positive, got {burstiness}")
    if num_requests == 0:
        return []
    if np.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0, *gaps.tolist()]
