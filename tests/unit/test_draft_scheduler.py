"""Draft-model speculation's bookkeeping without jax: the real Scheduler and StepInputBuilder drive
two fake devices (the target's and the draft's page tables and per-position token records) through
the commands a DraftingRunner runs, with random acceptance, end ids, confidence cuts, penalty rows,
num_assistant_tokens 0, n = 2 siblings, prefix hits, preemption and chunked prefill. Before every
draft loop the draft's cache must hold the row's own token at every position it reads; no
placeholder (-1) may reach a device; the loop never writes outside the row's pages."""

from __future__ import annotations

import random

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.engine.buckets import BucketTable
from jaxserve.engine.pages import PageAllocator
from jaxserve.engine.request import FinishReason, SamplingParams, Sequence
from jaxserve.engine.rows import row_params
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_inputs import StepInputBuilder

PS, K, VOCAB = 4, 3, 50


class Device:
    """A runner's page table and K/V, as (token, position) records per page offset."""

    def __init__(self, name: str, num_slots: int, problems: list[str]):
        self.name, self.num_slots, self.problems = name, num_slots, problems
        self.table: dict[int, dict[int, int]] = {}
        self.kv: dict[int, dict[int, tuple[int, int]]] = {}

    def set_page(self, slot: int, index: int, page: int) -> None:
        if slot < self.num_slots:
            self.table.setdefault(slot, {})[index] = page

    def write(self, slot: int, pos: int, token: int, what: str) -> None:
        if token == -1:
            self.problems.append(f"{self.name}: a placeholder reached the device at slot {slot}, position {pos} ({what})")
        page = self.table.get(slot, {}).get(pos // PS)
        if page is None:
            self.problems.append(f"{self.name}: no page-table entry for slot {slot}, position {pos} ({what})")
            return
        self.kv.setdefault(page, {})[pos % PS] = (token, pos)

    def read(self, slot: int, pos: int) -> tuple[int, int] | None:
        page = self.table.get(slot, {}).get(pos // PS)
        return None if page is None else self.kv.get(page, {}).get(pos % PS)

    def run(self, key: tuple, p: dict) -> None:
        """What the device does with a command's payload (tokens and page tables only)."""
        kind = key[0]
        if kind == "copy":
            for src, dst in zip(p["src"], p["dst"]):
                self.kv[int(dst)] = dict(self.kv.get(int(src), {}))
        elif kind == "rows":
            for slot in p["slots"]:
                if slot < self.num_slots:
                    self.table[int(slot)] = {}
        elif kind == "pages":
            for slot, index, page in zip(p["slots"], p["index"], p["pages"]):
                self.set_page(int(slot), int(index), int(page))
        elif kind in ("prefill", "verify", "decode"):
            for slot, index, page in zip(p["page_slots"], p["page_index"], p["page_ids"]):
                self.set_page(int(slot), int(index), int(page))
            n = int(p["num_seqs"])
            if kind == "decode":
                for i in range(n):
                    self.write(int(p["row_slots"][i]), int(p["positions"][i]), int(p["tokens"][i]), kind)
            else:
                cu = p["cu_q_lens"]
                for i in range(n):
                    for t in range(cu[i], cu[i + 1]):
                        self.write(int(p["row_slots"][i]), int(p["positions"][t]), int(p["tokens"][t]), kind)


def _requests(rng: random.Random, sched: Scheduler) -> None:
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    for r in range(6):
        prompt = shared[: rng.randrange(5, 12)] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 6))]
        extra: dict = {}
        c = rng.random()
        if c < 0.2:
            extra["repetition_penalty"] = 1.3  # does not speculate
        elif c < 0.35:
            extra["num_assistant_tokens"] = rng.randrange(0, K + 1)
        n = 2 if rng.random() < 0.3 else 1
        p = SamplingParams(temperature=0.0, max_tokens=rng.randrange(5, 30), n=n, **extra)
        total = min(len(prompt) + p.max_tokens, 64)
        for i in range(n):
            sched.add(Sequence(request_id=f"r{r}", token_ids=list(prompt), num_prompt_tokens=len(prompt), params=p,
                               max_total_tokens=total, sample_index=i))


