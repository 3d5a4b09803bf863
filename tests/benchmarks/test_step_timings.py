"""benchmarks.step_timings: the per-token split of a served run's step time, from /metrics text."""

from __future__ import annotations

from benchmarks.step_timings import read_counters, summary
from jaxserve.server.metrics import Metrics


def test_the_servers_counters_give_the_split_per_token():
    metrics = Metrics("m")
    metrics.counter("step_calls_total", "", lambda: 130)
    metrics.counter("step_call_seconds_total", "", lambda: 6.5)
    metrics.counter("step_handover_seconds_total", "", lambda: 0.13)
    metrics.generation_tokens.inc(1000)
    metrics.requests.inc(1, "length")  # a labelled sample, not read
    counters = read_counters(metrics.render())
    assert counters["jaxserve:generation_tokens_total"] == 1000
    text = summary(counters)
    assert "per output token 6.500 ms inside step calls, 0.130 ms handing over" in text
    assert "50.00 ms inside a call on average" in text
    assert summary({}) == "no output tokens or step calls counted"
