"""The CPU's matrix products at decode shapes: XLA:CPU's dot, and the native bfloat16 kernel.

    python -m benchmarks.cpu_matmul [--rows 1 2 16] [--dtypes float32 bfloat16 int8 q4 q8] [--repeats 5]
                                    [--impls xla native]

For SmolLM2-135M's weight shapes (576x1536, 1536x576 and the 576x49152 head) and each dtype and
row count, times `x @ W` over 30 distinct weight matrices (so they come from memory, as in a
30-layer step, not from cache) and prints ms per product, GB/s of weights read and GFLOP/s.
int8 is s8 x s8 -> s32, the product a weight-and-activation int8 scheme would need. The head is
multiplied as the model does it, by the [vocab, hidden] embedding transposed. `native` is
`pallas_kernels.cpu_matmul` (bfloat16 only; --matmul-backend cpu), timed the same way. q4 and q8
are bfloat16 activations times block-quantized weights in groups of 32 (GGUF Q4_1 / Q8_0 blocks,
--quantization auto on a GGUF; q4 is also --quantization int4): `native` is
`pallas_kernels.cpu_qmatmul`, `xla` dequantizes into XLA's dot. GB/s counts their bytes with scales.

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


def time_product(dtype: str, rows: int, k: int, n: int, repeats: int, impl: str = "xla") -> float:
    """Milliseconds per [rows, k] x [k, n] product, best of `repeats` runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    head = n >= 10_000
    count = 1 if head else LAYERS  # the head is one matrix; 30 of them would not be a step
    if dtype == "int8":
        x = jnp.asarray(rng.integers(-127, 127, (rows, k)), jnp.int8)
        ws = [jnp.asarray(rng.integers(-127, 127, (k, n)), jnp.int8) for _ in range(count)]

        def products(x, ws):
            return sum(jax.lax.dot(x, w, preferred_element_type=jnp.int32).sum() for w in ws)
    else:
        from jaxserve.models import products as model_products

        blocks = dtype in ("q4", "q8")
        x = jnp.asarray(rng.standard_normal((rows, k)), "bfloat16" if blocks else dtype)
        shape = (n, k) if head else (k, n)
        ws = [jnp.asarray(rng.standard_normal(shape) * 0.02, "float32" if blocks else dtype) for _ in range(count)]
        if blocks:
            ws = [_blocks(w.T if head else w, dtype, impl) for w in ws]
        elif impl == "native":  # the weight's type picks the product; packed once, as at start-up
            ws = [model_products.CpuWeight.pack(w, transposed=head) for w in ws]
        product = model_products.head if head else model_products.linear

        def products(x, ws):
            return sum(product(x, w).astype(jnp.float32).sum() for w in ws)

    f = jax.jit(products)
    f(x, ws).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(x, ws).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best * 1e3 / count


def _blocks(kernel, dtype: str, impl: str):
    """A [K, N] weight as the server keeps a GGUF's Q4_1 / Q8_0 blocks (groups of 32)."""
    from jaxserve.models import products as model_products
    from pallas_kernels import cpu_qmatmul

    if dtype == "q4":
        b = model_products.Blocks(*cpu_qmatmul.quantize_q4(kernel, 32), 4)
    else:
        b = model_products.Blocks(*cpu_qmatmul.quantize_q8(kernel, 32), None, 8)
    return model_products.CpuGroupWeight.of(b) if impl == "native" else model_products.GroupWeight.of(b)


BYTES = {"float32": 4, "bfloat16": 2, "int8": 1, "q4": 0.5 + 4 / 32, "q8": 1 + 2 / 32}  # per weight, scales included


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 16])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"], choices=list(BYTES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--impls", nargs="+", default=["xla", "native"], choices=["xla", "native"],
                   help="native: the kernels of pallas_kernels/cpu_matmul.cc and cpu_qmatmul.cc (skipped where "
                   "they do not build: they need AVX512-BF16, or AVX2 with FMA)")
    args = p.parse_args()
    if min(args.rows) < 1 or args.repeats < 1:
        p.error("--rows and --repeats must be >= 1")
    from pallas_kernels import cpu_matmul, cpu_qmatmul

    print(f"{'dtype':9s} {'impl':6s} {'rows':>4s} {'shape':>11s} {'ms':>8s} {'GB/s':>6s} {'GFLOP/s':>8s}")
    for dtype in args.dtypes:
        size = BYTES[dtype]
        native = {"bfloat16": cpu_matmul.available(), "q4": cpu_qmatmul.available(), "q8": cpu_qmatmul.available()}
        impls = [i for i in args.impls if i == "xla" or native.get(dtype, False)]
        for rows in args.rows:
            for k, n in SHAPES:
                for impl in impls:
                    ms = time_product(dtype, rows, k, n, args.repeats, impl)
                    print(f"{dtype:9s} {impl:6s} {rows:4d} {f'{k}x{n}':>11s} {ms:8.3f} {k * n * size / ms / 1e6:6.1f} "
                          f"{2 * rows * k * n / ms / 1e6:8.1f}", flush=True)


if __name__ == "__main__":
    main()
