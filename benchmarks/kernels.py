"""Paged-attention kernels on the GPU: decode bandwidth and prefill TFLOP/s, all baselines in one run.

    python -m benchmarks.kernels [--batch 1 8 64 256] [--context 512 2048 8192] [--page-size 16 32]
                                 [--prefill-chunk 512 2048] [--out benchmarks/out/kernels.json]

Decode (32 q heads, 8 kv heads, head_dim 128, bf16 by default): for every batch x context x page
size that fits, the time of one attention call and its effective KV bandwidth (bytes of K and V
the call must read / time) for
  - ours:      `pallas_kernels.gpu_paged_attention` (best of a few block/split settings; with an
               8-bit cache also `ours_bf16_dots`, its dots in bfloat16 instead of float16),
  - jax:       `jax.experimental.pallas.ops.gpu.paged_attention` (best of its block settings),
  - xla:       the pure-jnp reference as one dense gather + attention (GPU.md's XLA baseline),
  - xla_chunk: the pure-jnp reference with its default page chunking (the CPU serving path).
Ours and the references read the engine's layout: a stacked cache of `--layers` layers
[layers, kv_heads, pages, page_size, head_dim] and a traced layer index (the last layer), in place;
jax's kernel takes one layer's [kv_heads, pages, page_size, head_dim], sliced out before timing.
Prefill: causal attention of `--prefill-seqs` sequences of one chunk each, in TFLOP/s (4 * heads *
head_dim per visible query-key pair) for ours (`gpu_ragged_attention`) and the reference, plus the
cost of `write_kv` into one layer of the stacked cache for the same tokens (to decide whether
fusing the write would pay).

Times are the median over `--repeats` timings of `--inner` calls run inside one jitted loop (so
small shapes time the device, not Python's per-call dispatch, which is ~20-50 us and would hide
everything below it), after warm-up.
Every configuration is checked against the reference first (no NaN; within bf16 tolerance).
Prints one short table per section, last; writes everything to `--out` as JSON.
Needs a GPU: refuses to run (exit status 2) without one.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxserve.config import KV_CACHE_DTYPES

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "kernels.json"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192], help="KV tokens per sequence")
    p.add_argument("--page-size", type=int, nargs="+", default=[16, 32])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--layers", type=int, default=2, help="layers of the stacked KV cache the kernels index into")
    p.add_argument("--cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV cache's dtype, as the server's --kv-cache-dtype (auto: --dtype; jax's own kernel "
                   "takes no other cache, so it is skipped then)")
    p.add_argument("--prefill-chunk", type=int, nargs="*", default=[512, 2048], help="new tokens per sequence")
    p.add_argument("--prefill-seqs", type=int, default=4, help="sequences per prefill call")
    p.add_argument("--prefill-page-size", type=int, default=16)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-jax", action="store_true", help="skip jax's own paged_attention baseline")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--inner", type=int, default=10, help="calls per timing (in one jitted loop)")
    p.add_argument("--num-stages", type=int, nargs="+", default=[2], help="Triton pipeline stages to try for ours")
    # Rows per prefill program are q_block x (q heads per kv head); tensor cores want 64-256 rows and
    # 64-128 keys per block. The first H100 run tried only 16/32 x 2/4 and the smallest won (131 TFLOP/s).
    p.add_argument("--prefill-q-blocks", type=int, nargs="+", default=[16, 32, 64], help="query tokens per program")
    p.add_argument("--prefill-pages-per-block", type=int, nargs="+", default=[2, 4, 8], help="pages per key block")
    p.add_argument("--memory-fraction", type=float, default=0.6, help="skip shapes whose arrays exceed this")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="smoke-test this script without a GPU (tiny shapes only: kernels run interpreted, timings meaningless)",
    )
    args = p.parse_args(argv)
    for name in ("batch", "context", "page_size", "prefill_chunk"):
        if any(v <= 0 for v in getattr(args, name)):
            p.error(f"--{name.replace('_', '-')} values must be positive")
    if args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def require_gpu(allow_cpu: bool = False) -> Any:
    """The first GPU device, or exit with a clear message (status 2)."""
    import jax

    if allow_cpu:
        return jax.devices()[0]
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    if not devices:
        print(
            f"benchmarks.kernels needs a GPU; this machine has only {jax.default_backend()} devices. "
            "Run it on the H100 (see GPU.md); the kernels' correctness is tested on the CPU by "
            "pytest tests/kernels.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return devices[0]


def time_call(fn: Callable[[], Any], *, warmup: int, repeats: int, inner: int) -> float:
    """Median seconds per call over `repeats` timings of `inner` back-to-back calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t) / inner)
    return statistics.median(samples)


