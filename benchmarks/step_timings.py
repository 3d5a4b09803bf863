"""Where a served run's decode time went, from the server's own /metrics counters.

    python -m benchmarks.step_timings METRICS_FILE   # the text of GET /metrics after the run

The dispatch thread times its step calls (jaxserve.engine.core._Dispatcher): seconds inside them
(on a GPU a decode loop's call returns when the loop has run, so that is the device's time) and
seconds handing over from one call's return to the next call, already waiting (host time, in
which the device may sit idle). Per output token these compare directly with the device-bound step
of benchmarks.step_profile when one request runs at a time (concurrency 1: one token per decode
iteration); with more rows a token is a fraction of an iteration. A GPU prefill's call returns once
queued, so its device time lands in the next call's seconds (small against 1,024 output tokens).
"""

from __future__ import annotations

import argparse
import sys


def read_counters(text: str) -> dict[str, float]:
    """name -> value of the unlabelled samples of a Prometheus text exposition."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


def summary(counters: dict[str, float]) -> str:
    tokens = counters.get("jaxserve:generation_tokens_total", 0.0)
    calls = counters.get("jaxserve:step_calls_total", 0.0)
    inside = counters.get("jaxserve:step_call_seconds_total", 0.0)
    handover = counters.get("jaxserve:step_handover_seconds_total", 0.0)
    if not tokens or not calls:
        return "no output tokens or step calls counted"
    return (f"{tokens:.0f} output tokens, {calls:.0f} step calls: per output token {1e3 * inside / tokens:.3f} ms "
            f"inside step calls, {1e3 * handover / tokens:.3f} ms handing over between them; "
            f"{1e3 * inside / calls:.2f} ms inside a call on average")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_timings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="a file holding the text of the server's GET /metrics")
    args = p.parse_args(argv)
    with open(args.metrics) as f:
        print(summary(read_counters(f.read())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