@pytest.mark.parametrize("seed", range(40))
def test_the_draft_cache_follows_the_target(seed):
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_seqs=2, max_model_len=64,
                             speculative_method="draft", num_speculative_tokens=K)
    sched = Scheduler(config, PageAllocator(14, PS, True), PS)
    slots = config.max_num_seqs + 1
    builder = StepInputBuilder(num_slots=slots, vocab_size=VOCAB, page_size=PS, max_pages_per_seq=16,
                               buckets=BucketTable(config), max_prefill_seqs=2, decode_steps=1,
                               row_params=lambda s: row_params(s, [0]), num_speculative_tokens=K, draft_model=True)
    problems: list[str] = []
    target, draft = Device("target", slots, problems), Device("draft", slots, problems)
    _requests(rng, sched)
    for step in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        if out.is_empty:
            continue
        commands = builder.build(out)
        loop = commands.draft_loop
        sampled: dict[Sequence, list[int]] = {}
        for command in commands.commands:
            p = command.payload
            if command.key[0] == "verify" and loop is not None:
                for seq, _ in loop.rows:  # what the draft loop reads
                    for pos in range(seq.num_tokens - 1):
                        if draft.read(seq.slot, pos) != (seq.token_ids[pos], pos):
                            problems.append(f"step {step}: the draft cache misses slot {seq.slot}, position {pos}")
                            break
                # The draft loop (DraftingRunner runs it on the draft's device), then the drafts.
                lp = loop.command.payload
                for i, (seq, start) in enumerate(loop.rows):
                    token, got = int(lp["tokens"][i]), []
                    for j in range(min(int(lp["num_steps"]), int(lp["remaining"][i]))):
                        pos = int(lp["positions"][i]) + j
                        if pos // PS >= len(seq.pages) or draft.table.get(seq.slot, {}).get(pos // PS) != seq.pages[pos // PS]:
                            problems.append(f"step {step}: the draft loop writes outside slot {seq.slot}'s pages")
                        draft.write(seq.slot, pos, token, "draft loop")
                        token = rng.randrange(0, VOCAB)
                        got.append(token)
                        if token == 0 and rng.random() < 0.5:
                            break  # an end id ends the row inside the loop
                    want = len(loop.drafts.get(seq, ()))
                    if want:
                        got = got[:want]
                        if rng.random() < 0.2:
                            got = got[: rng.randrange(0, len(got) + 1)]  # a confidence cut
                        p["tokens"][start:start + want] = got + [got[-1] if got else 0] * (want - len(got))
                        loop.drafts[seq] = got
            target.run(command.key, p)
            draft.run(command.key, p)
            if command.key[0] == "verify":  # random acceptance: drafts up to a miss, then the target's own
                cu = p["cu_q_lens"]
                for i, seq in enumerate(out.decodes):
                    drafts = [int(x) for x in p["tokens"][cu[i] + 1:cu[i + 1]]]
                    kept = rng.randrange(0, len(drafts) + 1)
                    own = rng.randrange(1, VOCAB)
                    if kept < len(drafts) and own == drafts[kept]:
                        own = own % (VOCAB - 1) + 1
                    sampled[seq] = drafts[:kept] + [own]
        for chunk in out.prefills:
            if chunk.samples:
                chunk.seq.token_ids.append(rng.randrange(1, VOCAB))
        decoded = {}
        for seq in out.decodes:
            tokens = sampled.get(seq, [rng.randrange(1, VOCAB)])[: seq.max_total_tokens - seq.num_tokens]
            seq.token_ids += tokens
            decoded[seq] = len(tokens)
        sched.advance(out, decoded)
        for seq in list(sched.running):
            if seq.num_tokens >= seq.max_total_tokens or rng.random() < 0.01:
                sched.finish(seq, FinishReason.STOP)
        sched.check_integrity()
    assert not sched.has_unfinished()
    assert not problems, problems[:5]
