"""XLA:CPU's matrix products at decode shapes: what a CPU decode step can reach at all.

    python -m benchmarks.cpu_matmul [--rows 1 2 16] [--dtypes float32 bfloat16 int8] [--repeats 5]

For SmolLM2-135M's weight shapes (576x1536, 1536x576 and the 576x49152 head) and each dtype and
row count, times `x @ W` over 30 distinct weight matrices (so they come from memory, as in a
30-layer step, not from cache) and prints ms per product, GB/s of weights read and GFLOP/s.
int8 is s8 x s8 -> s32, the product a weight-and-activation int8 scheme would need.

Why it exists: at batch 1 a decode step reads every weight once, so the best ITL is the weight
bytes over this bandwidth. On the 2-core AMD EPYC box (benchmarks/RESULTS.md) float32 reads run
at ~25-30 GB/s, while one-row bfloat16 and int8 products fall to a plain loop at ~1 GB/s (two
rows already go to the matmul library), so smaller weights do not buy a faster batch-1 step.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

SHAPES = ((576, 1536), (1536, 576), (576, 49152))
LAYERS = 30


def time_product(dtype: str, rows: int, k: int, n: int, repeats: int) -> float:
    """Milliseconds per [rows, k] x [k, n] product, best of `repeats` runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    count = LAYERS if n < 10_000 else 1  # the head is one matrix; 30 of them would not be a step
    if dtype == "int8":
        x = jnp.asarray(rng.integers(-127, 127, (rows, k)), jnp.int8)
        ws = [jnp.asarray(rng.integers(-127, 127, (k, n)), jnp.int8) for _ in range(count)]

        def products(x, ws):
            return sum(jax.lax.dot(x, w, preferred_element_type=jnp.int32).sum() for w in ws)
    else:
        x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
        ws = [jnp.asarray(rng.standard_normal((k, n)) * 0.02, dtype) for _ in range(count)]

        def products(x, ws):
            return sum((x @ w).astype(jnp.float32).sum() for w in ws)

    f = jax.jit(products)
    f(x, ws).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(x, ws).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best * 1e3 / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 16])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"], choices=["float32", "bfloat16", "int8"])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if min(args.rows) < 1 or args.repeats < 1:
        p.error("--rows and --repeats must be >= 1")
    print(f"{'dtype':9s} {'rows':>4s} {'shape':>11s} {'ms':>8s} {'GB/s':>6s} {'GFLOP/s':>8s}")
    for dtype in args.dtypes:
        size = 4 if dtype == "float32" else 2 if dtype == "bfloat16" else 1
        for rows in args.rows:
            for k, n in SHAPES:
                ms = time_product(dtype, rows, k, n, args.repeats)
                print(f"{dtype:9s} {rows:4d} {f'{k}x{n}':>11s} {ms:8.3f} {k * n * size / ms / 1e6:6.1f} "
                      f"{2 * rows * k * n / ms / 1e6:8.1f}", flush=True)


if __name__ == "__main__":
    main()
