"""benchmarks/gpu_suite.sh, the one command for a lent GPU, checked where it can be without one:
it parses, runs the steps asked for in order, and every module and flag it calls exists."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


def _dry(tmp_path, *steps: str) -> list[str]:
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SUITE), str(tmp_path), *steps], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.startswith("[")]


def test_the_suite_runs_its_steps_in_order(tmp_path):
    subprocess.run(["bash", "-n", str(SUITE)], check=True)
    lines = _dry(tmp_path)
    assert [line.split("]")[0][1:] for line in lines] == [
        "correctness", "kernels", "step_profile_k1", "step_profile_k8", "serving"]
    assert [line.split("]")[0][1:] for line in _dry(tmp_path, "serving")] == ["serving"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "benchmarks/gpu_serving.sh" in summary
    # The 8-bit cache's runs only on request, with the server's flag.
    fp8 = _dry(tmp_path, "kernels_fp8", "step_profile_fp8", "serving_fp8")
    assert [line.split("]")[0][1:] for line in fp8] == ["kernels_fp8", "step_profile_fp8_k8", "serving_fp8"]
    assert "--cache-dtype fp8_e4m3" in fp8[0] and all("--kv-cache-dtype fp8" in line for line in fp8[1:])


def test_every_flag_it_passes_exists(tmp_path):
    """Each python -m module's --help names every flag the suite gives it (a renamed flag would
    otherwise only show on the GPU, in a lease)."""
    for line in _dry(tmp_path) + _dry(tmp_path, "kernels_fp8", "step_profile_fp8"):
        words = shlex.split(line.split("] ", 1)[1])
        if "-m" not in words or words[words.index("-m") + 1] == "pytest":
            continue
        module = words[words.index("-m") + 1]
        help_text = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                                   text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
        for flag in (w for w in words if re.fullmatch(r"--[A-Za-z][\w-]*", w)):
            assert flag in help_text, f"{module} has no {flag}"
