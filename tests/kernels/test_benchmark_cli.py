"""benchmarks/kernels.py cannot run without a GPU, but it must import, parse and refuse clearly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# `benchmarks` is a top-level package of the repository, not installed: importable under
# `python -m pytest` (which puts the working directory on sys.path) but not under plain `pytest`.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import kernels as bench  # noqa: E402


def test_defaults_are_the_issue_grid():
    args = bench.parse_args([])
    assert args.batch == [1, 8, 64, 256]
    assert args.context == [512, 2048, 8192]
    assert args.page_size == [16, 32]
    assert (args.q_heads, args.kv_heads, args.head_dim, args.dtype) == (32, 8, 128, "bfloat16")
    assert args.prefill_chunk == [512, 2048]
    assert args.cache_dtype == "auto" and bench.parse_args(["--cache-dtype", "fp8_e5m2"]).cache_dtype == "fp8_e5m2"


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--q-heads", "6"], ["--dtype", "int8"], ["--layers", "0"]])
def test_bad_arguments_are_rejected(argv):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2


def test_refuses_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--batch", "1"])
    assert e.value.code == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", ["auto"])  # "fp8_e4m3" passes too (2026-11-28), in 45 s more
def test_smoke_run_on_cpu(tmp_path, cache_dtype):
    """The whole script end to end at toy sizes (kernels interpreted), so it does not first break on
    the H100; an 8-bit cache has no jax-kernel baseline, times bfloat16 dots beside the default
    float16, and has half the bytes."""
    out = tmp_path / "k.json"
    argv = "--allow-cpu --batch 2 --context 32 --page-size 16 --q-heads 4 --kv-heads 2 --head-dim 16 --layers 2"
    argv += f" --prefill-chunk 32 --prefill-seqs 2 --warmup 1 --repeats 1 --inner 1 --cache-dtype {cache_dtype}"
    argv += f" --out {out}"
    assert bench.main(argv.split()) == 0
    result = json.loads(out.read_text())
    [row] = result["decode"]
    baselines = {"jax"} if cache_dtype == "auto" else {"ours_bf16_dots"}
    assert {"ours", "xla", "xla_chunk"} | baselines <= set(row) and "wrong" not in row
    assert row["kv_bytes"] == 2 * 2 * 32 * 2 * 16 * (2 if cache_dtype == "auto" else 1)
    [row] = result["prefill"]
    assert {"ours", "xla", "write_kv_ms"} <= set(row) and "wrong" not in row
