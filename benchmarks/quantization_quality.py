"""Greedy-token agreement of a quantized model with the unquantized one (issue #18's report):

    .venv/bin/python -m benchmarks.quantization_quality [--model PATH] [--quantization int8|int4|auto]
        [--quantization-group-size 32] [--kv-cache-dtype fp8_e4m3|fp8_e5m2]
        [--dtype bfloat16] [--reference-dtype float32] [--max-tokens 64] [--json OUT]

Twenty fixed chat prompts, each answered greedily (temperature 0, `--max-tokens` tokens, EOS
ignored so every answer has the same length) by the model with `--quantization none` and with the
asked quantization, through the offline `LLM` (the server's engine). Reports per prompt the length
of the common prefix, and over all prompts: answers identical, mean common prefix, and the share
of positions whose tokens agree. Greedy decoding amplifies the first differing token, so the
common prefix is the telling number. For scale, `--quantization none --reference-dtype float32`
measures how far bfloat16 alone moves the answers from float32's. `--kv-cache-dtype` quantizes the
KV cache of the compared run as the server's flag does (`--quantization none --kv-cache-dtype fp8`:
the 8-bit cache alone); the reference keeps the model's dtype. The perplexity comparison lives in
tests/model/test_quantized_quality.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

from jaxserve.config import KV_CACHE_DTYPES

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "What does a CPU cache do?",
    "Give me a recipe for pancakes.",
    "Who wrote Pride and Prejudice?",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
    "What is 17 times 23?",
    "Name the planets of the solar system in order.",
    "How do I make a cup of tea?",
    "What is the difference between a list and a tuple in Python?",
    "Describe a cat to someone who has never seen one.",
    "Suggest a name for a bakery.",
    "What causes the seasons on Earth?",
    "Write a short poem about autumn leaves.",
    "How many minutes are there in a day?",
]


def answers(model: str | None, dtype: str, quantization: str, max_tokens: int, group: int = 32,
            kv_cache_dtype: str = "auto") -> list[list[int]]:
    """Greedy token ids of every prompt's answer."""
    from jaxserve.engine.request import SamplingParams
    from jaxserve.llm import LLM

    llm = LLM(model, dtype=dtype, quantization=quantization, quantization_group_size=group, max_model_len=512,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    llm.close()
    return [o.outputs[0].token_ids for o in out]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(base: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    prefixes = [common_prefix(a, b) for a, b in zip(base, other)]
    positions = sum(len(a) for a in base)
    agree = sum(x == y for a, b in zip(base, other) for x, y in zip(a, b))
    return {"identical": sum(a == b for a, b in zip(base, other)), "prompts": len(base),
            "mean_common_prefix": sum(prefixes) / len(prefixes), "common_prefix": prefixes,
            "position_agreement": agree / positions}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the packaged SmolLM2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="int8", choices=["auto", "none", "int8", "int4"],
                   help="auto on a GGUF keeps its blocks (the server's default for the packaged SmolLM2)")
    p.add_argument("--quantization-group-size", type=int, default=32, choices=[32, 64, 128])
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the compared run's KV cache, as the server's flag (the reference's is --reference-dtype)")
    p.add_argument("--reference-dtype", default=None, help="the unquantized reference's dtype (default: --dtype)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    reference_dtype = args.reference_dtype or args.dtype
    base = answers(args.model, reference_dtype, "none", args.max_tokens)
    gc.collect()  # one engine's KV cache at a time
    other = answers(args.model, args.dtype, args.quantization, args.max_tokens, args.quantization_group_size,
                    args.kv_cache_dtype)
    report = {"model": args.model or "SmolLM2-135M-Instruct (packaged)", "dtype": args.dtype,
              "reference_dtype": reference_dtype, "quantization": args.quantization,
              "group_size": args.quantization_group_size, "kv_cache_dtype": args.kv_cache_dtype,
              "max_tokens": args.max_tokens,
              **compare(base, other)}
    kv = f" kv {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    print(f"{args.dtype} {args.quantization}{kv} vs {reference_dtype} none, {len(PROMPTS)} prompts x "
          f"{args.max_tokens} greedy tokens: {report['identical']}/{report['prompts']} answers identical, "
          "mean common prefix "
          f"{report['mean_common_prefix']:.1f} tokens, {100 * report['position_agreement']:.1f}% of positions agree")
    print("common prefix per prompt:", report["common_prefix"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
