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
    fp8 = _dry(tmp_path, "fp8_dots", "kernels_fp8", "step_profile_fp8", "serving_fp8")
    assert [line.split("]")[0][1:] for line in fp8] == ["fp8_dots", "kernels_fp8", "step_profile_fp8_k8",
                                                         "serving_fp8"]
    assert all("--cache-dtype fp8_e4m3" in line for line in fp8[:2])
    assert all("--kv-cache-dtype fp8" in line for line in fp8[2:])
    assert [line.split("]")[0][1:] for line in _dry(tmp_path, "moe")] == ["moe"]
    # The short lease's first command: the served goals alone, inside one device command (10 min).
    [goals] = _dry(tmp_path, "goals")
    assert goals.startswith("[goals] timeout 560 bash benchmarks/gpu_serving.sh") and "--kv-cache-dtype fp8" in goals


def test_every_flag_it_passes_exists(tmp_path):
    """Each python -m module's --help names every flag the suite gives it (a renamed flag would
    otherwise only show on the GPU, in a lease)."""
    for line in _dry(tmp_path) + _dry(tmp_path, "fp8_dots", "moe", "kernels_fp8", "step_profile_fp8", "graphs"):
        words = shlex.split(line.split("] ", 1)[1])
        if "-m" not in words or words[words.index("-m") + 1] == "pytest":
            continue
        module = words[words.index("-m") + 1]
        help_text = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                                   text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
        for flag in (w for w in words if re.fullmatch(r"--[A-Za-z][\w-]*", w)):
            assert flag in help_text, f"{module} has no {flag}"


def _xla_flags_accepted(flags: str) -> bool:
    """Whether this jaxlib's XLA takes `flags` (it parses every backend's flags, GPU ones too, when
    the CPU backend starts, and exits on one it does not know or a value it cannot read)."""
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags})
    return done.returncode == 0


def test_graphs_runs_the_step_without_and_with_device_side_loops(tmp_path):
    """`graphs`: the same step profile with XLA's default command buffers, then with WHILE and
    CONDITIONAL added, in turn; the flag is one XLA reads (a typo would only show on the GPU)."""
    env_of = lambda line: shlex.split(line.split("] ", 1)[1])[3]  # noqa: E731  (timeout N env XLA_FLAGS=...)
    lines = _dry(tmp_path, "graphs")
    assert [line.split("]")[0][1:] for line in lines] == ["graphs_default_1", "graphs_graphs_1"]
    assert env_of(lines[0]) == "XLA_FLAGS="
    flag = env_of(lines[1]).removeprefix("XLA_FLAGS=")
    assert flag == "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
    assert lines[0].split("python", 1)[1] == lines[1].split("python", 1)[1]  # the same run otherwise
    assert _xla_flags_accepted(flag)
    assert not _xla_flags_accepted("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONALS")