def looped(fn: Callable[..., Any], inner: int) -> Callable[..., Any]:
    """jit(fn) run `inner` times in a fori_loop, returning the last call's output. Each call's q
    depends on the previous output (times 0, so every call sees the same q), so XLA can neither
    hoist the call out of the loop nor merge the calls."""
    import jax

    def run(q, *args, **kwargs):
        def body(i, out):
            return fn(q + (out.reshape(-1)[0] * 0).astype(q.dtype), *args, **kwargs)

        first = fn(q, *args, **kwargs)
        return jax.lax.fori_loop(1, inner, body, first)

    return jax.jit(run)


def checked_time(fn: Callable[..., Any], call: tuple[tuple, dict], expected: Any, *, warmup: int, repeats: int,
                 inner: int) -> float | None:
    """Median seconds per call of `fn(*call)` timed through `looped`, or None when its output is
    not close to `expected`. One compilation serves both the check and the timing."""
    f = looped(fn, inner)
    args, kwargs = call
    if not _close(f(*args, **kwargs), expected):
        return None
    return time_call(lambda: f(*args, **kwargs), warmup=warmup, repeats=repeats, inner=1) / inner


def _random_cache(rng, *, batch, context, page_size, kv_heads, head_dim, dtype, layers):
    """A random stacked K/V cache [layers, kv_heads, pages, page_size, head_dim] and shuffled
    (non-contiguous) page tables, every sequence `context` long."""
    import jax
    import jax.numpy as jnp

    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq + 1
    shape = (layers, kv_heads, num_pages, page_size, head_dim)
    # Drawn on the device: a host-side float32 draw of a large cache would take tens of GB of RAM.
    key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    draw = jnp.float32 if jnp.dtype(dtype).itemsize == 1 else dtype  # no normal draws straight to float8
    k = jax.jit(lambda key: jax.random.normal(key, shape, draw).astype(dtype))(key_k)
    v = jax.jit(lambda key: jax.random.normal(key, shape, draw).astype(dtype))(key_v)
    tables = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    return k, v, jnp.asarray(tables, jnp.int32), pages_per_seq


def _close(a, b) -> bool:
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.isfinite(a).all() and np.allclose(a, b, atol=3e-2, rtol=3e-2))


def cache_dtype(args: argparse.Namespace) -> Any:
    from jaxserve.engine.kv_cache import cache_dtype as of_name

    return of_name(args.cache_dtype, args.dtype)


