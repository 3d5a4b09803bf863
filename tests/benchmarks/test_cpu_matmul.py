"""benchmarks/cpu_matmul.py: refuses bad arguments and times a real product."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import cpu_matmul  # noqa: E402


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--repeats", "0"], ["--dtypes", "float16"], ["--impls", "blas"]])
def test_bad_arguments_are_rejected(argv):
    out = subprocess.run([sys.executable, "-m", "benchmarks.cpu_matmul", *argv], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 2 and "error:" in out.stderr


@pytest.mark.parametrize("dtype,impl", [("int8", "xla"), ("bfloat16", "native")])
def test_times_a_product(dtype, impl):
    if impl == "native":
        from pallas_kernels import cpu_matmul as kernel

        if not kernel.available():
            pytest.skip(f"needs a C++ compiler and a CPU with {kernel.NEEDS}")
    ms = cpu_matmul.time_product(dtype, 2, 576, 1536, repeats=1, impl=impl)
    assert 0.0 < ms < 1000.0
