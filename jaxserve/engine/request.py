"""Requests, their sampling parameters, and the host-side state of each generated sequence.

Plain Python: the scheduler and the API layers import this without touching jax.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from jaxserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from jaxserve.engine.beam import BeamSearch
    from jaxserve.engine.embeds import EmbedSpan
    from jaxserve.engine.ngram import NgramDrafter
    from jaxserve.structured.matcher import Grammar, Matcher


MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding parameters (vLLM/OpenAI semantics)."""

    n: int = 1
    best_of: int | None = None  # sample best_of, return the n with the best cumulative logprob
    max_tokens: int | None = 16  # None: up to the context limit
    # The model's max_new_tokens (generation_config.json): the limit when max_tokens is None, cut to
    # what the context and the KV cache leave (vLLM's rule), never a reason to refuse a request.
    default_max_tokens: int | None = None
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens exist
    temperature: float = 1.0  # 0: greedy
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words_ids: list[list[int]] | None = None  # token sequences never to complete
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = dataclasses.field(default_factory=list)  # one string is one stop string (vLLM's str | list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: off; 0: chosen token only; N: also the top N
    processed_logprobs: bool = False  # logprobs after penalties/temperature instead of raw
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0  # first prompt position to report (echo / logprob_start_len)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured output, compiled by the API layer (jaxserve.structured): every sampled token keeps
    # the output a prefix of a match, and EOS is allowed only where the output is a complete match.
    grammar: "Grammar | None" = None
    # vLLM's: only these tokens are ever sampled (with the grammar, when there is one); end-of-
    # sequence only if listed. None: any token.
    allowed_token_ids: list[int] | None = None
    # vLLM's: the prefix cache shares pages only among requests with the same salt (a tenant's
    # secret), so no one can learn from cache hits what others' prompts were. None: shared.
    cache_salt: str | None = None
    # The LoRA adapter to decode with, by the name the server loaded it under (--lora-modules);
    # None: the base model. Its cached prefix pages are its own (an adapter changes every K/V).
    lora: str | None = None
    # Prompt-lookup (n-gram) speculative decoding, on a server started with it: draft tokens per
    # verify step (None: the server's --num-speculative-tokens; 0: off for this request) and the
    # longest n-gram matched (None: the server's --max-ngram-size). OVMS's names.
    num_assistant_tokens: int | None = None
    max_ngram_size: int | None = None
    # With a draft model: stop a row's drafts at the first whose probability under the draft model
    # is below this (OVMS's; exclusive with num_assistant_tokens).
    assistant_confidence_threshold: float | None = None
    # Beam search (jaxserve.engine.beam): best_of (default n) beams, the n best returned. HF's and
    # vLLM's length_penalty and early_stopping (True, False or "never").
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # not its characters, each a stop string
            self.stop = [self.stop]

    @property
    def num_samples(self) -> int:
        return self.best_of or self.n

    def end_ids(self, eos_ids: Iterable[int]) -> set[int]:
        """The ids that end a sequence of this request: its stop ids, and EOS unless ignore_eos."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))

    @property
    def beam_width(self) -> int:
        """Beams of a beam search (0: not one)."""
        return (self.best_of or self.n) if self.use_beam_search else 0

    @property
    def has_penalties(self) -> bool:
        """Whether its logits depend on the tokens so far (penalty counts kept on the device)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int, max_n: int = 128) -> None:
        """Raise InvalidRequestError naming the first bad parameter and its allowed range."""
        _int_range("n", self.n, 1, max_n)
        if self.best_of is not None:
            _int_range("best_of", self.best_of, self.n, max_n)
        if self.max_tokens is not None:
            _int_range("max_tokens", self.max_tokens, 1, 2**31 - 1)
        if self.default_max_tokens is not None:
            _int_range("default_max_tokens", self.default_max_tokens, 1, 2**31 - 1)
        _int_range("min_tokens", self.min_tokens, 0, self.max_tokens if self.max_tokens is not None else 2**31 - 1)
        _float_range("temperature", self.temperature, 0.0, 100.0)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        _float_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _float_range("min_p", self.min_p, 0.0, 1.0)
        _float_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        for tid, bias in (self.logit_bias or {}).items():
            _token("logit_bias", tid, vocab_size)
            _float_range("logit_bias", bias, -100.0, 100.0)
        if self.logit_bias and len(self.logit_bias) > 300:
            raise InvalidRequestError("logit_bias", f"at most 300 entries, got {len(self.logit_bias)}")
        for words in self.bad_words_ids or []:
            if not words:
                raise InvalidRequestError("bad_words", "an entry tokenizes to nothing")
            for tid in words:
                _token("bad_words", tid, vocab_size)
        if self.seed is not None:
            _int_range("seed", self.seed, -(2**63), 2**64 - 1)
        for tid in self.stop_token_ids:
            _token("stop_token_ids", tid, vocab_size)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequestError("cache_salt", "must be a non-empty string")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids", "must be a non-empty list of token ids")
            for tid in self.allowed_token_ids:
                _token("allowed_token_ids", tid, vocab_size)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        if len(self.stop) > 64:
            raise InvalidRequestError("stop", f"at most 64 stop strings, got {len(self.stop)}")
        if self.logprobs is not None:
            _int_range("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        _int_range("prompt_logprobs_start", self.prompt_logprobs_start, 0, 2**31 - 1)
        if not isinstance(self.use_beam_search, bool):
            raise InvalidRequestError("use_beam_search", f"must be a boolean, got {self.use_beam_search!r}")
        _float_range("length_penalty", self.length_penalty, -100.0, 100.0)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise InvalidRequestError("early_stopping", f'must be true, false or "never", got {self.early_stopping!r}')
        if self.use_beam_search:
            self._validate_beam_search()
        elif self.length_penalty != 1.0 or self.early_stopping is not False:
            name = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
            raise InvalidRequestError(name, "applies to beam search only (use_beam_search, or best_of on /v3)")

    def _validate_beam_search(self) -> None:
        """Beam search scores beams by the model's own log-probabilities (as HF transformers and
        OpenVINO GenAI do): what would change a sampled token's odds has no place in it, and is
        refused rather than ignored."""
        neutral = {"temperature": self.temperature in (0.0, 1.0), "top_k": self.top_k in (-1, 0),
                   "top_p": self.top_p == 1.0, "min_p": self.min_p == 0.0,
                   "frequency_penalty": self.frequency_penalty == 0.0, "presence_penalty": self.presence_penalty == 0.0,
                   "repetition_penalty": self.repetition_penalty == 1.0, "logit_bias": not self.logit_bias,
                   "bad_words": not self.bad_words_ids, "stop": not self.stop,
                   "response_format": self.grammar is None, "processed_logprobs": not self.processed_logprobs,
                   "allowed_token_ids": self.allowed_token_ids is None,
                   "num_assistant_tokens": self.num_assistant_tokens in (None, 0),
                   "assistant_confidence_threshold": self.assistant_confidence_threshold is None}
        for name, ok in neutral.items():
            if not ok:
                why = {"stop": "beam search ends on end ids only; use stop_token_ids",
                       "response_format": "structured output is not supported with beam search",
                       "allowed_token_ids": "beam search scores the model's own probabilities over every token",
                       "num_assistant_tokens": "beams are not drafted for (speculative decoding is off for them)",
                       "assistant_confidence_threshold": "beams are not drafted for"}.get(
                    name, "beam search scores beams by the model's own log-probabilities, so this sampling "
                          "parameter would be ignored (temperature may be 0 or 1)")
                raise InvalidRequestError(name, why)


def _int_range(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequestError(name, f"must be an integer in [{low}, {high}], got {value!r}")


def _float_range(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low < value if low_open else low <= value) and value <= high
    if not ok:
        raise InvalidRequestError(name, f"must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")


def _token(name: str, value: Any, vocab_size: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
        raise InvalidRequestError(name, f"token id {value!r} is outside the vocabulary [0, {vocab_size})")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


_seq_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Sequence:
    """One generated sample. Its KV entries live in `pages` (page ids, in token order)."""

    request_id: str
    token_ids: list[int]  # prompt followed by output
    num_prompt_tokens: int
    params: SamplingParams
    max_total_tokens: int  # prompt + max_tokens, capped by the context limit
    priority: int = 0  # lower runs first; ties by arrival
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    sample_index: int = 0  # which of the request's n / best_of samples
    seed: int = 0  # this sample's sampling seed (the request's seed + sample_index, or random)
    seq_id: int = dataclasses.field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pages
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop id or string that matched
    cumulative_logprob: float = 0.0
    matcher: "Matcher | None" = None  # this sample's walk through params.grammar
    drafter: "NgramDrafter | None" = None  # proposes its speculative tokens (jaxserve.engine.ngram)
    num_draft_tokens: int = 0  # speculative tokens proposed for it so far
    num_accepted_draft_tokens: int = 0  # of which verify steps accepted
    slot: int | None = None  # its row of the device batch while running (the scheduler's)
    beam: "BeamSearch | None" = None  # the beam search it is a beam of (jaxserve.engine.beam)
    # Prompt positions whose input is an embedding (images, input_embeds), and the prompt's
    # prefix-cache keys that go with them (jaxserve.engine.embeds.cache_ids; None: the token ids).
    embeds: "tuple[EmbedSpan, ...]" = ()
    prompt_keys: list[int] | None = None
    # An M-RoPE model's prompt positions ([3, prompt tokens]: temporal, height, width; None: each
    # axis at the token's index) and the offset every later token's position takes (index + delta).
    rope_positions: Any = None
    rope_delta: int = 0
    # Its LoRA adapter's load (jaxserve.engine.lora_slots.LoadedLora.key): the prefix cache's
    # pages of its prompt are that load's alone. None: the base model.
    lora_key: str | None = None
    # A LongRoPE model's: whether its tokens rotate by the long factors (set when admitted, for
    # good once the sequence is longer than the model's original_max_position; see
    # jaxserve.engine.scheduler). Its cached pages are kept apart from the short ones'.
    long_rope: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def cache_ids(self) -> list[int]:
        """What the prefix cache keys its pages by: the token ids, with embedded positions keyed
        by their content."""
        if self.prompt_keys is None:
            return self.token_ids
        return self.prompt_keys + self.token_ids[self.num_prompt_tokens:]

    def cache_keys(self, start: int, end: int) -> list[int]:
        """cache_ids[start:end], without building the whole list."""
        if self.prompt_keys is None:
            return self.token_ids[start:end]
        cut = self.num_prompt_tokens
        return self.prompt_keys[start:min(end, cut)] + self.token_ids[max(start, cut):end]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_dynamic_bans(self) -> bool:
        """Whether it has multi-token bad words: what they ban depends on its last tokens."""
        return any(len(w) > 1 for w in self.params.bad_words_ids or ())

    @property
    def runs_unattended(self) -> bool:
        """Whether the device can sample several tokens in a row for it with no host check in
        between: no grammar (its mask changes with every token) and no dynamic bans. Stop
        strings are checked afterwards. Beams wait for the host's choice after every token."""
        return self.matcher is None and not self.has_dynamic_bans and self.beam is None

    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival, self.seq_id)
