"""The engine's decode steps for a random-weight Llama-3-8B (fp8 KV cache, 8 iterations a step,
batch 1 and 64), compiled by XLA:GPU for an H100 on this GPU-less machine (gpu_aot_worker.py,
in a subprocess with the CUDA plugin from .venv/cuda-aot): what makes a GPU decode step fast,
checked on every commit, as tests/tpu_aot does for TPUs.

- The KV cache and the device batch are donated and updated in place: aliased, never copied.
- No weight is copied: the step's scratch stays below 5% of a layer's weights plus the sampler's
  [rows, vocab] float32 arrays; XLA:GPU's rematerialization (which duplicated kernels when its
  memory estimate counted the donated cache twice) would show here as well as in the kernel count.
- Weights, cache, batch and scratch fit the card's 80 GB.
- Kernels per decode iteration: at batch 1 the step is ~6.4 ms against its 6.0 ms memory floor on
  an H100, and each kernel launch in the iteration costs time beside the bytes it moves. Every
  layer's attention is one Triton kernel (plus one merging its splits at batch 1), and the loop
  body holds at most the kernels counted on 2026-11-28 (488 at batch 1, 444 at 64) plus a few: a
  new kernel per layer (32 more) fails.
- At most two conditionals per iteration (the sampler's): on a GPU each reads its predicate back
  to the host (benchmarks/RESULTS.md, eleventh session).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PLUGIN = Path(sys.prefix) / "cuda-aot"  # the Makefile's `make test` installs the CUDA plugin here
WORKER = Path(__file__).with_name("gpu_aot_worker.py")
# Kernels per decode iteration, as compiled on 2026-11-28 plus headroom of 8 (fewer than a layer's 32).
MAX_KERNELS = {"1": 488 + 8, "64": 444 + 8}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    if not (PLUGIN / "jax_plugins").is_dir():
        pytest.skip(f"no CUDA plugin at {PLUGIN}: `make test` installs it (Linux x86_64)")
    out = tmp_path_factory.mktemp("gpu_aot") / "report.json"
    # (The worker sets JAX_PLATFORMS=cpu itself, before importing jax.)
    path = [str(PLUGIN), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_compiled_for_an_h100(report):
    assert report["device"] == "NVIDIA H100 80GB HBM3"
    assert set(report["steps"]) == {"1", "64"}


@pytest.mark.parametrize("rows", ["1", "64"])
def test_cache_and_batch_are_updated_in_place(report, rows):
    step = report["steps"][rows]
    assert step["alias_bytes"] >= report["kv_bytes"] + report["batch_bytes"], step["alias_bytes"]
    assert step["cache_copies"] == 0


@pytest.mark.parametrize("rows", ["1", "64"])
def test_no_weight_is_copied_and_the_step_fits(report, rows):
    step = report["steps"][rows]
    sampler = 16 * max(int(rows), 8) * report["vocab_size"] * 4
    assert step["temp_bytes"] < 0.05 * report["layer_bytes"] + sampler, step["temp_bytes"]
    assert step["argument_bytes"] >= report["weights_bytes"] + report["kv_bytes"]
    assert step["argument_bytes"] + step["temp_bytes"] <= report["hbm_bytes"]


@pytest.mark.parametrize("rows", ["1", "64"])
def test_kernels_per_decode_iteration(report, rows):
    step = report["steps"][rows]
    # One attention kernel per layer; at batch 1 it splits each sequence 64 ways to fill the card,
    # and one more kernel per layer merges the splits.
    layers = report["num_layers"]
    expected = {"jaxserve_paged_decode": layers, **({"jaxserve_combine_splits": layers} if rows == "1" else {})}
    assert step["triton_kernels"] == expected
    assert step["loop"]["kernels"] <= MAX_KERNELS[rows], step["loop"]
    assert step["loop"]["conditionals"] <= 2, step["loop"]
