"""Beam search on the host (no jax): which continuations a request's beams keep after each step.

The engine runs a beam request's beams as ordinary rows of its batches, one sequence (one slot)
per live beam, in lockstep: every step, each beam's row reports the model's top log-probabilities
of its next token (raw: HF scores beams by log_softmax of the logits, and so do we), and once every beam of the request has reported,
`BeamSearch.step` picks the continuations; the scheduler then forks the beams' pages to match
(jaxserve.engine.scheduler). Nothing is re-prefilled and nothing leaves the normal batching.

The rule is Hugging Face transformers' `generate(num_beams=W, num_return_sequences=n,
length_penalty=..., early_stopping=...)` for decoder-only models, step for step:

- Candidates are every beam's tokens, scored by the beam's cumulative logprob plus the token's;
  the best max(2, 1 + E) * W of them are looked at (E: the ids that end a sequence).
- A candidate that ends (an end id, or the last token max_tokens allows) among the best W is a
  finished hypothesis, scored sum_logprobs / generated_length ** length_penalty; the W best
  hypotheses are kept. The best W candidates that do not end are the next step's beams.
- The search ends when every candidate ends (the length limit), when W hypotheses are kept and
  early_stopping is True, or when no running beam can beat the worst kept hypothesis any more
  (early_stopping False: judged at the current length; "never": at max_tokens when
  length_penalty > 0).
- The n best hypotheses are the outputs, best first.

Only the first step differs in form, not in result: a request starts as one beam (HF starts W
copies of the prompt, all but the first scored -1e9, so only the first one's tokens can win).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

import numpy as np

# The sampler reports at most this many alternatives per row (jaxserve.engine.request.MAX_TOP_LOGPROBS);
# every candidate a step looks at must be among them.
CANDIDATES_PER_BEAM = 20

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), best first


def max_beam_width(num_end_ids: int) -> int:
    """The widest beam whose step looks only at candidates the sampler reports: the best
    max(2, 1 + E) * W of all beams' candidates are among each beam's best 20."""
    return CANDIDATES_PER_BEAM // max(2, 1 + num_end_ids)


@dataclasses.dataclass
class Hypothesis:
    """A finished beam: its output tokens and its score."""

    token_ids: list[int]
    logprobs: list[float]  # each token's logprob
    tops: list[TopLogprobs]  # each token's alternatives (its beam's top logprobs)
    score: float  # sum(logprobs) / len(token_ids) ** length_penalty
    ended: bool  # by an end id (else by the length limit)

    @property
    def cumulative_logprob(self) -> float:
        return sum(self.logprobs)


@dataclasses.dataclass
class Path:
    """A running beam's output so far (its tokens are its sequence's; these are the numbers)."""

    logprobs: list[float] = dataclasses.field(default_factory=list)
    tops: list[TopLogprobs] = dataclasses.field(default_factory=list)
    score: float = 0.0  # sum of logprobs


@dataclasses.dataclass(frozen=True)
class Continuation:
    """One of the next step's beams: beam `parent` of this step followed by `token`."""

    parent: int
    token: int
    logprob: float


class BeamSearch:
    """One request's beam search state (its running beams are sequences the scheduler holds)."""

    def __init__(self, width: int, num_returned: int, max_new_tokens: int, end_ids: Iterable[int],
                 length_penalty: float = 1.0, early_stopping: bool | str = False, min_tokens: int = 0):
        if not 1 <= num_returned <= width:
            raise ValueError(f"need 1 <= n <= width, got n={num_returned} and width={width}")
        self.width = width
        self.num_returned = num_returned
        self.max_new_tokens = max_new_tokens
        self.end_ids = frozenset(end_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.min_tokens = min_tokens
        self.paths: list[Path] = [Path()]  # one per running beam, best first
        self.finished: list[Hypothesis] = []  # at most width, best first
        self.num_generated = 0  # tokens each running beam has
        self.improvable = True  # HF's early-stop heuristic is still unsatisfied
        self.done = False
        # Scheduler-owned: the running sequences (beam i is members[i]) and the slots reserved
        # for beams not forked yet.
        self.members: list = []
        self.spare_slots: list[int] = []
        # Each running beam's reported alternatives this step, by sequence, until all have reported.
        self.reported: dict = {}

    @property
    def beams_to_keep(self) -> int:
        return max(2, 1 + len(self.end_ids)) * self.width

    def step(self, tops: SequenceABC[TopLogprobs], outputs: SequenceABC[list[int]]) -> list[Continuation]:
        """Advance by one token. tops[i]: running beam i's best next tokens with their logprobs
        (at least CANDIDATES_PER_BEAM, or the whole distribution); outputs[i]: its output tokens.
        Returns the next step's beams (empty when the search is done)."""
        if self.done:
            raise RuntimeError("the beam search is over")
        if len(tops) != len(self.paths):
            raise ValueError(f"{len(tops)} beams reported, {len(self.paths)} are running")
        banned = self.end_ids if self.num_generated < self.min_tokens else frozenset()
        # Scores add in float32, as HF's do: float64 sums could order near-ties differently.
        candidates = sorted(
            ((float(np.float32(path.score) + np.float32(lp)), i, token, lp)
             for i, (path, top) in enumerate(zip(self.paths, tops)) for token, lp in top if token not in banned),
            key=lambda c: -c[0])[: self.beams_to_keep]
        at_limit = self.num_generated + 1 >= self.max_new_tokens
        length = self.num_generated + 1
        full = len(self.finished) == self.width and self.early_stopping is True
        new_paths: list[Path] = []
        continuations: list[Continuation] = []
        for rank, (score, i, token, lp) in enumerate(candidates):
            ends = at_limit or token in self.end_ids
            parent = self.paths[i]
            if ends:
                # Only the best `width` candidates may finish; the rest are there so that `width`
                # beams that do not end are always found.
                if rank < self.width and self.improvable and not full and score > -math.inf:
                    self._keep(Hypothesis([*outputs[i], token], [*parent.logprobs, lp], [*parent.tops, tops[i]],
                                          float(np.float32(score) / np.float32(length ** self.length_penalty)),
                                          token in self.end_ids))
            elif len(new_paths) < self.width:
                new_paths.append(Path([*parent.logprobs, lp], [*parent.tops, tops[i]], score))
                continuations.append(Continuation(i, token, lp))
        self.num_generated += 1
        self.paths = new_paths
        if len(self.finished) == self.width and new_paths:
            # Can the best running beam still beat the worst kept hypothesis?
            never = self.early_stopping == "never" and self.length_penalty > 0.0
            best_length = self.max_new_tokens if never else self.num_generated
            best = new_paths[0].score / best_length ** self.length_penalty
            self.improvable = self.improvable and best > self.finished[-1].score
        all_finished = len(self.finished) == self.width
        self.done = (at_limit or not new_paths or not self.improvable
                     or (all_finished and self.early_stopping is True))
        return [] if self.done else continuations

    def _keep(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: an earlier hypothesis wins a tie
        del self.finished[self.width:]

    def results(self) -> list[Hypothesis]:
        """The n best hypotheses, best first (the search must be done)."""
        if not self.done:
            raise RuntimeError("the beam search is not over")
        return self.finished[: self.num_returned]
