"""Beam search through the real scheduler and page allocator, with a fake model (top-20 logprobs
drawn from a hash of the tokens) and fake KV pages (no jax): every write goes to the sequence's own,
unshared page through a device page table kept as the input builder keeps it (`cut`, `added`,
`copies` applied before the step), every computed position holds the sequence's own token, the
scheduler's invariants hold after every step, every page and slot comes back, and the beams equal
those of the same search run with no scheduler at all: under tight caches (forks that cannot get
pages, preemption of whole groups, beams resumed one after another), beside other requests, with
and without prefix caching. Scenarios that once deadlocked run to the end."""

from __future__ import annotations

import hashlib
import math
import random

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.engine.beam import BeamSearch
from jaxserve.engine.pages import PageAllocator
from jaxserve.engine.request import FinishReason, SamplingParams, Sequence, SequenceStatus
from jaxserve.engine.scheduler import Scheduler

VOCAB, EOS = 60, 0


def tops_of(tokens: list[int], eos_boost: float = 0.0) -> list[tuple[int, float]]:
    """A fake model's next-token logprobs after `tokens`, best first (the same tokens, the same answer)."""
    r = random.Random(int(hashlib.sha256(repr(tokens).encode()).hexdigest(), 16))
    logits = [r.gauss(0, 2) for _ in range(VOCAB)]
    logits[EOS] += eos_boost
    m = max(logits)
    lse = m + math.log(sum(math.exp(x - m) for x in logits))
    return sorted(((t, x - lse) for t, x in enumerate(logits)), key=lambda p: -p[1])


