"""What a request gets back, and the per-sequence text state that produces it: incremental
detokenizing, stop strings matched across token boundaries, and held-back text.

Plain Python (no jax): the engine feeds tokens in, takes deltas out.
"""

from __future__ import annotations

import dataclasses

from jaxserve.engine.request import Sequence
from jaxserve.tokenizer import IncrementalDetokenizer, NoTextDetokenizer, Tokenizer


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first; empty unless top-N was asked
    rank: int | None = None  # the token's rank in the vocabulary (1 = most likely); prompt logprobs only


@dataclasses.dataclass
class CompletionOutput:
    """One sample's output: a delta while streaming, the whole output in `LLM.generate`."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    cumulative_logprob: float = 0.0


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Speculative decoding, the request's totals so far over its samples: draft tokens proposed,
    # and how many of them the verify steps accepted (both 0 when nothing was drafted).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # Per prompt token (None where not requested); set on the first delta only.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt: str | None = None  # the offline API's text prompt, as vLLM's outputs carry it

    def merge(self, delta: "RequestOutput") -> None:
        """Fold a later delta into this accumulated output (used by the offline API)."""
        by_index = {o.index: o for o in self.outputs}
        for d in delta.outputs:
            acc = by_index.get(d.index)
            if acc is None:
                self.outputs.append(dataclasses.replace(d, token_ids=list(d.token_ids),
                                                        logprobs=list(d.logprobs) if d.logprobs is not None else None))
                continue
            acc.text += d.text
            acc.token_ids += d.token_ids
            if d.logprobs is not None:
                acc.logprobs = (acc.logprobs or []) + d.logprobs
            acc.finish_reason, acc.stop_reason = d.finish_reason, d.stop_reason
            acc.cumulative_logprob = d.cumulative_logprob
        self.outputs.sort(key=lambda o: o.index)
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_draft_tokens = delta.num_draft_tokens
        self.num_accepted_draft_tokens = delta.num_accepted_draft_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


class SequenceText:
    """Turns one sequence's sampled tokens into text deltas, applying stop strings.

    Text that could still turn out to be the start of a stop string is held back (at most
    len(longest stop) - 1 characters), so a stop string is never streamed and then retracted.
    """

    def __init__(self, seq: Sequence, tokenizer: Tokenizer | None):
        p = seq.params
        self.detok: IncrementalDetokenizer | NoTextDetokenizer
        if tokenizer is None:
            # No tokenizer (LLM(skip_tokenizer_init=True)): a detokenizer that yields no text is
            # the one place that knows, so stop checks, held text and deltas run unchanged and
            # every output's text is "" (vLLM's). Stop strings are refused when the request is added.
            self.detok = NoTextDetokenizer()
        else:
            # A few prompt tokens give the first output token its left context.
            self.detok = IncrementalDetokenizer(
                tokenizer, p.skip_special_tokens, p.spaces_between_special_tokens, prompt_tail=seq.prompt_ids[-4:]
            )
        self.stops = list(p.stop)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.include_stop = p.include_stop_str_in_output
        self.text = ""  # all stable text so far (truncated at a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        # The finish went out in a delta: a request's other samples may still be running, and a
        # finished one must not be reported again in their deltas (one finish per choice, as
        # OpenAI streams; metrics count each sample's finish once).
        self.finish_sent = False

    def add(self, token: int, logprob: TokenLogprob | None, check_stops: bool, show_text: bool = True) -> str | None:
        """Feed one token. Returns the stop string if one now matched (the text is cut there)."""
        self.pending_ids.append(token)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        if not show_text:
            return None
        before = len(self.text)
        self.text += self.detok.add([token])
        if not (check_stops and self.stops):
            return None
        return self._match_stop(max(0, before - self.hold))

    def _match_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop) if self.include_stop else at]
        return stop

    def finish_text(self, stopped_by_string: bool) -> None:
        """At the end, release what the detokenizer still held (unless a stop string cut the text)."""
        if not stopped_by_string:
            before = len(self.text)
            self.text += self.detok.finish()
            if self.stops:
                self._match_stop(max(0, before - self.hold))

    def delta(self, seq: Sequence, index: int, want_logprobs: bool) -> CompletionOutput | None:
        """The output since the last delta, or None when there is nothing new to say."""
        if self.finish_sent:
            return None
        limit = len(self.text) if seq.is_finished else max(self.emitted, len(self.text) - self.hold)
        if not seq.is_finished and limit == self.emitted and not self.pending_ids:
            return None
        out = CompletionOutput(
            index=index,
            text=self.text[self.emitted : limit],
            token_ids=self.pending_ids,
            logprobs=self.pending_logprobs if want_logprobs else None,
            finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
            stop_reason=seq.stop_reason,
            cumulative_logprob=seq.cumulative_logprob,
        )
        self.emitted = limit
        self.pending_ids, self.pending_logprobs = [], []
        self.finish_sent = seq.is_finished
        return out
