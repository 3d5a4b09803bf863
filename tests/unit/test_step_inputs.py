"""The step's diff as the device takes it (jaxserve.engine.step_inputs), on the host only: what a
step sends does not depend on max_model_len, page-table entries go once, a new row carries its
parameters and penalty state, and every command fits the shape the runner compiled for it."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.engine.buckets import BucketTable
from jaxserve.engine.pages import PageAllocator
from jaxserve.engine.request import FinishReason, SamplingParams, Sequence
from jaxserve.engine.rows import row_params
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_inputs import StepInputBuilder

VOCAB = 49152
PAGE = 16
EOS = (2,)


def _setup(max_model_len: int, batch: int, decode_steps: int = 1) -> tuple[Scheduler, StepInputBuilder]:
    sched = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=256, max_prefill_seqs=4,
                            max_model_len=max_model_len, decode_steps=decode_steps)
    scheduler = Scheduler(sched, PageAllocator(4096, PAGE), PAGE)
    builder = StepInputBuilder(num_slots=batch + 1, vocab_size=VOCAB, page_size=PAGE,
                               max_pages_per_seq=-(-max_model_len // PAGE), buckets=BucketTable(sched),
                               max_prefill_seqs=4, decode_steps=decode_steps,
                               row_params=lambda seq: row_params(seq, EOS))
    return scheduler, builder


def _seq(i: int, params: SamplingParams, prompt_len: int = 20) -> Sequence:
    prompt = [100 + (i * 7 + j) % 500 for j in range(prompt_len)]
    return Sequence(request_id=f"r{i}", token_ids=prompt, num_prompt_tokens=prompt_len, params=params,
                    max_total_tokens=prompt_len + 200, seed=i)


def _run(scheduler: Scheduler, builder: StepInputBuilder, steps: int) -> list:
    """Schedule, build and "run" `steps` steps (every sampling row appends token 7)."""
    out_steps = []
    for _ in range(steps):
        out = scheduler.schedule()
        commands = builder.build(out, [None] * len(out.prefills))
        for command in commands.commands:  # every payload has exactly its compiled shape
            spec = builder.abstract(command.key)
            assert command.payload.keys() == spec.keys()
            for name, (shape, dtype) in spec.items():
                assert command.payload[name].shape == shape and command.payload[name].dtype == dtype, name
        out_steps.append((out, commands))
        for seq in [c.seq for c in out.prefills if c.samples] + out.decodes:
            seq.token_ids.append(7)
        scheduler.advance(out)
    return out_steps


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=200),
                                    SamplingParams(max_tokens=200, repetition_penalty=1.2, presence_penalty=0.5,
                                                   logit_bias={5: 1.0}, bad_words_ids=[[9]], stop_token_ids=[3])],
                         ids=["plain", "penalised"])
def test_what_a_step_sends_does_not_depend_on_max_model_len(params):
    sent = {}
    for max_len in (2048, 131072):
        scheduler, builder = _setup(max_len, batch=64)
        for i in range(64):
            scheduler.add(_seq(i, params))
        steps = _run(scheduler, builder, 60)
        sent[max_len] = [commands.nbytes for _, commands in steps]
        decode_only = [c.nbytes for out, c in steps if out.decodes and not out.prefills]
        assert len(decode_only) > 20
        # A steady decode step sends tokens, positions, slots and a few page entries: ~4 KiB at 64 rows.
        assert max(decode_only) < 8 * 1024
    assert sent[2048] == sent[131072]


def test_page_entries_are_sent_once_and_new_rows_carry_their_state():
    scheduler, builder = _setup(4096, batch=4)
    penalised = SamplingParams(max_tokens=200, repetition_penalty=1.3, frequency_penalty=0.2, min_tokens=3,
                               logit_bias={11: -2.0}, bad_words_ids=[[12], [13, 14]], stop_token_ids=[4])
    seq = _seq(0, penalised, prompt_len=40)
    scheduler.add(seq)
    steps = _run(scheduler, builder, 40)
    rows = [c for _, cmds in steps for c in cmds.commands if c.key[0] == "rows"]
    assert len(rows) == 1 and rows[0].payload["slots"][0] == seq.slot
    row = {k: v[0] for k, v in rows[0].payload.items()}
    assert row["repetition_penalty"] == np.float32(1.3) and row["min_tokens"] == 3
    assert sorted(row["end_ids"][row["end_ids"] >= 0].tolist()) == [2, 4]  # EOS and the stop id
    assert row["banned_ids"][row["banned_ids"] >= 0].tolist() == [12]  # the one-token bad word, always
    assert row["bias_ids"][0] == 11 and row["bias_values"][0] == np.float32(-2.0)
    tokens = [c for _, cmds in steps for c in cmds.commands if c.key[0] == "tokens"]
    assert len(tokens) == 1 and tokens[0].payload["prompt"].sum() == 40  # the prompt, for the repetition penalty
    # The two-token bad word bans 14 only after 13: its row's bans are sent with every step it samples.
    bans = [c for _, cmds in steps for c in cmds.commands if c.key[0] == "bans"]
    assert len(bans) == sum(1 for out, _ in steps if out.decodes or any(c.samples for c in out.prefills))
    entries = []
    for _, cmds in steps:
        for c in cmds.commands:
            p = c.payload
            if c.key[0] in ("prefill", "decode"):
                live = p["page_slots"] < builder.num_slots
                entries += list(zip(p["page_slots"][live], p["page_index"][live], p["page_ids"][live]))
    assert [(int(s), int(i), int(pg)) for s, i, pg in entries] == [(seq.slot, i, pg) for i, pg in enumerate(seq.pages)]


def test_a_long_cached_prefix_sends_its_pages_before_the_step():
    scheduler, builder = _setup(131072, batch=2)
    first = _seq(0, SamplingParams(max_tokens=4), prompt_len=40000)
    scheduler.add(first)
    steps = _run(scheduler, builder, 1)
    assert not any(c.key[0] == "pages" for c in steps[0][1].commands)  # a 256-token chunk: its own pages fit
    while scheduler.has_unfinished():
        _run(scheduler, builder, 1)
        if first.num_output_tokens >= 4:
            scheduler.finish(first, FinishReason.LENGTH)
    # The same prompt again finds 2499 full pages in the prefix cache at once: more than a step carries.
    twin = _seq(0, SamplingParams(max_tokens=4), prompt_len=40000)
    twin.request_id = "twin"
    scheduler.add(twin)
    out = scheduler.schedule()
    assert out.prefills[0].start == 39984
    commands = builder.build(out, [None] * len(out.prefills)).commands
    kinds = [c.key[0] for c in commands]
    assert kinds.count("pages") == 3 and kinds.index("prefill") > max(i for i, k in enumerate(kinds) if k == "pages")


def test_verify_steps_keep_the_device_page_tables_exact_as_drafts_come_and_go():
    """Prompt lookup: a verify step's rows carry their last token and drafts, pages are reserved
    for the drafts and the unused ones given back after; the page table the device would hold
    (every entry any command sent, applied in order) must equal each running row's pages after
    every step, also when given-back pages are handed to other rows."""
    import random

    rng = random.Random(0)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_seqs=4, max_model_len=512,
                            speculative_method="ngram", num_speculative_tokens=6, max_ngram_size=2)
    # Tiny pages, so drafts cross page boundaries; a long free list (FIFO), so a page given back is
    # not the one the row gets next.
    scheduler = Scheduler(sched, PageAllocator(200, 4), 4)
    builder = StepInputBuilder(num_slots=5, vocab_size=VOCAB, page_size=4, max_pages_per_seq=128,
                               buckets=BucketTable(sched), max_prefill_seqs=4, decode_steps=1,
                               row_params=lambda seq: row_params(seq, EOS), num_speculative_tokens=6)
    keys = builder.keys()
    assert any(k[0] == "verify" for k in keys)
    seqs = []
    for i in range(4):
        prompt = [10 + i, 20, 30, 40, 50, 60] * 3  # repeats: there is always something to draft
        seq = Sequence(request_id=f"v{i}", token_ids=prompt, num_prompt_tokens=len(prompt),
                       params=SamplingParams(max_tokens=60), max_total_tokens=len(prompt) + 60, seed=i)
        scheduler.add(seq)
        seqs.append(seq)
    device: dict[tuple[int, int], int] = {}
    verified = 0
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        commands = builder.build(out, [None] * len(out.prefills))
        for command in commands.commands:
            spec = builder.abstract(command.key)
            assert {n: (a.shape, a.dtype) for n, a in command.payload.items()} == spec
            p = command.payload
            names = ("slots", "index", "pages") if command.key[0] == "pages" else ("page_slots", "page_index", "page_ids")
            if names[0] in p and names[1] in p:
                for slot, index, page in zip(*(p[n] for n in names)):
                    if slot < builder.num_slots:
                        device[(int(slot), int(index))] = int(page)
        if out.drafts:
            assert commands.decode[0] == "verify"
            verify = next(c.payload for c in commands.commands if c.key == commands.decode)
            for i, seq in enumerate(out.decodes):
                row = verify["tokens"][verify["cu_q_lens"][i]:verify["cu_q_lens"][i + 1]].tolist()
                assert row == [seq.token_ids[-1], *out.drafts.get(seq, [])]
                assert verify["kv_lens"][i] == seq.num_tokens + len(out.drafts.get(seq, []))
            verified += 1
        decoded = {}
        for chunk in out.prefills:
            if chunk.samples:
                chunk.seq.token_ids.append(7)
        for seq in out.decodes:
            draft = out.drafts.get(seq, [])
            kept = rng.randint(0, len(draft))
            new = (draft[:kept] + [7])[: seq.max_total_tokens - seq.num_tokens]
            seq.token_ids += new
            decoded[seq] = len(new)
        scheduler.advance(out, decoded)
        for seq in list(scheduler.running):
            if seq.num_tokens >= seq.max_total_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
        scheduler.check_integrity()
        for seq in scheduler.running:
            assert [device.get((seq.slot, i)) for i in range(len(seq.pages))] == seq.pages
            assert len(seq.pages) <= -(-seq.num_tokens // 4)  # no page held for rejected drafts
    assert not scheduler.has_unfinished() and verified > 10


def test_a_decode_step_planned_ahead_takes_its_tokens_on_the_device():
    """A step planned while the one before it runs (Scheduler.schedule_ahead) sends every row's
    token as -1 (the device reads the row's last sampled token) and positions, output counts and
    remaining lengths past the running step's iterations; the page entries it reserved go with it."""
    scheduler, builder = _setup(max_model_len=512, batch=4, decode_steps=8)
    seqs = [_seq(i, SamplingParams(max_tokens=200)) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    _run(scheduler, builder, 1)  # the prefills, one token each
    running = scheduler.schedule()
    builder.build(running)
    assert running.num_steps == 8
    ahead = scheduler.schedule_ahead(running)
    assert ahead.ahead == 8 and ahead.decodes == seqs
    payload = next(c.payload for c in builder.build(ahead).commands if c.key[0] == "decode")
    n = len(seqs)
    assert (payload["tokens"][:n] == -1).all() and int(payload["num_seqs"]) == n
    assert payload["positions"][:n].tolist() == [28, 28, 28]  # 21 tokens, the running step writes 20..27
    assert payload["steps"][:n].tolist() == [9, 9, 9]
    assert payload["remaining"][:n].tolist() == [s.max_total_tokens - s.num_tokens - 8 for s in seqs]
    # Its positions 28..35 reach each row's third page, reserved now and sent with the step.
    assert sorted(zip(payload["page_slots"], payload["page_index"]))[:n] == [(s.slot, 2) for s in seqs]
