"""The mixture-of-experts grouped product on this device: jaxserve's (the Pallas Triton kernel on a
GPU, the chunk loop on the CPU, XLA's ragged dot on a TPU: `jaxserve.models.moe.grouped_matmul`)
against `lax.ragged_dot` as XLA compiles it here, at Qwen3-30B-A3B's expert shapes.

Each case routes `tokens` tokens to `top_k` of `experts` experts at random (as a router would
spread them), sorts the rows by expert and times one projection (gate: [hidden -> width]). The
floor is the bytes of the experts the rows were routed to, read once, at the device's bandwidth
(--bandwidth, GB/s): a decode step at batch 1 needs 8 of the 128 experts, one at batch 64 nearly
all of them.

    python -m benchmarks.moe_kernels [--tokens 1 64 2048] [--bandwidth 3350] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def _time(f, *args, repeats: int) -> float:
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def run(tokens: list[int], experts: int, top_k: int, hidden: int, width: int, bandwidth: float, repeats: int,
        skip_xla: bool) -> list[dict]:
    from jaxserve.models.moe import grouped_matmul

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((experts, hidden, width)) * 0.02, jnp.bfloat16)
    ours = jax.jit(grouped_matmul)
    xla = jax.jit(lambda x, c, w: jax.lax.ragged_dot(x, w, c))
    results = []
    for n in tokens:
        ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(n)]).reshape(-1)
        counts = jnp.asarray(np.bincount(ids, minlength=experts), jnp.int32)
        x = jnp.asarray(rng.standard_normal((n * top_k, hidden)), jnp.bfloat16)
        hit = int((np.asarray(counts) > 0).sum())
        floor_s = hit * hidden * width * 2 / (bandwidth * 1e9)
        row = {"tokens": n, "rows": n * top_k, "experts_hit": hit, "floor_ms": floor_s * 1e3,
               "ours_ms": _time(ours, x, counts, w, repeats=repeats) * 1e3}
        if not skip_xla:
            row["xla_ragged_dot_ms"] = _time(xla, x, counts, w, repeats=repeats) * 1e3
        row["ours_of_floor"] = row["floor_ms"] / row["ours_ms"]
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 2048],
                   help="tokens per case (each routed to --top-k experts)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048, help="the projection's input width (K)")
    p.add_argument("--width", type=int, default=768, help="an expert's width (N)")
    p.add_argument("--bandwidth", type=float, default=3350.0, help="the device's memory bandwidth, GB/s (H100 SXM)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-xla", action="store_true", help="time only jaxserve's product")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}", flush=True)
    results = run(args.tokens, args.experts, args.top_k, args.hidden, args.width, args.bandwidth, args.repeats,
                  args.skip_xla)
    if args.out is not None:
        args.out.write_text(json.dumps({"device": jax.devices()[0].device_kind, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
