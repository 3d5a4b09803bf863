"""Every way a sequence ends, in one place (no jax).

Tokens come back from the device 0..K per row. `accept` takes them into their sequence in order
and settles the endings the next step's plan depends on: the grammar (a complete match, or a
matcher that failed), EOS and stop token ids (past min_tokens), and length (max_tokens or the
context). `emit` then does the text side, which may overlap the next step: incremental
detokenizing, stop strings (matched across token boundaries; a match ends the sequence and drops
whatever it sampled after the match, exactly), logprob objects and the request's delta. An abort
ends a sequence from outside (`Engine.abort`). A sequence's finish reason is set exactly once,
by whichever ending comes first in token order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

from jaxserve.engine.output import CompletionOutput, RequestOutput, SequenceText, TokenLogprob
from jaxserve.engine.request import FinishReason, SamplingParams, Sequence

log = logging.getLogger("jaxserve.engine")


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    texts: list[SequenceText]
    arrival: float
    # prompt_logprobs[i]: logprob of prompt token i given the tokens before it (None before the
    # requested start and for token 0); filled by sample 0's prefill, sent once with its first token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False


@dataclasses.dataclass
class Accepted:
    """One sampled token taken into its sequence, waiting for its text (`emit`)."""

    seq: Sequence
    token: int | None  # None: the grammar stopped the sequence (its final delta is still due)
    index: int = 0  # its place in seq.token_ids
    logprob: float = 0.0
    top: list[tuple[int, float]] | None = None  # top-N (id, logprob) when the request asked for logprobs
    reason: FinishReason | None = None  # EOS, stop token or length, decided when the token was taken
    past_min: bool = False  # min_tokens reached: stop strings may end the sequence


class Postprocessor:
    def __init__(self, eos_ids: Iterable[int], finish: Callable[[Sequence, FinishReason], None]):
        self.eos_ids = frozenset(eos_ids)
        self.finish = finish  # the scheduler's: frees the pages and slot, sets the reason once

    # ---- the token side (before the next step is planned) ----------------------------------------
    def accept(self, seq: Sequence, tokens: Iterable[int], logprobs: Iterable[float],
               tops: Iterable[list[tuple[int, float]] | None]) -> list[Accepted]:
        """Take a row's sampled tokens, in order, until one ends the sequence."""
        taken = []
        for token, logprob, top in zip(tokens, logprobs, tops):
            a = self._accept_one(seq, int(token), float(logprob), top)
            taken.append(a)
            if seq.is_finished:
                break
        return taken

    def _accept_one(self, seq: Sequence, token: int, logprob: float, top: list | None) -> Accepted:
        p = seq.params
        grammar_done = False
        if seq.matcher is not None:
            # A complete match ends here whatever ignore_eos / min_tokens say: the grammar allows
            # nothing else, and the masks never let EOS through before the match is complete.
            grammar_done = token in self.eos_ids and seq.matcher.is_accepting()
            if not grammar_done and not seq.matcher.advance(token):
                # Only a matcher that hit its own limits gets here (its mask was empty).
                error = seq.matcher.error() or f"token {token} is outside the grammar"
                log.error("request %s: structured output stopped: %s", seq.request_id, error)
                seq.stop_reason = f"structured output failed: {error}"
                self.finish(seq, FinishReason.ABORT)
                return Accepted(seq, None)
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        reason: FinishReason | None = None
        past_min = seq.num_output_tokens > p.min_tokens
        if grammar_done or (token in self.eos_ids and not p.ignore_eos and past_min):
            reason = FinishReason.STOP
        elif token in p.stop_token_ids and past_min:
            reason, seq.stop_reason = FinishReason.STOP, token
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= seq.max_total_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.finish(seq, reason)
        return Accepted(seq, token, seq.num_tokens - 1, logprob, top, reason, past_min)

    # ---- the text side (may overlap the next step) ------------------------------------------------
    def emit(self, accepted: list[Accepted], requests: dict[str, Request]) -> list[RequestOutput]:
        """Detokenize, match stop strings, build the deltas of every touched request."""
        touched: dict[str, Request] = {}
        stopped: set[int] = set()  # sequences a stop string ended in this batch
        for a in accepted:
            seq, p = a.seq, a.seq.params
            req = requests.get(seq.request_id)
            if req is None:
                continue
            touched[seq.request_id] = req
            text = req.texts[seq.sample_index]
            if seq.seq_id in stopped:  # sampled after its stop string in the same step: dropped
                seq.cumulative_logprob -= a.logprob
                continue
            if a.token is None:  # the grammar stopped it: release the held text
                text.finish_text(stopped_by_string=False)
                continue
            logprob = TokenLogprob(a.token, a.logprob, a.top or []) if p.logprobs is not None else None
            # The text of an ending token (EOS, stop token) is shown only with
            # include_stop_str_in_output (SGLang's no_stop_trim), as vLLM and SGLang do; a length
            # ending's always is.
            show = a.reason is None or a.reason is FinishReason.LENGTH or (
                p.include_stop_str_in_output and a.reason is FinishReason.STOP)
            matched = text.add(a.token, logprob, check_stops=a.past_min, show_text=show)
            if matched is not None:
                # A stop string wins over a length ending on the same token, as if it had been
                # seen first; the sequence may have run more steps, whose tokens are dropped.
                seq.stop_reason = matched
                stopped.add(seq.seq_id)
                del seq.token_ids[a.index + 1:]
                if seq.is_finished:
                    seq.finish_reason = FinishReason.STOP
                else:
                    self.finish(seq, FinishReason.STOP)
            if matched is not None or a.reason is not None:
                text.finish_text(stopped_by_string=matched is not None)
        return [o for req in touched.values() if (o := request_delta(req, requests)) is not None]


def request_delta(req: Request, requests: dict[str, Any]) -> RequestOutput | None:
    """The request's output since its last delta (None when there is nothing new); a finished
    request leaves `requests`. best_of > n streams nothing and returns the n best samples whole."""
    hide = req.params.best_of is not None and req.params.best_of > req.params.n  # choose at the end
    finished = all(s.is_finished for s in req.seqs)
    want_logprobs = req.params.logprobs is not None
    outputs: list[CompletionOutput] = []
    if not hide:
        for i, (seq, text) in enumerate(zip(req.seqs, req.texts)):
            d = text.delta(seq, i, want_logprobs)
            if d is not None:
                outputs.append(d)
    elif finished:
        best = sorted(range(len(req.seqs)), key=lambda i: -req.seqs[i].cumulative_logprob)[: req.params.n]
        for rank, i in enumerate(best):
            req.texts[i].emitted = 0  # nothing was streamed: the chosen samples go out whole
            d = req.texts[i].delta(req.seqs[i], rank, want_logprobs)
            d.token_ids = req.seqs[i].output_ids
            outputs.append(d)
    if finished:
        requests.pop(req.request_id, None)
    if not outputs and not finished:
        return None
    prompt_logprobs = None
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
        prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
    return RequestOutput(req.request_id, req.prompt_ids, outputs, finished, req.seqs[0].num_cached_tokens,
                         num_draft_tokens=sum(s.num_draft_tokens for s in req.seqs),
                         num_accepted_draft_tokens=sum(s.num_accepted_draft_tokens for s in req.seqs),
                         prompt_logprobs=prompt_logprobs)
