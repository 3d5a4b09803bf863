"""The scheduler alone on a serving wave, no device: how many steps of each kind, preemptions and
recomputed tokens a workload costs for a given KV cache, on any machine in a second.

    python -m benchmarks.schedule_sim --num-pages 26187 --concurrency 256 --input-len 1024 --output-len 1024

The real `jaxserve.engine.scheduler.Scheduler` plans every step; a stand-in for the device appends
the tokens a step would sample (a decode row runs the step's iterations, ending at its length, as
the device loop does). The defaults are the H100 serving wave of benchmarks/RESULTS.md (Llama-3-8B,
26,187 pages of 16 tokens after --gpu-memory-utilization 0.92): prefill and decode steps are what the
device time of that run splits into, and each step is one host round trip.
"""

from __future__ import annotations

import argparse
import collections

from jaxserve.config import SchedulerConfig
from jaxserve.engine.pages import PageAllocator
from jaxserve.engine.request import FinishReason, SamplingParams, Sequence
from jaxserve.engine.scheduler import Scheduler


def simulate(num_pages: int, page_size: int, concurrency: int, input_len: int, output_len: int,
             config: SchedulerConfig) -> dict[str, int]:
    """Run one wave of `concurrency` requests to completion; counts by step kind and totals."""
    scheduler = Scheduler(config, PageAllocator(num_pages, page_size, True), page_size)
    for i in range(concurrency):
        # Distinct prompts (no prefix hits): each request's tokens start at its own offset.
        prompt = [(i * input_len + j) % 50000 + 100 for j in range(input_len)]
        total = scheduler.check_fits(input_len, output_len)
        scheduler.add(Sequence(f"r{i}", prompt, input_len, SamplingParams(max_tokens=output_len, ignore_eos=True), total))
    counts: collections.Counter[str] = collections.Counter()
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        if plan.prefills:
            counts["steps: prefill" + (" + decode" if plan.decodes else "")] += 1
        elif plan.decodes:
            counts[f"steps: decode x{plan.num_steps}" + (", preempting" if plan.preempted else "")] += 1
        counts["preemptions"] += len(plan.preempted)
        counts["prefill tokens"] += sum(c.num_tokens for c in plan.prefills)
        counts["recomputed tokens"] += sum(c.num_tokens for c in plan.prefills if c.seq.num_preemptions)
        decoded = {}
        for seq in plan.decodes:
            decoded[seq] = min(plan.num_steps, seq.max_total_tokens - seq.num_tokens)
            seq.token_ids.extend([7] * decoded[seq])
        if plan.decodes:
            counts["decode iterations"] += plan.num_steps
        sampled = [c.seq for c in plan.prefills if c.samples]
        for seq in sampled:
            seq.token_ids.append(7)
        scheduler.advance(plan, decoded)
        counts["output tokens"] += len(sampled) + sum(decoded.values())
        for seq in sampled + plan.decodes:
            if seq.num_tokens >= seq.max_total_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
    counts["steps"] = sum(v for k, v in counts.items() if k.startswith("steps: "))
    return dict(counts)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.schedule_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-pages", type=int, default=26187, help="KV pages (the server logs 'KV cache: N pages')")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=256, help="requests in the wave, all arriving at once")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prefill-seqs", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=8)
    args = p.parse_args()
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_prefill_seqs=args.max_prefill_seqs, decode_steps=args.decode_steps,
                             max_model_len=args.input_len + args.output_len + args.page_size)
    counts = simulate(args.num_pages, args.page_size, args.concurrency, args.input_len, args.output_len, config)
    width = max(map(len, counts))
    for key in sorted(counts):
        print(f"{key:<{width}}  {counts[key]:>9,}")


if __name__ == "__main__":
    main()
