"""The device's achievable read bandwidth, and the decode floor it sets for a model's weights.

    JAX_PLATFORMS=cuda python -m benchmarks.hbm_bandwidth [--gib 8] [--weights-gb 16.06]

A batch-1 decode step reads every weight once, so its floor is the weights' bytes over what the
memory can stream. The goals in benchmarks/RESULTS.md were set on an H100 against 2.66 TB/s (6.0 ms
for Llama-3-8B's 16.06 GB); a lent card of another kind (an H200 streams ~1.4x an H100) needs its
own figure, and this measures it in the same run as the rest of the suite: the median time of a
sum over a `--gib` bfloat16 array (a read-bound reduction, as the weight reads of a decode step
are).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def measure(gib: float, repeats: int) -> dict[str, float]:
    """Read bandwidth in bytes per second of a sum over `gib` GiB of bfloat16, median of `repeats`."""
    import jax
    import jax.numpy as jnp

    from benchmarks.kernels import time_call

    n = int(gib * (1 << 30)) // 2
    x = jax.jit(lambda: jnp.ones((n,), jnp.bfloat16))()
    read = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    seconds = time_call(lambda: read(x), warmup=1, repeats=repeats, inner=1)
    return {"bytes": 2.0 * n, "seconds": seconds, "bytes_per_s": 2.0 * n / seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=8.0, help="size of the array read, GiB (default 8)")
    p.add_argument("--repeats", type=int, default=20, help="timed reads; the median is reported")
    p.add_argument("--weights-gb", type=float, default=16.06,
                   help="model weights read per decode step, GB (default: Llama-3-8B in bfloat16)")
    p.add_argument("--out", type=Path, help="write the result as JSON here too")
    args = p.parse_args(argv)
    import jax

    result = measure(args.gib, args.repeats)
    result["device"] = str(jax.devices()[0].device_kind)
    result["floor_ms"] = args.weights_gb * 1e9 / result["bytes_per_s"] * 1e3
    print(f"{result['device']}: read {result['bytes_per_s'] / 1e12:.2f} TB/s ({args.gib:g} GiB in "
          f"{result['seconds'] * 1e3:.2f} ms); a batch-1 decode of {args.weights_gb:g} GB of weights: "
          f">= {result['floor_ms']:.2f} ms a token (at 90% of the floor's rate: {result['floor_ms'] / 0.9:.2f} ms)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
