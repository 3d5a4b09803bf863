"""Prometheus metrics in the text exposition format (no prometheus-client dependency).

Request-level numbers are recorded by the HTTP layer as deltas arrive; engine gauges (running,
waiting, KV pages, prefix-cache hit rate) and the engine's own counters (speculative tokens) are
read at scrape time. Names follow vLLM's, with a `jaxserve:` prefix, so existing dashboards need
only the prefix changed.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Callable

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)


def _fmt(value: float) -> str:
    return repr(float(value)) if value != int(value) or abs(value) > 2**53 else f"{float(value):.1f}"


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)] + ([extra] if extra else [])
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help, labels
        self.values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self.values[labels] = self.values.get(labels, 0.0) + amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        values = self.values or ({(): 0.0} if not self.label_names else {})
        lines += [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}" for k, v in sorted(values.items())]
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            i = bisect.bisect_left(self.buckets, value)
            if i < len(self.counts):
                self.counts[i] += 1
            self.sum += value
            self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {_fmt(self.sum)}",
                  f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        p = "jaxserve:"
        self.requests = Counter(p + "request_success_total", "Finished requests by finish reason.",
                                ("finished_reason",))
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated.")
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from submission to the first token.")
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from submission to the last token.")
        # (name, help, "gauge" or "counter", read): values the engine keeps, read at scrape time.
        self.readings: list[tuple[str, str, str, Callable[[], float]]] = []
        # (name, help, read): gauges whose labels carry the information, valued at the scrape's time.
        self.infos: list[tuple[str, str, Callable[[], dict[str, str]]]] = []

    def gauge(self, name: str, help: str, read: Callable[[], float]) -> None:
        self.readings.append(("jaxserve:" + name, help, "gauge", read))

    def info(self, name: str, help: str, read: Callable[[], dict[str, str]]) -> None:
        """A gauge whose labels (`read`) are the information, as vLLM's lora_requests_info; its value
        is the scrape's Unix time."""
        self.infos.append(("jaxserve:" + name, help, read))

    def counter(self, name: str, help: str, read: Callable[[], float]) -> None:
        """A running total the engine keeps (`read` never goes down), named with its `_total`."""
        self.readings.append(("jaxserve:" + name, help, "counter", read))

    def render(self) -> str:
        lines: list[str] = []
        for name, help, kind, read in self.readings:
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {_fmt(read())}"]
        for name, help, labels in self.infos:
            values = labels()
            lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge",
                      f"{name}{_labels(tuple(values), tuple(values.values()))} {_fmt(time.time())}"]
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            lines += metric.render()
        return "\n".join(lines) + "\n"
