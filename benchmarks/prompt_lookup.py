"""Prompt-lookup (n-gram) speculative decoding against plain decoding, batch 1, same run.

    python -m benchmarks.prompt_lookup [--model PATH] [--rounds 3] [--max-tokens 200] [--temperature 0]
                                       [--num-speculative-tokens 5] [--max-ngram-size 3] [--json out.json]

Two engines of the same model in one process (the default: the embedded SmolLM2 GGUF with the
server's default CPU settings), one with --speculative-method ngram. Each round sends every
workload prompt to both, one request at a time (batch 1), alternating which goes first (greedy
unless --temperature). The workloads are copy-heavy edits of a text shipped here (repeat it, fix
its typos, change one name in a code block) and one that need not copy anything (an open
question), where drafts are found only if the answer repeats itself. Reported per workload:
output tokens/s of each engine (tokens / request wall time, mean over rounds), the speed-up, and
the acceptance rate (accepted / proposed draft tokens). The two engines must give identical
outputs, and the run fails if they do not: greedy by default, or with --temperature T > 0 sampled
with seed r in round r (a verify step draws exactly what decoding without it draws).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt and "
             "wind. Every evening the keeper climbed the spiral stairs, trimmed the wick, and watched the beam sweep "
             "across the dark water until the fishing boats were safely home. In winter the storms came early, and "
             "the keeper wrote each one into the logbook: the date, the wind, the height of the waves, and the "
             "names of the boats that had not yet returned.")
TYPOS = PARAGRAPH.replace("lighthouse", "lighthuose").replace("evening", "evenning").replace("water", "watter")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''

WORKLOADS = {
    "repeat": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "fix typos": f"Fix the spelling mistakes in this paragraph and write it out again in full:\n\n{TYPOS}",
    "rename": f"Rename the variable `subtotal` to `net` in this code and print the whole code again:\n\n{CODE}",
    "open question": "Write a short poem about autumn leaves.",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--max-ngram-size", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()

    from jaxserve import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.max_ngram_size}
    engines = {"plain": LLM(args.model, max_num_seqs=1), "ngram": LLM(args.model, max_num_seqs=1, speculative_config=spec)}
    greedy = args.temperature == 0.0
    rates: dict[str, dict[str, list[float]]] = {w: {"plain": [], "ngram": []} for w in WORKLOADS}
    counts = {w: {"plain": 0, "ngram": 0} for w in WORKLOADS}
    drafted = {w: [0, 0] for w in WORKLOADS}
    for name, llm in engines.items():  # warm-up: first-request costs (tokenizer caches, allocations)
        llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0.0, max_tokens=8))
    for round_ in range(args.rounds):
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=round_)
        for workload, prompt in WORKLOADS.items():
            got = {}
            for name in order:
                start = time.perf_counter()
                out = engines[name].chat([[{"role": "user", "content": prompt}]], params)[0]
                wall = time.perf_counter() - start
                got[name] = out.outputs[0].token_ids
                rates[workload][name].append(len(got[name]) / wall)
                counts[workload][name] += len(got[name])
                if name == "ngram":
                    drafted[workload][0] += out.num_draft_tokens
                    drafted[workload][1] += out.num_accepted_draft_tokens
            if got["plain"] != got["ngram"]:
                raise SystemExit(f"{workload}, round {round_}: speculative output differs from plain decoding")
    results = {}
    print(f"{'workload':<14} {'tokens':>6} {'plain tok/s':>12} {'ngram tok/s':>12} {'speed-up':>9} {'accepted':>9}")
    for workload in WORKLOADS:
        plain, ngram = (statistics.mean(rates[workload][n]) for n in ("plain", "ngram"))
        proposed, accepted = drafted[workload]
        acceptance = accepted / proposed if proposed else 0.0
        results[workload] = {"tokens": counts[workload]["plain"] / args.rounds, "plain_tok_s": plain,
                             "ngram_tok_s": ngram, "speedup": ngram / plain, "acceptance": acceptance,
                             "draft_tokens": proposed / args.rounds, "greedy": greedy}
        print(f"{workload:<14} {results[workload]['tokens']:>6.0f} {plain:>12.1f} {ngram:>12.1f} "
              f"{ngram / plain:>8.2f}x {acceptance:>8.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
