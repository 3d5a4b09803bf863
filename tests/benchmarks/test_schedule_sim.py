"""benchmarks.schedule_sim: the real scheduler on a wave, no device. Every request gets exactly its
output tokens whether or not the cache holds the whole wave; with room for all, nothing is
preempted and decoding runs the full device loop between the prefills."""

from __future__ import annotations

from benchmarks.schedule_sim import simulate
from jaxserve.config import SchedulerConfig

CONFIG = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128, max_prefill_seqs=4, decode_steps=8,
                         max_model_len=112)


def test_a_wave_that_fits_runs_without_preemption():
    counts = simulate(num_pages=16 * 7 + 1, page_size=16, concurrency=16, input_len=64, output_len=40, config=CONFIG)
    assert counts["output tokens"] == 16 * 40 and counts["prefill tokens"] == 16 * 64
    assert counts.get("preemptions", 0) == 0 and counts.get("recomputed tokens", 0) == 0
    assert {k for k in counts if k.startswith("steps: decode")} <= {"steps: decode x8", "steps: decode x7"}


def test_a_wave_beyond_the_cache_is_preempted_and_still_completes():
    counts = simulate(num_pages=60, page_size=16, concurrency=16, input_len=64, output_len=40, config=CONFIG)
    assert counts["output tokens"] == 16 * 40
    assert counts["preemptions"] > 0 and counts["recomputed tokens"] > 0
    assert counts["prefill tokens"] == 16 * 64 + counts["recomputed tokens"]