class Sim:
    """The engine loop over a real Scheduler, with fake device state (see the module docstring)."""

    def __init__(self, num_pages: int, page_size: int, prefix: bool = True, **cfg):
        cfg = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_prefill_seqs": 4, "max_model_len": 512, **cfg}
        self.alloc = PageAllocator(num_pages, page_size, prefix)
        self.s = Scheduler(SchedulerConfig(**cfg), self.alloc, page_size)
        self.ps = page_size
        self.kv: dict[tuple[int, int], int] = {}
        self.table: dict[int, dict[int, int]] = {}
        self.synced: dict[int, int] = {}
        self.boost: dict[str, float] = {}
        self.results: dict[str, list] = {}

    def add_beam(self, rid: str, prompt: list[int], width: int, n: int, max_tokens: int, eos_boost: float = 0.0,
                 lp: float = 1.0, es: bool | str = False) -> None:
        total = self.s.check_fits(len(prompt), max_tokens)
        self.s.check_beam_fits(len(prompt), total, width)
        group = BeamSearch(width, n, total - len(prompt), [EOS], lp, es)
        params = SamplingParams(use_beam_search=True, best_of=width, n=n, max_tokens=max_tokens)
        seq = Sequence(rid, list(prompt), len(prompt), params, total, beam=group)
        self.s.start_beams(group, seq)
        self.s.add(seq)
        self.boost[rid] = eos_boost

    def add_plain(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        total = self.s.check_fits(len(prompt), max_tokens)
        self.s.add(Sequence(rid, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens), total))

    def _compute(self, seq: Sequence, start: int, end: int) -> None:
        table = self.table.setdefault(seq.slot, {})
        for i in range(self.synced.get(seq.slot, 0), len(seq.pages)):
            table[i] = seq.pages[i]
        self.synced[seq.slot] = max(self.synced.get(seq.slot, 0), len(seq.pages))
        for pos in range(start, end):
            page = table[pos // self.ps]
            assert page == seq.pages[pos // self.ps], f"stale device page table: seq {seq.seq_id}, position {pos}"
            assert self.alloc.ref_count(page) == 1, f"write into shared page {page}"
            self.kv[page, pos % self.ps] = seq.token_ids[pos]
        got = [self.kv.get((table[p // self.ps], p % self.ps)) for p in range(end)]
        assert got == seq.token_ids[:end], f"seq {seq.seq_id} reads K/V of other tokens"

    def step(self) -> None:
        plan = self.s.schedule()
        for src, dst in plan.copies:
            for o in range(self.ps):
                if (src, o) in self.kv:
                    self.kv[dst, o] = self.kv[src, o]
                else:
                    self.kv.pop((dst, o), None)
        for slot, kept in plan.cut:
            self.synced[slot] = min(self.synced.get(slot, 0), kept)
        for seq in plan.added:
            self.synced[seq.slot] = 0
        reported, decoded = [], {}
        for chunk in plan.prefills:
            self._compute(chunk.seq, chunk.start, chunk.end)
            if chunk.samples:
                if chunk.seq.beam is not None:
                    reported.append(chunk.seq)
                else:
                    chunk.seq.token_ids.append(tops_of(chunk.seq.token_ids)[0][0])
        for seq in plan.decodes:
            self._compute(seq, seq.num_tokens - 1, seq.num_tokens)
            decoded[seq] = 1
            if seq.beam is not None:
                reported.append(seq)
            else:
                seq.token_ids.append(tops_of(seq.token_ids)[0][0])
        for seq in reported:
            seq.beam.reported[seq] = tops_of(seq.token_ids, self.boost[seq.request_id])[:20]
        self.s.advance(plan, decoded)
        for seq in [c.seq for c in plan.prefills if c.samples] + plan.decodes:
            if seq.beam is None and not seq.is_finished and seq.num_tokens >= seq.max_total_tokens:
                self.s.finish(seq, FinishReason.LENGTH)
        for group in {id(s.beam): s.beam for s in reported}.values():
            if all(m.status is SequenceStatus.RUNNING and m in group.reported for m in group.members):
                continuations = group.step([group.reported[m] for m in group.members],
                                           [m.output_ids for m in group.members])
                if not group.done:
                    self.s.fork_beams(group, continuations)
                    continue
                for m in group.members:
                    self.s.finish(m, FinishReason.STOP)
                self.results[group.members[0].request_id] = [(h.token_ids, h.score) for h in group.results()]
        self.s.check_integrity()

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                break
            self.step()
        else:
            raise AssertionError(f"not done after {max_steps} steps (a deadlock): running "
                                 f"{[(x.seq_id, x.num_computed_tokens, x.num_tokens) for x in self.s.running]}, "
                                 f"waiting {[(x.seq_id, x.num_tokens) for x in self.s.waiting]}")
        self.s.check_idle_integrity()


def reference(prompt: list[int], width: int, n: int, max_tokens: int, eos_boost: float = 0.0, lp: float = 1.0,
              es: bool | str = False) -> list:
    """The same search with no scheduler: every beam's tokens at hand."""
    group = BeamSearch(width, n, max_tokens, [EOS], lp, es)
    beams = [list(prompt)]
    while True:
        continuations = group.step([tops_of(b, eos_boost)[:20] for b in beams], [b[len(prompt):] for b in beams])
        if group.done:
            return [(h.token_ids, h.score) for h in group.results()]
        beams = [beams[c.parent] + [c.token] for c in continuations]


@pytest.mark.parametrize("seed", range(60))
def test_beams_under_pressure_equal_the_search_without_a_scheduler(seed):
    r = random.Random(seed)
    page_size = r.choice([2, 4, 8])
    prefix = r.random() < 0.7
    requests = []
    for i in range(r.randint(1, 3)):
        width = r.randint(1, 5)
        requests.append((f"b{i}", [r.randrange(1, VOCAB) for _ in range(r.randint(1, 12))], width,
                         r.randint(1, width), r.randint(1, 14), r.choice([0.0, 2.0, 4.0]),
                         r.choice([1.0, 0.0, 2.0]), r.choice([False, True, "never"])))
    # Enough pages for the largest search alone (check_beam_fits' bound), and no more than twice that.
    def need(prompt, width, max_tokens):
        shared = len(prompt) // page_size if prefix else 0
        return shared + width * (-(-(len(prompt) + max_tokens) // page_size) - shared)
    most = max(need(p, w, m) for _, p, w, _, m, *_ in requests)
    sim = Sim(most + 1 + r.randint(0, most), page_size, prefix)
    for rid, prompt, width, n, max_tokens, boost, lp, es in requests:
        sim.add_beam(rid, prompt, width, n, max_tokens, boost, lp, es)
        if r.random() < 0.5:
            sim.add_plain(f"p{rid}", [r.randrange(1, VOCAB) for _ in range(r.randint(1, 6))], r.randint(1, 8))
    sim.run()
    for rid, prompt, width, n, max_tokens, boost, lp, es in requests:
        assert sim.results[rid] == reference(prompt, width, n, max_tokens, boost, lp, es)


def test_a_group_resumed_beside_a_plain_request_finishes():
    # Once deadlocked: the resumed beams each recomputed the prompt and held every page.
    sim = Sim(6, 4, True)
    sim.add_plain("p", [27, 45, 22, 57, 10, 28], 8)
    prompt = [56, 14, 59, 59, 1, 14, 14, 3, 23]
    sim.add_beam("c", prompt, 3, 1, 2)
    sim.run()
    assert sim.results["c"] == reference(prompt, 3, 1, 2)


@pytest.mark.parametrize("prefix", [True, False])
def test_a_search_that_exactly_fits_finishes(prefix):
    for width, max_tokens, page_size, prompt_len in [(2, 4, 4, 4), (3, 6, 4, 5), (4, 10, 4, 6), (3, 12, 8, 9)]:
        for seed in range(5):
            prompt = [1 + (seed * 7 + i) % 50 for i in range(prompt_len)]
            shared = prompt_len // page_size if prefix else 0
            pages = shared + width * (-(-(prompt_len + max_tokens) // page_size) - shared)
            sim = Sim(pages + 1, page_size, prefix)
            sim.add_beam("a", prompt, width, 1, max_tokens)
            sim.run(500)
            assert sim.results["a"] == reference(prompt, width, 1, max_tokens)
