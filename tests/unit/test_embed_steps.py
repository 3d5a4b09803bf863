"""What prefill and decode steps carry for embedded, M-RoPE sequences, on the
host only. Every prefill token, in chunks that split the image, from a prefix-cache hit that
starts inside the image, and after a preemption that recomputes the outputs, gets its own
prompt position's embedding (or none) and 3-axis rotary position (the prompt's table, then
index + delta); decode rows carry the delta."""

from __future__ import annotations

import numpy as np

from jaxserve.config import SchedulerConfig
from jaxserve.engine.buckets import BucketTable
from jaxserve.engine.embeds import EmbedSpan, cache_ids
from jaxserve.engine.pages import PageAllocator
from jaxserve.engine.request import FinishReason, SamplingParams, Sequence
from jaxserve.engine.rows import row_params
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_inputs import StepInputBuilder

PAGE, H = 16, 8
OFFSET, N_IMAGE, PROMPT = 5, 50, 60
DELTA = -30


def _seq(rid: str) -> Sequence:
    prompt = [3] * OFFSET + [9] * N_IMAGE + [4] * (PROMPT - OFFSET - N_IMAGE)
    embeds = np.arange(N_IMAGE * H, dtype=np.float32).reshape(N_IMAGE, H) + 1
    span = EmbedSpan(OFFSET, embeds, "ab" * 32)
    rope = np.stack([np.arange(PROMPT) * 10 + axis for axis in range(3)]).astype(np.int32)
    return Sequence(rid, prompt, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), PROMPT + 40,
                    embeds=(span,), prompt_keys=cache_ids(prompt, [span]), rope_positions=rope, rope_delta=DELTA)


def _expected(seq: Sequence, position: int) -> tuple[np.ndarray | None, list[int]]:
    span = seq.embeds[0]
    embed = span.embeds[position - OFFSET] if OFFSET <= position < span.end else None
    rope = list(seq.rope_positions[:, position]) if position < PROMPT else [position + DELTA] * 3
    return embed, rope


def test_prefill_and_decode_rows_take_their_positions_inputs():
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=24, max_prefill_seqs=2, max_model_len=128)
    scheduler = Scheduler(sched, PageAllocator(64, PAGE), PAGE)
    builder = StepInputBuilder(num_slots=3, vocab_size=64, page_size=PAGE, max_pages_per_seq=8,
                               buckets=BucketTable(sched), max_prefill_seqs=2, decode_steps=1,
                               row_params=lambda s: row_params(s, (2,)), embed_dim=H, mrope=True)
    first = _seq("a")
    scheduler.add(first)
    checked = {"embedded": 0, "decode": 0, "cache_hit_inside_image": False, "recomputed_outputs": 0}
    second = None
    for step in range(60):
        if step == 8:  # the first has computed its prompt: the second's hit ends inside the image
            second = _seq("b")
            scheduler.add(second)
        if step == 14:  # preempt the first: its prompt and outputs are recomputed
            scheduler._preempt(first)
        out = scheduler.schedule()
        if second is not None and any(c.seq is second and c.start == 48 for c in out.prefills):
            checked["cache_hit_inside_image"] = True
        commands = builder.build(out, [None] * len(out.prefills))
        for command in commands.commands:
            kind, p = command.key[0], command.payload
            if kind == "prefill":
                for i, chunk in enumerate(out.prefills):
                    lo = int(p["cu_q_lens"][i])
                    for k in range(chunk.num_tokens):
                        pos = int(p["positions"][lo + k])
                        assert pos == chunk.start + k
                        embed, rope = _expected(chunk.seq, pos)
                        assert list(p["rope_positions"][lo + k]) == rope
                        assert bool(p["embedded"][lo + k]) == (embed is not None)
                        if embed is not None:
                            np.testing.assert_array_equal(p["embeds"][lo + k], embed)
                            checked["embedded"] += 1
                        if pos >= PROMPT:
                            checked["recomputed_outputs"] += 1
            elif kind == "decode":
                n = int(p["num_seqs"])
                assert list(p["rope_delta"][:n]) == [DELTA] * n
                checked["decode"] += n
        for seq in [c.seq for c in out.prefills if c.samples] + out.decodes:
            seq.token_ids.append(7)
        scheduler.advance(out)
        for seq in list(scheduler.running):
            if seq.num_tokens >= seq.max_total_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
    assert checked["cache_hit_inside_image"] and checked["embedded"] > 0
    assert checked["recomputed_outputs"] > 0 and checked["decode"] > 0
