"""Metric computations on synthetic timelines: TTFT, TPOT, ITL and E2E as vLLM defines them,
percentiles, throughputs, failed-request accounting."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.serving_metrics import (
    RequestResult,
    calculate_metrics,
    format_report,
    group_failures,
    max_concurrency,
    summarize,
)


def ok(ttft: float, itl: list[float], output_tokens: int, prompt_len: int = 10, start: float = 0.0,
       tail: float = 0.0, expected: int | None = None) -> RequestResult:
    """A successful request whose chunks arrived at ttft, then after each gap in itl; the last byte
    (end of the stream) `tail` seconds after the last chunk."""
    return RequestResult(prompt_len=prompt_len, expected_output_len=expected if expected is not None else output_tokens,
                         success=True, output_tokens=output_tokens, output_tokens_source="usage", ttft=ttft,
                         itl=list(itl), latency=ttft + sum(itl) + tail, start_time=start)


def failed(error: str, start: float = 0.0, latency: float = 0.01) -> RequestResult:
    return RequestResult(prompt_len=10, expected_output_len=4, error=error, start_time=start, latency=latency)


def test_one_token_per_chunk_timeline():
    # First token at 100 ms, then tokens 20, 30 and 40 ms apart: E2E 190 ms, 4 tokens.
    r = ok(0.100, [0.020, 0.030, 0.040], output_tokens=4)
    m = calculate_metrics([r], duration_s=1.0)
    assert m.ttft_ms.mean == pytest.approx(100.0)
    assert m.e2el_ms.mean == pytest.approx(190.0)
    # TPOT = (E2E - TTFT) / (tokens - 1) = 90 ms / 3.
    assert r.tpot == pytest.approx(0.030)
    assert m.tpot_ms.mean == pytest.approx(30.0)
    # ITL pools the individual gaps.
    assert m.itl_ms.count == 3
    assert sorted([m.itl_ms.min, m.itl_ms.median, m.itl_ms.max]) == pytest.approx([20.0, 30.0, 40.0])


def test_tpot_counts_tokens_while_itl_counts_chunks():
    # 9 tokens in 3 chunks (3 tokens each): 2 gaps of 60 ms; TPOT spreads 120 ms over 8 tokens.
    r = ok(0.050, [0.060, 0.060], output_tokens=9)
    m = calculate_metrics([r], duration_s=1.0)
    assert m.itl_ms.count == 2 and m.itl_ms.mean == pytest.approx(60.0)
    assert m.tpot_ms.mean == pytest.approx(120.0 / 8)


def test_the_stream_tail_counts_in_e2e_and_tpot_not_in_itl():
    r = ok(0.1, [0.01], output_tokens=2, tail=0.05)
    m = calculate_metrics([r], duration_s=1.0)
    assert m.e2el_ms.mean == pytest.approx(160.0)
    assert m.tpot_ms.mean == pytest.approx(60.0)
    assert m.itl_ms.mean == pytest.approx(10.0)


def test_a_single_token_has_no_tpot():
    m = calculate_metrics([ok(0.2, [], output_tokens=1)], duration_s=1.0)
    assert m.tpot_ms is None and m.itl_ms is None
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert "(no data)" in format_report(m)


def test_tpot_is_averaged_per_request_not_per_token():
    # A long fast request and a short slow one: per-request mean is (10 + 100) / 2 ms.
    fast = ok(0.0, [0.010] * 100, output_tokens=101)
    slow = ok(0.0, [0.100], output_tokens=2)
    m = calculate_metrics([fast, slow], duration_s=2.0)
    assert m.tpot_ms.mean == pytest.approx(55.0)
    assert m.itl_ms.count == 101


def test_percentiles_use_linear_interpolation_like_numpy_and_vllm():
    values_s = [v / 1000 for v in range(1, 101)]  # 1..100 ms
    d = summarize(values_s, [50, 90, 99, 99.9])
    assert d.percentiles == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01, "p99.9": 99.901})
    assert d.median == pytest.approx(50.5)
    assert d.mean == pytest.approx(50.5)
    assert d.std == pytest.approx(float(np.std(np.arange(1, 101))))
    assert (d.min, d.max, d.count) == (1.0, 100.0, 100)
    assert d.get("p90") == d.percentiles["p90"] and d.get("mean") == d.mean


def test_summarize_of_nothing_is_none():
    assert summarize([]) is None


def test_throughputs_count_successful_requests_over_the_wall_time():
    results = [ok(0.1, [0.1] * 9, output_tokens=10, prompt_len=5) for _ in range(3)]
    m = calculate_metrics(results, duration_s=2.0)
    assert (m.completed, m.failed, m.num_requests) == (3, 0, 3)
    assert (m.total_input_tokens, m.total_output_tokens) == (15, 30)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_throughput == pytest.approx(7.5)
    assert m.output_throughput == pytest.approx(15.0)
    assert m.total_token_throughput == pytest.approx(22.5)


def test_failed_requests_are_counted_listed_and_excluded_from_latency():
    results = [ok(0.1, [0.1], output_tokens=2), failed("HTTP 500: boom"), ok(0.3, [0.1], output_tokens=2),
               failed("ReadTimeout: no message")]
    m = calculate_metrics(results, duration_s=1.0)
    assert (m.completed, m.failed) == (2, 2)
    assert m.failures == [{"index": 1, "error": "HTTP 500: boom"}, {"index": 3, "error": "ReadTimeout: no message"}]
    assert m.ttft_ms.count == 2 and m.ttft_ms.mean == pytest.approx(200.0)
    assert m.total_output_tokens == 4 and m.request_throughput == pytest.approx(2.0)
    report = format_report(m)
    assert "Failed requests:" in report and "HTTP 500: boom" in report and "ReadTimeout" in report


def test_identical_failures_are_grouped_but_none_is_lost():
    results = [failed("HTTP 429: busy") for _ in range(30)] + [failed("HTTP 500: boom")]
    m = calculate_metrics(results, duration_s=1.0)
    assert len(m.failures) == 31
    groups = group_failures(m.failures)
    assert groups[0] == ("HTTP 429: busy", list(range(30)))
    assert groups[1] == ("HTTP 500: boom", [30])
    report = format_report(m)
    assert "30 x HTTP 429: busy" in report and "and 10 more" in report and "1 x HTTP 500: boom" in report
    assert m.ttft_ms is None and m.output_throughput == 0.0


def test_length_mismatches_are_reported():
    m = calculate_metrics([ok(0.1, [0.1], output_tokens=2, expected=8), ok(0.1, [0.1], output_tokens=2)], 1.0)
    assert m.length_mismatches == 1
    assert "different number of tokens" in format_report(m)


def test_peak_concurrency_from_start_times_and_latencies():
    results = [ok(0.5, [], 1, start=0.0), ok(0.5, [], 1, start=0.2), ok(0.5, [], 1, start=0.4),
               ok(0.5, [], 1, start=1.0)]
    assert max_concurrency(results) == 3
    # Back to back (one ends as the next starts) is not an overlap.
    assert max_concurrency([ok(0.5, [], 1, start=0.0), ok(0.5, [], 1, start=0.5)]) == 1
    assert max_concurrency([]) == 0


def test_goodput_counts_requests_meeting_every_slo():
    results = [ok(0.1, [0.01] * 9, 10), ok(0.6, [0.01] * 9, 10), ok(0.1, [0.2] * 9, 10), ok(0.1, [], 1)]
    m = calculate_metrics(results, duration_s=2.0, slos_ms={"ttft": 500, "tpot": 50})
    # The slow-TTFT and slow-TPOT requests miss; the single-token one has no TPOT and meets it.
    assert m.goodput == pytest.approx(1.0)
    assert calculate_metrics(results, duration_s=2.0).goodput is None


def test_duration_must_be_positive():
    with pytest.raises(ValueError):
        calculate_metrics([], duration_s=0.0)


def test_metrics_serialize_to_plain_dicts():
    d = calculate_metrics([ok(0.1, [0.1], 2)], 1.0).to_dict()
    assert d["ttft_ms"]["percentiles"]["p99"] == pytest.approx(100.0)
    assert d["failures"] == []
