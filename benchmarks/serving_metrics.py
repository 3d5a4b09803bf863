"""Serving metrics from per-request timelines: pure functions, no I/O, no clock.

Definitions follow vLLM's benchmark documentation (`vllm bench serve`):

- TTFT (time to first token): from sending the request to receiving the first chunk that
  carries generated text.
- ITL (inter-token latency): the gaps between consecutive content chunks of one request, all
  requests' gaps pooled. A chunk holding several tokens is one gap (what a client sees).
- TPOT (time per output token): per request, (E2E - TTFT) / (output tokens - 1), so prefill is
  excluded; requests with a single output token have no TPOT.
- E2E latency: from sending the request to receiving its last byte.
- Throughputs divide totals over successful requests by the benchmark's wall time (first request
  sent to last one finished). Failed requests count in no throughput and no latency, and are
  listed one by one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to first token", "tpot": "Time per output token (excl. 1st)",
                "itl": "Inter-token latency", "e2el": "End-to-end latency"}


@dataclasses.dataclass
class RequestResult:
    """What one request did, timed by the client (seconds; perf_counter based)."""

    prompt_len: int                 # input tokens: the server's count when it reports one
    expected_output_len: int        # max_tokens asked for
    success: bool = False
    output_tokens: int = 0
    output_tokens_source: str = ""  # "usage" (server count), "tokenizer" (re-encoded text) or "chunks"
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0            # end to end
    start_time: float = 0.0         # seconds after the benchmark started
    error: str = ""
    generated_text: str = ""
    finish_reason: str | None = None  # as the server named it: length, stop, abort, ...

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclasses.dataclass
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    count: int
    mean: float
    median: float
    std: float
    min: float
    max: float
    percentiles: dict[str, float]  # "p90" -> ms

    def get(self, stat: str) -> float:
        """'mean', 'median', 'std', 'min', 'max' or 'pNN'."""
        return self.percentiles[stat] if stat.startswith("p") else getattr(self, stat)


@dataclasses.dataclass
class BenchmarkMetrics:
    duration_s: float
    num_requests: int
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float       # successful requests / s
    input_throughput: float         # input tokens / s
    output_throughput: float        # output tokens / s
    total_token_throughput: float   # (input + output) tokens / s
    max_concurrent_requests: int    # most requests in flight at one time (client side)
    length_mismatches: int          # successful requests whose output length differs from max_tokens
    goodput: float | None           # requests / s meeting every SLO (None: no SLO given)
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2el_ms: Distribution | None
    failures: list[dict[str, Any]]  # {"index", "error"} per failed request

    def latency(self, metric: str) -> Distribution | None:
        return getattr(self, f"{metric}_ms")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def percentile_key(p: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9'."""
    return f"p{p:g}"


def summarize(values_s: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Distribution | None:
    """mean/median/std/min/max and percentiles (linear interpolation, numpy's default as in
    vLLM) of values in seconds, reported in milliseconds; None when there are no values."""
    if len(values_s) == 0:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return Distribution(
        count=int(ms.size), mean=float(ms.mean()), median=float(np.median(ms)), std=float(ms.std()),
        min=float(ms.min()), max=float(ms.max()),
        percentiles={percentile_key(p): float(np.percentile(ms, p)) for p in percentiles},
    )


def max_concurrency(results: Iterable[RequestResult]) -> int:
    """The most requests in flight at once, from their start times and latencies."""
    events = []
    for r in results:
        events.append((r.start_time, 1))
        events.append((r.start_time + r.latency, -1))
    # Ends sort before starts at the same instant: back-to-back requests do not overlap.
    events.sort(key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (ttft, tpot, e2el in ms; a request with no
    TPOT meets a TPOT SLO trivially)."""
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    for name, limit in slos_ms.items():
        value = values[name]
        if value is not None and value * 1000.0 > limit:
            return False
    return True


def calculate_metrics(results: Sequence[RequestResult], duration_s: float,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                      slos_ms: dict[str, float] | None = None) -> BenchmarkMetrics:
    """Aggregate metrics over one benchmark run; results in request order (index = position)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    return BenchmarkMetrics(
        duration_s=duration_s,
        num_requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        input_throughput=total_in / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        max_concurrent_requests=max_concurrency(results),
        length_mismatches=sum(r.output_tokens != r.expected_output_len for r in ok),
        goodput=(sum(meets_slos(r, slos_ms) for r in ok) / duration_s) if slos_ms else None,
        ttft_ms=summarize([r.ttft for r in ok], percentiles),
        tpot_ms=summarize(tpots, percentiles),
        itl_ms=summarize([gap for r in ok for gap in r.itl], percentiles),
        e2el_ms=summarize([r.latency for r in ok], percentiles),
        failures=[{"index": i, "error": r.error} for i, r in enumerate(results) if not r.success],
    )


_MAX_INDICES_SHOWN = 20


def group_failures(failures: Sequence[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    """(error, request indices) per distinct error, most frequent first: a thousand identical
    failures are one line, and no distinct error is lost."""
    groups: dict[str, list[int]] = {}
    for f in failures:
        groups.setdefault(f["error"], []).append(f["index"])
    return sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))


def format_report(m: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """The human-readable summary printed after a run (vLLM's layout, plus the failures)."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<{w - 12}}{format(value, fmt) if value is not None else '-':>12}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s, ".2f")
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.goodput is not None:
        row("Request goodput (req/s):", m.goodput, ".2f")
    row("Input token throughput (tok/s):", m.input_throughput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")
    row("Peak concurrent requests:", m.max_concurrent_requests)
    for metric in LATENCY_METRICS:
        d = m.latency(metric)
        lines.append(f"{' ' + METRIC_NAMES[metric] + ' ':-^{w}}")
        if d is None:
            lines.append("(no data)")
            continue
        label = metric.upper()
        row(f"Mean {label} (ms):", d.mean, ".2f")
        row(f"Median {label} (ms):", d.median, ".2f")
        for key, value in d.percentiles.items():
            if key == "p50":  # the median, printed above
                continue
            row(f"P{key[1:]} {label} (ms):", value, ".2f")
    lines.append("=" * w)
    if m.length_mismatches:
        lines.append(f"note: {m.length_mismatches} successful request(s) generated a different number of tokens "
                     "than max_tokens (EOS or a stop string ended them: is --ignore-eos honoured?)")
    if m.failures:
        lines.append(f"{m.failed} failed request(s) (request numbers count from 0):")
        for error, indices in group_failures(m.failures):
            shown = ", ".join(f"#{i}" for i in indices[:_MAX_INDICES_SHOWN])
            more = f" and {len(indices) - _MAX_INDICES_SHOWN} more" if len(indices) > _MAX_INDICES_SHOWN else ""
            lines.append(f"  {len(indices)} x {error}\n      requests {shown}{more}")
    return "\n".join(lines)
