"""PNG plots of serving-benchmark reports: latency CDFs, and throughput/latency versus concurrency.

    python -m benchmarks.serving_plots --out-dir DIR report1.json [report2.json ...]

draws several reports (one per server) on the same axes, side by side. `benchmarks.serving
--plot-dir` calls plot_report for its own report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from benchmarks.serving_metrics import LATENCY_METRICS, METRIC_NAMES

# Per-request fields behind each latency CDF ("itl" is a list per request, stored with --save-detailed).
_CDF_FIELDS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2el"}
_LINESTYLES = ["-", "--", ":", "-."]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _values_ms(run: dict[str, Any], metric: str) -> list[float]:
    values: list[float] = []
    for rec in run.get("requests", []):
        if not rec.get("success"):
            continue
        value = rec.get(_CDF_FIELDS[metric])
        if isinstance(value, list):
            values.extend(v * 1000 for v in value)
        elif value is not None:
            values.append(value * 1000)
    return values


def plot_latency_cdfs(series: Sequence[tuple[str, dict[str, Any]]], path: Path, title: str = "",
                      styles: Sequence[tuple[str, str]] | None = None) -> Path:
    """One panel per latency metric; one empirical CDF per (label, run). styles gives each
    series its (color, linestyle): by default a colour per series."""
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, metric in zip(axes.flat, LATENCY_METRICS):
        drawn, lo, hi = False, None, None
        for i, (label, run) in enumerate(series):
            values = np.sort(np.asarray(_values_ms(run, metric)))
            if values.size == 0:
                continue
            # Start the staircase at 0 so the first request's step is visible.
            xs = np.concatenate([values[:1], values])
            ys = np.concatenate([[0.0], np.arange(1, values.size + 1) / values.size])
            color, style = styles[i] if styles else (f"C{i % 10}", _LINESTYLES[(i // 10) % len(_LINESTYLES)])
            ax.step(xs, ys, where="post", label=label, color=color, linestyle=style)
            drawn = True
            lo, hi = (values[0], values[-1]) if lo is None else (min(lo, values[0]), max(hi, values[-1]))
        ax.set_title(METRIC_NAMES[metric])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if drawn:
            # Log scale only when the values span more than a decade (servers compared side by side).
            if lo > 0 and hi / lo > 20:
                ax.set_xscale("log")
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data" + (" (--save-detailed stores ITLs)" if metric == "itl" else ""),
                    ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title or "Latency CDFs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_points(report: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(max concurrency, metrics) of each run that had a concurrency limit, in order."""
    points = [(run["max_concurrency"], run["metrics"]) for run in report["runs"] if run.get("max_concurrency")]
    return sorted(points, key=lambda p: p[0])


def _stat(metrics: dict[str, Any], metric: str, key: str) -> float | None:
    d = metrics.get(f"{metric}_ms")
    if not d:
        return None
    return d["percentiles"].get(key) if key.startswith("p") else d.get(key)


def plot_sweep(series: Sequence[tuple[str, list[tuple[int, dict[str, Any]]]]], path: Path, title: str = "") -> Path:
    """Output tokens/s, TTFT (median and p99) and TPOT (median) versus concurrency, one line
    per label. Points may lack latency metrics (an offline reference has only some)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("output_throughput", None, "output tokens/s"), ("ttft", "median", "TTFT (ms)"),
              ("tpot", "median", "TPOT (ms)")]
    for ax, (metric, key, ylabel) in zip(axes, panels):
        y_all: list[float] = []
        for i, (label, points) in enumerate(series):
            color = f"C{i % 10}"
            keys = [key] + (["p99"] if metric == "ttft" else []) if key else [None]
            for k, style in zip(keys, ["-", "--"]):
                xs, ys = [], []
                for c, m in points:
                    y = m.get(metric) if k is None else _stat(m, metric, k)
                    if y is not None:
                        xs.append(c)
                        ys.append(y)
                if xs:
                    suffix = "" if k is None or metric != "ttft" else f" {k}"
                    ax.plot(xs, ys, style, marker="o", color=color, label=f"{label}{suffix}")
                    y_all.extend(ys)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
            all_x = sorted({c for _, pts in series for c, _ in pts})
            ax.set_xticks(all_x, [str(c) for c in all_x])
        # Servers compared side by side can differ by orders of magnitude in latency; a log axis
        # then keeps the fast one readable. Otherwise a linear axis from 0 reads honestly.
        if metric != "output_throughput" and y_all and min(y_all) > 0 and max(y_all) / min(y_all) > 20:
            ax.set_yscale("log")
        elif y_all:
            ax.set_ylim(0, max(y_all) * 1.1)
    fig.suptitle(title or "Throughput and latency versus concurrency")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """The plots of one report: latency CDFs of every run; the sweep plot when it has >1 run."""
    out_dir = Path(out_dir)
    stem = _slug(report.get("label", "serving"))
    paths = [plot_latency_cdfs([(run["label"], run) for run in report["runs"]], out_dir / f"{stem}_latency_cdf.png",
                               f"Latency CDFs: {report.get('label', '')}")]
    points = sweep_points(report)
    if len(points) > 1:
        paths.append(plot_sweep([(report.get("label", "server"), points)], out_dir / f"{stem}_sweep.png"))
    return paths


def plot_comparison(reports: Sequence[dict[str, Any]], out_dir: Path, extra: Sequence[tuple[str, list]] = (),
                    prefix: str = "comparison") -> list[Path]:
    """Several servers on the same axes: the sweep plot, and the latency CDFs of every run."""
    out_dir = Path(out_dir)
    series = [(r.get("label", f"report {i}"), sweep_points(r)) for i, r in enumerate(reports)] + list(extra)
    runs = [(run["label"], run) for r in reports for run in r["runs"]]
    # A colour per server, a line style per run (concurrency level) within it.
    styles = [(f"C{i % 10}", _LINESTYLES[j % len(_LINESTYLES)]) for i, r in enumerate(reports)
              for j, _ in enumerate(r["runs"])]
    return [plot_sweep(series, out_dir / f"{prefix}_sweep.png"),
            plot_latency_cdfs(runs, out_dir / f"{prefix}_latency_cdf.png", styles=styles)]


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text).strip("_") or "serving"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving_plots", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=Path, help="JSON files written by benchmarks.serving --result-json")
    p.add_argument("--out-dir", type=Path, required=True, help="where the PNG files go")
    p.add_argument("--prefix", default="comparison", help="file name prefix (default: %(default)s)")
    args = p.parse_args(argv)
    reports = []
    for path in args.reports:
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"{path}: {e}")
    for out in plot_comparison(reports, args.out_dir, prefix=args.prefix):
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