def bench_decode(args: argparse.Namespace, device: Any) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.gpu_paged_attention import paged_decode_attention_gpu
    from pallas_kernels.paged_attention import paged_decode_attention_reference

    dtype, kv_dtype = jnp.dtype(args.dtype), cache_dtype(args)
    scale = args.head_dim**-0.5
    limit = _memory_limit(device, args.memory_fraction)
    rng = np.random.default_rng(0)
    rows = []
    for page_size in args.page_size:
        for context in args.context:
            for batch in args.batch:
                kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * kv_dtype.itemsize  # one layer
                # the stacked pages + jax's one-layer copy + the dense reference's gathered copy
                if limit is not None and (args.layers + 2) * kv_bytes > limit:
                    rows.append(dict(batch=batch, context=context, page_size=page_size, skipped="does not fit"))
                    continue
                k, v, tables, pages_per_seq = _random_cache(
                    rng, batch=batch, context=context, page_size=page_size, kv_heads=args.kv_heads,
                    head_dim=args.head_dim, dtype=kv_dtype, layers=args.layers,
                )  # fmt: skip
                q = jnp.asarray(rng.standard_normal((batch, args.q_heads, args.head_dim), dtype=np.float32), dtype)
                lengths = jnp.full((batch,), context, jnp.int32)
                layer = jnp.int32(args.layers - 1)  # a jit argument: traced, as in the engine's layer scan
                stacked_call = ((q, k, v, tables, lengths), dict(layer=layer))
                one_layer_call = ((q, k[layer], v[layer], tables, lengths), {})
                expected = jax.jit(functools.partial(paged_decode_attention_reference, scale=scale))(
                    *stacked_call[0], **stacked_call[1]
                )
                row: dict[str, Any] = dict(batch=batch, context=context, page_size=page_size, kv_bytes=kv_bytes)

                def measure(
                    name: str, fn: Callable[..., Any], configs: list[dict[str, Any]], call=stacked_call
                ) -> None:
                    best = None
                    for config in configs:
                        try:
                            seconds = checked_time(functools.partial(fn, **config), call, expected, warmup=args.warmup,
                                                   repeats=args.repeats, inner=args.inner)  # fmt: skip
                            if seconds is None:
                                row.setdefault("wrong", []).append(f"{name} {config}")
                                continue
                        except Exception as e:  # a block setting the compiler rejects: try the others
                            row.setdefault("errors", []).append(f"{name} {config}: {type(e).__name__}: {e}"[:300])
                            continue
                        if best is None or seconds < best[0]:
                            best = (seconds, config)
                    if best is not None:
                        config = {key: val for key, val in best[1].items() if key != "scale"}
                        row[name] = dict(ms=best[0] * 1e3, tb_per_s=kv_bytes / best[0] / 1e12, config=config)

                # An 8-bit cache's block of 128 keys is half the bytes of a bf16 one: its kernel read
                # only 1.84 TB/s at 64 and 128 keys per block on the H100 (RESULTS.md), so it tries 256.
                keys = (64, 128, 256) if kv_dtype.itemsize == 1 else (64, 128)
                ours = [
                    dict(scale=scale, pages_per_block=ppb, num_splits=splits, num_warps=warps, num_stages=stages)
                    for ppb in sorted({max(1, n // page_size) for n in keys})
                    for splits in (None, 1)
                    for warps in (4, 8)
                    for stages in args.num_stages
                ]
                measure("ours", paged_decode_attention_gpu, ours)
                if kv_dtype.itemsize == 1 and dtype == jnp.bfloat16:
                    # An 8-bit cache is widened to float16 for the dots by default (one conversion
                    # per two values on Hopper); bfloat16 dots, one F2F per value more, beside it.
                    measure("ours_bf16_dots", paged_decode_attention_gpu,
                            [dict(config, dot_dtype="bfloat16") for config in ours])
                if not args.skip_jax and kv_dtype == dtype:
                    measure("jax", _jax_paged_attention(scale, device.platform != "gpu"), _jax_configs(pages_per_seq),
                            one_layer_call)
                measure("xla", paged_decode_attention_reference, [dict(scale=scale, chunk_pages=pages_per_seq)])
                measure("xla_chunk", paged_decode_attention_reference, [dict(scale=scale)])
                rows.append(row)
                print(json.dumps(row), flush=True)
                del k, v, stacked_call, one_layer_call
    return rows


def _jax_paged_attention(scale: float, interpret: bool) -> Callable[..., Any]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    def run(q, k, v, tables, lengths, **config):
        # jax's kernel takes no scale argument: fold it into q.
        return jax_paged.paged_attention(
            (q * scale).astype(q.dtype), k, v, tables, lengths, interpret=interpret, **config
        )

    return run


def _jax_configs(pages_per_seq: int) -> list[dict[str, Any]]:
    configs = []
    for ppcb in (4, 8, 16):
        for splits in (1, 2, 4, 8, 16, 32):
            if pages_per_seq % splits == 0 and (pages_per_seq // splits) % min(ppcb, pages_per_seq // splits) == 0:
                configs.append(dict(pages_per_compute_block=ppcb, k_splits=splits))
    return configs


def bench_prefill(args: argparse.Namespace, device: Any) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.gpu_ragged_attention import ragged_paged_attention_gpu
    from pallas_kernels.kv_write import write_kv
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

    dtype, kv_dtype = jnp.dtype(args.dtype), cache_dtype(args)
    scale = args.head_dim**-0.5
    rng = np.random.default_rng(1)
    rows = []
    for chunk in args.prefill_chunk:
        seqs, page_size = args.prefill_seqs, args.prefill_page_size
        k, v, tables, pages_per_seq = _random_cache(
            rng, batch=seqs, context=chunk, page_size=page_size, kv_heads=args.kv_heads, head_dim=args.head_dim,
            dtype=kv_dtype, layers=args.layers,
        )  # fmt: skip
        layer = jnp.int32(args.layers - 1)
        total = seqs * chunk
        q = jnp.asarray(rng.standard_normal((total, args.q_heads, args.head_dim), dtype=np.float32), dtype)
        cu = jnp.arange(seqs + 1, dtype=jnp.int32) * chunk
        kv_lens = jnp.full((seqs,), chunk, jnp.int32)
        call = (q, k, v, tables, cu, kv_lens, jnp.int32(seqs))
        flops = 4 * args.q_heads * args.head_dim * seqs * chunk * (chunk + 1) / 2
        expected = jax.jit(functools.partial(ragged_paged_attention_reference, scale=scale))(*call, layer=layer)
        row: dict[str, Any] = dict(chunk=chunk, seqs=seqs, page_size=page_size, gflop=flops / 1e9)
        candidates = [("ours", ragged_paged_attention_gpu, dict(scale=scale, q_block=qb, pages_per_block=ppb,
                                                                num_warps=w, num_stages=st))  # fmt: skip
                      for qb in args.prefill_q_blocks for ppb in args.prefill_pages_per_block for w in (4, 8)
                      for st in args.num_stages]
        candidates.append(("xla", ragged_paged_attention_reference, dict(scale=scale)))
        for name, fn, config in candidates:
            try:
                seconds = checked_time(functools.partial(fn, **config), (call, dict(layer=layer)), expected,
                                       warmup=args.warmup, repeats=args.repeats, inner=args.inner)  # fmt: skip
                if seconds is None:
                    row.setdefault("wrong", []).append(f"{name} {config}")
                    continue
            except Exception as e:
                row.setdefault("errors", []).append(f"{name} {config}: {type(e).__name__}: {e}"[:300])
                continue
            if name not in row or seconds * 1e3 < row[name]["ms"]:
                config = {key: val for key, val in config.items() if key != "scale"}
                row[name] = dict(ms=seconds * 1e3, tflop_per_s=flops / seconds / 1e12, config=config)
        new = jnp.asarray(rng.standard_normal((total, args.kv_heads, args.head_dim), dtype=np.float32), dtype)
        slots = (tables[:, :, None] * page_size + jnp.arange(page_size)[None, None]).reshape(seqs, -1)[:, :chunk]
        write = jax.jit(write_kv, donate_argnums=(0, 1))
        state = {"kv": (k, v)}

        def write_once():
            state["kv"] = write(*state["kv"], new, new, slots.reshape(-1).astype(jnp.int32), layer=layer)
            return state["kv"]

        row["write_kv_ms"] = 1e3 * time_call(write_once, warmup=args.warmup, repeats=args.repeats, inner=args.inner)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _memory_limit(device: Any, fraction: float) -> float | None:
    try:
        stats = device.memory_stats() or {}
    except Exception:
        return None
    total = stats.get("bytes_limit")
    return None if total is None else fraction * total


def _cell(result: dict[str, Any] | None, key: str, fmt: str) -> str:
    return format(result[key], fmt) if result else "-"


def print_tables(decode: list[dict[str, Any]], prefill: list[dict[str, Any]]) -> None:
    if decode:
        names = ("ours", "jax", "xla", "xla_chunk")
        if any("ours_bf16_dots" in r for r in decode):
            names = ("ours", "ours_bf16_dots", "xla", "xla_chunk")  # an 8-bit cache: jax's kernel has none
        print("\ndecode: ms per call / effective KV TB/s")
        print(f"{'page':>4} {'ctx':>5} {'batch':>5} " + " ".join(f"{n:>17}" for n in names) + "  ours/jax")
        for r in decode:
            head = f"{r['page_size']:>4} {r['context']:>5} {r['batch']:>5} "
            if "skipped" in r:
                print(head + r["skipped"])
                continue
            cells = [
                f"{_cell(r.get(n), 'ms', '.3f'):>8} {_cell(r.get(n), 'tb_per_s', '.2f'):>8}" for n in names
            ]
            ratio = f"{r['jax']['ms'] / r['ours']['ms']:.2f}x" if "ours" in r and "jax" in r else "-"
            print(head + " ".join(cells) + f"  {ratio:>8}")
    if prefill:
        print("\nprefill (causal, fresh chunk per sequence): ms / TFLOP/s")
        print(f"{'chunk':>5} {'seqs':>4} {'ours':>17} {'xla':>17} {'write_kv ms':>12}")
        for r in prefill:
            cells = [f"{_cell(r.get(n), 'ms', '.3f'):>8} {_cell(r.get(n), 'tflop_per_s', '.1f'):>8}" for n in ("ours", "xla")]
            print(f"{r['chunk']:>5} {r['seqs']:>4} " + " ".join(cells) + f" {r['write_kv_ms']:>12.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = require_gpu(args.allow_cpu)
    import jax

    repo = str(Path(__file__).resolve().parent.parent)
    if repo not in sys.path:
        sys.path.insert(0, repo)
    decode = [] if args.skip_decode else bench_decode(args, device)
    prefill = bench_prefill(args, device) if args.prefill_chunk else []
    result = dict(
        date=time.strftime("%Y-%m-%d"),
        device=device.device_kind,
        jax=jax.__version__,
        command="python -m benchmarks.kernels " + " ".join(sys.argv[1:] if argv is None else argv),
        dtype=args.dtype,
        q_heads=args.q_heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        decode=decode,
        prefill=prefill,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{result['device']}, jax {result['jax']}, {args.dtype}, {args.q_heads} q heads / {args.kv_heads} kv heads "
          f"/ head_dim {args.head_dim}; JSON: {args.out}")  # fmt: skip
    print_tables(decode, prefill)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
