"""Speculative decoding with a draft model: two runners, one set of page ids.

The draft model (any model jaxserve loads with the target's vocabulary: a smaller model of the
family, or the same checkpoint at lower precision) keeps its own KV cache with as many pages as the
target's, and takes every command the target takes (row updates, page tables, prefill, decode,
verify, page copies), so its cache holds the K/V of exactly the tokens the target's does, at the
same page ids: the scheduler, the prefix cache and preemption need to know nothing of it.

A verify step is preceded by the draft model's own decode loop (`StepCommands.draft_loop`), run
for as many iterations as the rows have draft placeholders. Its rows sample with their requests'
parameters and the same (seed, step) keys as the target's draws, so a greedy row drafts the draft
model's greedy tokens and a sampled row the draft model's draw under the same noise: the tokens
most likely to equal what the target will draw. Those become the verify step's drafts, and the
verify step keeps exactly the target's own draws (jaxserve.engine.programs), so outputs never
depend on the draft model; only how many tokens a step yields does. The target's verify step,
run on the draft model too, writes the draft's K/V of every verified position, so the next loop
starts from the kept tokens whatever was accepted.

`assistant_confidence_threshold` (OVMS) ends a row's drafts at the first token whose probability
under the draft model is below it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxserve.engine.runner import ModelRunner, StepHandle
from jaxserve.engine.step_inputs import DraftLoop, Key, Payload, StepCommands
from jaxserve.parallel.multihost import to_host


class DraftingRunner:
    """The engine's runner when a draft model drafts: the target's runner, with the draft's beside it."""

    def __init__(self, target: ModelRunner, draft: ModelRunner) -> None:
        self.target = target
        self.draft = draft
        self.channel: Any = None  # one host only (multi-host drafting is refused at start-up)

    def compile(self, keys: list[Key], abstract: Callable[[Key], dict]) -> dict[Key, float]:
        seconds = self.target.compile(keys, abstract)
        self.draft.compile(keys, abstract)
        return seconds

    @property
    def compiled_steps(self) -> dict[Key, Any]:
        return self.target.compiled_steps

    @property
    def min_rows(self) -> int:
        return self.target.min_rows

    @property
    def graphdef(self) -> Any:  # the served model's (LLM reads its weights back)
        return self.target.graphdef

    @property
    def params(self) -> Any:
        return self.target.params

    def write_lora_slot(self, slot: int, rank: int, factors: dict) -> None:  # the served model's adapters
        self.target.write_lora_slot(slot, rank, factors)

    def execute(self, step: StepCommands) -> StepHandle:
        outputs = {}
        for command in step.commands:
            if command.key[0] == "verify" and step.draft_loop is not None:
                self._draft(step.draft_loop, command.payload)
            out = self.target.call(command.key, command.payload)
            self.draft.call(command.key, command.payload)  # its cache follows the target's, token for token
            if out is not None:
                outputs[command.key] = out
        return StepHandle(outputs.get(step.prefill) if step.prefill else None,
                          outputs.get(step.decode) if step.decode else None)

    def _draft(self, loop: DraftLoop, verify: Payload) -> None:
        """Run the draft loop and write its tokens into the verify step's placeholders (and into
        the plan's drafts, which count acceptance). Placeholders the loop did not fill (it stopped
        at an end id, or confidence fell) keep a filler token: the verify step keeps only the
        target's own draws, so a filler changes nothing but what is counted."""
        out = to_host(self.draft.call(loop.command.key, loop.command.payload))
        tokens, logprobs, num = np.asarray(out.sample.token), np.asarray(out.sample.logprob), np.asarray(out.num_sampled)
        for i, (seq, start) in enumerate(loop.rows):
            want = len(loop.drafts.get(seq, ()))
            if not want:
                continue
            got = tokens[: min(want, int(num[i])), i].tolist()
            threshold = seq.params.assistant_confidence_threshold
            if threshold is not None:
                # The loop ended the row at its first token below the threshold: not a draft.
                low = next((j for j, lp in enumerate(logprobs[: len(got), i]) if math.exp(lp) < threshold), len(got))
                got = got[:low]
            verify["tokens"][start:start + want] = got + [got[-1] if got else 0] * (want - len(got))
            loop.drafts[seq] = got  # (kept even when empty: the scheduler gives the pages back)

    def close(self) -> None:
        self.target.close()
