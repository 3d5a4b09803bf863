"""Scheduler: admission, chunked prefill, prefix hits, preemption by recompute, abort, refusal, n > 1.

A fake engine stands in for the device: it "computes" K/V by writing token ids into a dict keyed by
(page, slot), checks that every step reads back exactly the sequence's own tokens, and samples a
token that is a pure function of the history (like greedy decoding), so preemption and prefix
sharing must not change any output.
"""

import itertools
import random
import subprocess
import sys

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.engine.pages import NULL_PAGE, PageAllocator
from jaxserve.engine.request import FinishReason, SamplingParams, Sequence, SequenceStatus
from jaxserve.errors import InvalidRequestError, RequestTooLongError
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput

_request_ids = itertools.count()


def next_token(history: list[int]) -> int:
    return (sum(history) * 7 + len(history)) % 1000


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeEngine:
    def __init__(self, num_pages: int = 64, page_size: int = 4, prefix_caching: bool = True, **config):
        config = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_prefill_seqs": 4, **config}
        self.alloc = PageAllocator(num_pages, page_size, prefix_caching)
        self.sched = Scheduler(SchedulerConfig(**config), self.alloc, page_size)
        self.kv: dict[tuple[int, int], int] = {}
        self.plans: list[SchedulerOutput] = []

    def submit(self, prompt: list[int], max_tokens: int = 4, n: int = 1, **seq_fields) -> list[Sequence]:
        total = self.sched.check_fits(len(prompt), max_tokens)
        params = SamplingParams(n=n, max_tokens=max_tokens)
        request_id = f"req-{next(_request_ids)}"
        seqs = [
            Sequence(request_id, list(prompt), len(prompt), params, total, sample_index=i, **seq_fields)
            for i in range(n)
        ]
        for seq in seqs:
            self.sched.add(seq)
        return seqs

    def step(self) -> SchedulerOutput:
        return self.apply(self.sched.schedule())

    def apply(self, plan: SchedulerOutput, ends: dict[Sequence, int] | None = None) -> SchedulerOutput:
        """Run `plan` as the device and the engine would. ends[seq]: the output index at which the
        sequence samples an end token (it stops there, inside a decode loop too)."""
        ends = ends or {}
        for chunk in plan.prefills:
            self._compute(chunk.seq, chunk.start, chunk.end)
        decoded, stopped = {}, []
        for seq in plan.decodes:  # up to plan.num_steps iterations, ending at the length, as the device loop
            decoded[seq] = 0
            if seq.is_finished:  # ended in the step this one was planned after: its tokens are dropped
                continue
            while decoded[seq] < plan.num_steps and seq.num_tokens < seq.max_total_tokens:
                start = seq.num_computed_tokens + decoded[seq]
                self._compute(seq, start, start + 1)
                seq.token_ids.append(next_token(seq.token_ids))
                decoded[seq] += 1
                if ends.get(seq) == seq.num_output_tokens - 1:
                    stopped.append(seq)
                    break
        sampled = [c.seq for c in plan.prefills if c.samples]
        for seq in sampled:
            seq.token_ids.append(next_token(seq.token_ids))
        self.sched.advance(plan, decoded)
        for seq in stopped:
            self.sched.finish(seq, FinishReason.STOP)
        for seq in sampled + plan.decodes:
            if seq.num_tokens >= seq.max_total_tokens:
                self.sched.finish(seq, FinishReason.LENGTH)
        self.sched.check_integrity()
        self.plans.append(plan)
        return plan

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished()
        self.sched.check_idle_integrity()

    def _compute(self, seq: Sequence, start: int, end: int) -> None:
        size = self.alloc.page_size
        assert 0 <= start < end <= seq.num_tokens and end <= len(seq.pages) * size
        for pos in range(start, end):
            page = seq.pages[pos // size]
            assert page != NULL_PAGE
            assert self.alloc.ref_count(page) == 1, "a step must never write into a shared page"
            self.kv[page, pos % size] = seq.token_ids[pos]
        # Attention reads every earlier position: the pages must hold exactly this sequence's tokens.
        assert [self.kv[seq.pages[p // size], p % size] for p in range(end)] == seq.token_ids[:end]


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_admission_by_priority_then_arrival():
    engine = FakeEngine(max_prefill_seqs=1)
    order = [(1, 0.0), (0, 1.0), (1, 2.0), (0, 3.0)]  # (priority, arrival)
    seqs = [engine.submit(prompt(3), priority=p, arrival=a)[0] for p, a in order]
    admitted = [engine.step().prefills[0].seq for _ in range(4)]
    assert admitted == [seqs[1], seqs[3], seqs[0], seqs[2]]
    engine.run()


def test_admission_waits_for_pages_without_skipping_ahead():
    engine = FakeEngine(num_pages=5, page_size=4)  # 4 usable pages
    a = engine.submit(prompt(12), max_tokens=1)[0]  # 3 pages
    b = engine.submit(prompt(8, 100), max_tokens=1)[0]  # 2 pages: does not fit next to a
    c = engine.submit(prompt(2, 200), max_tokens=1)[0]  # 1 page: would fit, but arrived after b
    assert [ch.seq for ch in engine.step().prefills] == [a]
    assert engine.sched.num_waiting == 2
    assert [ch.seq for ch in engine.step().prefills] == [b, c]
    engine.run()


def test_max_num_seqs_bounds_running():
    engine = FakeEngine(max_num_seqs=2)
    for i in range(5):
        engine.submit(prompt(3, 10 * i), max_tokens=3)
    engine.step()
    assert engine.sched.num_running == 2 and engine.sched.num_waiting == 3
    while engine.sched.has_unfinished():
        plan = engine.step()
        assert engine.sched.num_running <= 2 and len(plan.decodes) + len(plan.prefills) <= 2


def test_a_blocked_queue_keeps_the_decode_loop():
    """Waiting sequences that cannot be admitted this step (no free row here; no free pages under a
    full cache) gain nothing from single steps: decoding keeps its device loop (an H100 serving 256
    requests ran one-token steps from its first preemption on). One that can be admitted is
    admitted, and that step is a single one."""
    engine = FakeEngine(max_num_seqs=2, decode_steps=4)
    seqs = [engine.submit(prompt(3, 10 * i), max_tokens=13)[0] for i in range(3)]
    assert [c.seq for c in engine.step().prefills] == seqs[:2]
    plan = engine.step()
    assert plan.decodes == seqs[:2] and engine.sched.num_waiting == 1 and plan.num_steps == 4
    while seqs[2].status is SequenceStatus.WAITING:
        plan = engine.step()
    assert [c.seq for c in plan.prefills] == [seqs[2]] and plan.num_steps == 1
    engine.run()
    assert [s.token_ids[3:] for s in seqs] == [expected_output(s.token_ids[:3], 13) for s in seqs]


def test_a_nearly_full_cache_shortens_the_decode_loop_instead_of_dropping_it():
    """Pages for 8 iterations short but for 7 free: the step runs 7, not 1."""
    engine = FakeEngine(num_pages=16, page_size=4, decode_steps=8, prefix_caching=False)  # 15 usable
    a = engine.submit(prompt(5), max_tokens=20)[0]
    b = engine.submit(prompt(44, 100), max_tokens=2)[0]
    engine.step()  # prefills: a holds 2 pages, b 11
    # b's next token takes the 14th page, leaving one: 8 iterations of a would write positions
    # 5..12 (two more pages), 7 write 5..11 (one).
    plan = engine.step()
    assert set(plan.decodes) == {a, b} and plan.num_steps == 7 and not plan.preempted
    engine.run()
    assert a.token_ids[5:] == expected_output(prompt(5), 20)
    assert b.token_ids[44:] == expected_output(prompt(44, 100), 2)


def test_decode_steps_planned_ahead_continue_their_rows_and_write_only_their_own_pages():
    """The engine plans a decode step while the one before it runs (schedule_ahead): each row
    continues where that step leaves it, with pages for all its iterations reserved without
    preempting anyone. A row that ends inside the running step (an end token) is dropped from the
    step planned ahead, which on the device still writes K/V past the row's end: only into pages
    the row held when it was planned, and never into a page the prefix cache serves later (the
    fake attention checks every position it reads). Outputs equal running the steps one by one."""
    engine = FakeEngine(num_pages=48, page_size=4, max_num_seqs=4, decode_steps=4)
    sched, size = engine.sched, engine.alloc.page_size
    seqs = [engine.submit(prompt(3 + i, 100 * i), max_tokens=m)[0] for i, m in enumerate((13, 9, 30, 2))]
    ends = {seqs[2]: 18}  # an end token as its 19th output token, inside a loop
    flight, planned, num_ahead = None, {}, 0
    while sched.has_unfinished() or flight is not None:
        ahead = sched.schedule_ahead(flight) if flight is not None else None
        if ahead is not None:
            num_ahead += 1
            assert ahead.ahead == flight.num_steps and not ahead.prefills and 1 <= ahead.num_steps <= 4
            for seq in ahead.decodes:
                start = seq.num_tokens - 1 + ahead.ahead
                end = min(start + ahead.num_steps, seq.max_total_tokens - 1)
                assert end <= len(seq.pages) * size
                planned[id(ahead), seq] = (start, end, list(seq.pages))
        if flight is not None:
            for seq in flight.decodes:  # what the device wrote for rows that had ended
                if flight.ahead and seq.is_finished:
                    start, end, pages = planned[id(flight), seq]
                    for pos in range(start, end):
                        engine.kv[pages[pos // size], pos % size] = -1
                elif flight.ahead:
                    assert seq.num_tokens - 1 == planned[id(flight), seq][0]  # it continues where it was assumed to be
            engine.apply(flight, ends)
        flight = ahead if ahead is not None else sched.schedule()
        if flight.is_empty:
            flight = None
    sched.check_idle_integrity()
    assert num_ahead >= 5
    for seq, m in zip(seqs, (13, 9, 30, 2)):
        want = expected_output(seq.prompt_ids, m)
        assert seq.output_ids == (want[:19] if seq is seqs[2] else want)
    assert seqs[2].finish_reason is FinishReason.STOP
    # The ended row's full pages are served from the prefix cache, unharmed.
    again = engine.submit(seqs[2].token_ids, max_tokens=3)[0]
    engine.run()
    assert again.num_cached_tokens >= 3 * size
    assert again.output_ids == expected_output(seqs[2].token_ids, 3)


def test_no_step_is_planned_ahead_while_a_sequence_waits_or_a_row_needs_the_host():
    engine = FakeEngine(max_num_seqs=2, decode_steps=4)
    a, b = (engine.submit(prompt(3, 10 * i), max_tokens=20)[0] for i in range(2))
    engine.step()
    plan = engine.step()
    assert plan.decodes == [a, b] and engine.sched.schedule_ahead(plan) is not None  # (pages reserved)
    c = engine.submit(prompt(3, 50), max_tokens=2)[0]
    assert engine.sched.schedule_ahead(plan) is None  # c waits: the next plan admits it when it can
    engine.run()
    assert c.output_ids == expected_output(prompt(3, 50), 2)
    d = engine.submit(prompt(3, 60), max_tokens=20)[0]
    engine.step()
    plan = engine.step()
    d.matcher = object()  # a grammar: its mask needs the host after every token
    assert engine.sched.schedule_ahead(plan) is None
    d.matcher = None
    engine.sched.abort(d.request_id)
    assert engine.sched.schedule().is_empty
    engine.sched.check_idle_integrity()


def test_long_prompt_is_chunked_while_decodes_continue():
    engine = FakeEngine(num_pages=128, page_size=16, max_num_batched_tokens=256)
    a = engine.submit(prompt(8), max_tokens=20)[0]
    engine.step()
    b = engine.submit(prompt(1000, 5000), max_tokens=2)[0]
    chunks = []
    for _ in range(4):
        plan = engine.step()
        assert plan.decodes == [a] and plan.num_prefill_tokens <= 256
        (chunk,) = plan.prefills
        chunks.append((chunk.start, chunk.end, chunk.samples))
    assert chunks == [(0, 256, False), (256, 512, False), (512, 768, False), (768, 1000, True)]
    assert engine.step().decodes == [a, b]
    engine.run()
    assert b.output_ids == expected_output(b.prompt_ids, 2)


def test_prefix_hit_is_reported_and_the_first_chunk_starts_after_it():
    engine = FakeEngine(page_size=4)
    first = engine.submit(prompt(10), max_tokens=2)[0]
    engine.run()
    second = engine.submit(prompt(10) + [50, 51], max_tokens=2)[0]
    (chunk,) = engine.step().prefills
    assert second.num_cached_tokens == 8 and (chunk.start, chunk.end) == (8, 12)
    assert engine.alloc.num_hit_tokens == 8 and engine.alloc.num_queried_tokens == 22
    engine.run()
    assert first.num_cached_tokens == 0
    assert second.output_ids == expected_output(second.prompt_ids, 2)


def test_no_prefix_hits_when_caching_is_disabled():
    engine = FakeEngine(page_size=4, prefix_caching=False)
    engine.submit(prompt(10), max_tokens=2)
    engine.run()
    second = engine.submit(prompt(10), max_tokens=2)[0]
    assert engine.step().prefills[0].start == 0 and second.num_cached_tokens == 0
    engine.run()


def test_prompt_logprobs_are_computed_not_served_from_the_cache():
    engine = FakeEngine(page_size=4)
    engine.submit(prompt(12), max_tokens=1)
    engine.run()
    seq = Sequence("lp", prompt(12), 12, SamplingParams(prompt_logprobs=1, prompt_logprobs_start=5), 13)
    engine.sched.add(seq)
    # Logits from position 4 on are needed, so only the first page (positions 0-3) may be reused.
    assert engine.step().prefills[0].start == 4 and seq.num_cached_tokens == 4
    engine.run()


def test_preemption_of_the_newest_under_a_tiny_page_budget():
    engine = FakeEngine(num_pages=6, page_size=4)  # 5 usable pages; each sequence grows to 4
    old = engine.submit(prompt(6), max_tokens=10)[0]
    new = engine.submit(prompt(6, 100), max_tokens=10)[0]
    preempted_at = None
    while engine.sched.has_unfinished():
        plan = engine.step()
        if plan.preempted and preempted_at is None:
            preempted_at = len(engine.plans)
            assert plan.preempted == [new] and new not in plan.decodes
            assert new.status is SequenceStatus.WAITING and new.pages == [] and new.num_computed_tokens == 0
            assert new.num_output_tokens > 0  # the output so far stays, to be recomputed
            assert not [c for c in plan.prefills if c.start == 0]  # nothing admitted in that step
    assert preempted_at is not None and old.num_preemptions == 0 and new.num_preemptions >= 1
    recompute = [c for p in engine.plans[preempted_at:] for c in p.prefills if c.seq is new]
    assert recompute[-1].end > new.num_prompt_tokens and recompute[-1].samples
    # The client sees the same tokens as without any preemption.
    assert old.output_ids == expected_output(old.prompt_ids, 10)
    assert new.output_ids == expected_output(new.prompt_ids, 10)
    assert new.num_cached_tokens == 0  # counted on the first admission only
    engine.sched.check_idle_integrity()


def test_a_sequence_that_is_itself_the_newest_preempts_itself():
    engine = FakeEngine(num_pages=4, page_size=4)  # 3 usable pages
    old = engine.submit(prompt(4), max_tokens=4)[0]
    new = engine.submit(prompt(4, 100), max_tokens=4)[0]
    engine.step()  # both admitted: 1 page each, then each decode needs a second page
    plan = engine.step()
    assert plan.decodes == [old] and plan.preempted == [new]
    engine.run()
    assert new.output_ids == expected_output(new.prompt_ids, 4)


def test_abort_from_waiting_and_running_frees_pages():
    engine = FakeEngine(max_num_seqs=1)
    running = engine.submit(prompt(9), max_tokens=8)[0]
    waiting = engine.submit(prompt(9, 50), max_tokens=8, n=2)
    engine.step()
    assert running.status is SequenceStatus.RUNNING and engine.alloc.num_used_pages == 3
    assert engine.sched.abort(waiting[0].request_id) == waiting
    assert engine.sched.abort(running.request_id) == [running]
    assert engine.sched.abort("unknown") == []
    for seq in [running, *waiting]:
        assert seq.is_finished and seq.finish_reason is FinishReason.ABORT and seq.pages == []
    assert not engine.sched.has_unfinished()
    engine.sched.check_idle_integrity()


def test_abort_while_its_step_runs_takes_effect_before_the_next():
    engine = FakeEngine()
    seq = engine.submit(prompt(9), max_tokens=8)[0]
    engine.step()
    plan = engine.sched.schedule()
    engine.sched.abort(seq.request_id)
    engine.sched.advance(plan)  # the aborted sequence is skipped, its freed pages not registered
    engine.sched.finish(seq, FinishReason.STOP)  # already finished: no double free
    assert seq.finish_reason is FinishReason.ABORT
    assert engine.sched.schedule().is_empty
    engine.sched.check_idle_integrity()


def test_refusals_name_the_numbers():
    sched = Scheduler(SchedulerConfig(max_model_len=2048), PageAllocator(1024, 16), 16)
    with pytest.raises(RequestTooLongError) as err:
        sched.check_fits(3000, 100)
    assert err.value.param == "prompt"
    assert "prompt has 3000 tokens and max_tokens is 100: 3100 exceeds the context limit of 2048 tokens" in str(
        err.value
    )
    with pytest.raises(RequestTooLongError, match="2100 exceeds the context limit of 2048") as err:
        sched.check_fits(2000, 100)
    assert err.value.param == "max_tokens"
    with pytest.raises(RequestTooLongError, match="prompt has 2048 tokens: the context limit of 2048 tokens"):
        sched.check_fits(2048, None)
    with pytest.raises(InvalidRequestError, match="at least one token"):
        sched.check_fits(0, 5)
    assert sched.check_fits(2000, 48) == 2048 and sched.check_fits(10, None) == 2048

    small = Scheduler(SchedulerConfig(max_model_len=2048), PageAllocator(11, 16), 16)  # 10 usable pages
    with pytest.raises(RequestTooLongError) as err:
        small.check_fits(100, 100)
    assert err.value.param == "max_tokens"
    assert "200 tokens need 13 KV pages of 16 tokens, but the cache holds only 10 pages (160 tokens)" in str(
        err.value
    )
    assert small.check_fits(100, None) == 160  # "up to the limit" is capped by the cache
    with pytest.raises(RequestTooLongError, match="KV cache holds only 10 pages"):
        small.check_fits(160, None)


def test_siblings_wait_for_sample_0_and_share_its_prompt_pages():
    engine = FakeEngine(page_size=4, max_num_batched_tokens=16)
    leader, *siblings = engine.submit(prompt(20), max_tokens=3, n=3, arrival=1.0)
    other = engine.submit(prompt(5, 500), max_tokens=3, arrival=2.0)[0]
    assert [(c.seq, c.start, c.end) for c in engine.step().prefills] == [(leader, 0, 16)]
    # The siblings are held, but they do not block the request behind them.
    assert [(c.seq, c.start, c.end) for c in engine.step().prefills] == [(leader, 16, 20), (other, 0, 5)]
    plan = engine.step()
    assert [(c.seq, c.start, c.end) for c in plan.prefills] == [(s, 16, 20) for s in siblings]
    assert all(s.num_cached_tokens == 16 and s.pages[:4] == leader.pages[:4] for s in siblings)
    assert [engine.alloc.ref_count(p) for p in leader.pages[:4]] == [3, 3, 3, 3]
    engine.run()
    assert all(s.output_ids == expected_output(s.prompt_ids, 3) for s in [leader, *siblings])


def test_short_prompt_siblings_are_not_held():
    engine = FakeEngine(page_size=4)
    seqs = engine.submit(prompt(4), max_tokens=2, n=3)  # no full page to share
    assert [c.seq for c in engine.step().prefills] == seqs
    engine.run()


def test_forgetting_to_append_the_sampled_token_is_caught():
    engine = FakeEngine()
    engine.submit(prompt(5), max_tokens=3)
    engine.sched.advance(engine.sched.schedule())
    with pytest.raises(RuntimeError, match="append the sampled token"):
        engine.sched.schedule()


def test_integrity_detects_a_sequence_that_lost_track_of_a_page():
    engine = FakeEngine()
    seq = engine.submit(prompt(9), max_tokens=3)[0]
    engine.step()
    seq.pages.pop()
    with pytest.raises(RuntimeError, match="has ref_count 1 but 0 holders"):
        engine.sched.check_integrity()


def test_mixed_workload_under_pressure_keeps_outputs_and_integrity():
    rng = random.Random(0)
    engine = FakeEngine(num_pages=24, page_size=4, max_num_seqs=6, max_num_batched_tokens=16, max_prefill_seqs=3)
    bases = [prompt(12, 1000 * b) for b in range(3)]  # shared system prompts -> prefix hits
    submitted: list[list[Sequence]] = []
    aborted: set[str] = set()
    for step in range(400):
        if step < 60 and rng.random() < 0.6:
            tokens = rng.choice(bases)[: rng.randint(1, 12)] + [rng.randrange(1000) for _ in range(rng.randint(0, 12))]
            n, priority = rng.choice([1, 1, 2]), rng.randint(0, 1)
            submitted.append(engine.submit(tokens, max_tokens=rng.randint(1, 12), n=n, priority=priority))
        if step % 9 == 4 and submitted:
            victim = rng.choice(submitted)[0]
            if not victim.is_finished:
                engine.sched.abort(victim.request_id)
                aborted.add(victim.request_id)
        if step >= 60 and not engine.sched.has_unfinished():
            break
        engine.step()
    assert not engine.sched.has_unfinished()
    engine.sched.check_idle_integrity()
    seqs = [s for group in submitted for s in group]
    for seq in seqs:
        assert seq.is_finished
        if seq.request_id not in aborted:
            assert seq.finish_reason is FinishReason.LENGTH
            assert seq.output_ids == expected_output(seq.prompt_ids, seq.params.max_tokens)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert engine.alloc.num_hit_tokens > 0


def test_host_bookkeeping_does_not_import_jax():
    code = "import sys, jaxserve.engine.scheduler, jaxserve.engine.buckets; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_longrope_sequences_recompute_long_past_the_switch():
    """A LongRoPE model (rope_switch: its original_max_position): a sequence admitted longer than
    the switch is long from the start; a short one decodes with the short factors only at
    positions below the switch, several iterations a step but never across it, and is then
    preempted and recomputed long. Long pages never serve a short sequence's prompt."""
    engine = FakeEngine(max_num_seqs=4, decode_steps=4)
    engine.sched.rope_switch = 10
    short = engine.submit(prompt(3), max_tokens=12)[0]
    long = engine.submit(prompt(12, 100), max_tokens=4)[0]
    fed_short = []
    while engine.sched.has_unfinished():
        plan = engine.sched.schedule()
        for seq in plan.decodes:
            if not seq.long_rope:  # the positions this step feeds: its next token's on, num_steps of them
                fed_short += range(seq.num_tokens - 1, seq.num_tokens - 1 + plan.num_steps)
        engine.apply(plan)
    engine.sched.check_idle_integrity()
    assert short.output_ids == expected_output(prompt(3), 12) and long.output_ids == expected_output(prompt(12, 100), 4)
    assert max(fed_short) == 9 and any(p.num_steps > 1 for p in engine.plans)
    assert (short.num_preemptions, short.long_rope) == (1, True)
    assert (long.num_preemptions, long.long_rope) == (0, True)
    # The same prompt again starts short: the first sequence's pages from before the switch serve it.
    again = engine.submit(prompt(3) + expected_output(prompt(3), 12)[:6], max_tokens=1)[0]
    engine.run()
    assert not again.long_rope and again.num_cached_tokens == 8


def test_longrope_drafts_stop_at_the_switch():
    """A short LongRoPE row's n-gram drafts are cut so that its verify step feeds no position at
    or past the switch (it would compute them with the short factors); a long row's are not."""
    engine = FakeEngine(speculative_method="ngram", num_speculative_tokens=4, max_ngram_size=2, min_ngram_size=1)
    engine.sched.rope_switch = 14
    seq = engine.submit([1, 2, 3, 4, 5, 6] * 2, max_tokens=20)[0]
    engine.step()  # the prompt, and its first token
    seq.token_ids[-1] = 1  # "6 1" was followed by "2 3 4 5": four drafts on offer
    assert engine.sched._drafts([seq]) == {seq: [2]}  # feeds position 13 = the switch - 1
    seq.long_rope = True
    assert engine.sched._drafts([seq]) == {seq: [2, 3, 4, 5]}
