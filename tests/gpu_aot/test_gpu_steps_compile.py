"""The engine's decode steps for a random-weight Llama-3-8B (fp8 KV cache, 8 iterations a step),
and of Qwen3-30B-A3B's layers (4 of them: a mixture of experts),
compiled by XLA:GPU for H100s on this GPU-less machine (gpu_aot_worker.py, in a subprocess with the
CUDA plugin from .venv/cuda-aot): batch 1 and 64 on one card, and batch 64 split over two cards
(tensor parallel). What makes a GPU decode step fast, checked on every commit, as tests/tpu_aot
does for TPUs:

- The KV cache and the device batch are donated and updated in place: aliased, never copied.
- No weight is copied: the step's scratch stays below 5% of a layer's weights plus the sampler's
  [rows, vocab] float32 arrays; XLA:GPU's rematerialization (which duplicated kernels when its
  memory estimate counted the donated cache twice) would show here as well as in the kernel count.
- Each card's weights, cache, batch and scratch fit its 80 GB.
- Kernels per decode iteration: at batch 1 the step is ~6.4 ms against its 6.0 ms memory floor on
  an H100, and each kernel launch in the iteration costs time beside the bytes it moves. Every
  layer's attention is one Triton kernel (plus one merging its splits where the context is split),
  and the loop body holds at most the kernels counted on 2026-11-28 plus a few: a new kernel per
  layer (32 more) fails.
- Split over two cards, an iteration communicates with two all-reduces a layer (after attention and
  after the MLP) and a few for the sampler, and gathers nothing.
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
STEPS = ["1", "64", "tp2-64"]  # [tp<N>-]<batch>: batch 1 and 64 on one card, batch 64 on two
# Kernels per decode iteration (collectives included), as compiled on 2026-11-28, plus headroom of
# 8 (fewer than a layer's 32).
MAX_KERNELS = {"1": 488 + 8, "64": 444 + 8, "tp2-64": 562 + 8}


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
    assert {step["device"] for step in report["steps"].values()} == {"NVIDIA H100 80GB HBM3"}
    assert set(report["steps"]) == {*STEPS, "moe-64"}
    assert report["steps"]["tp2-64"]["devices"] == 2


@pytest.mark.parametrize("key", STEPS)
def test_cache_and_batch_are_updated_in_place(report, key):
    step = report["steps"][key]
    assert step["alias_bytes"] >= step["kv_bytes"] + step["batch_bytes"], step["alias_bytes"]
    assert step["cache_copies"] == 0


@pytest.mark.parametrize("key", STEPS)
def test_no_weight_is_copied_and_the_step_fits(report, key):
    step = report["steps"][key]
    sampler = 16 * max(int(key.split("-")[-1]), 8) * report["vocab_size"] * 4
    assert step["temp_bytes"] < 0.05 * step["layer_bytes"] + sampler, step["temp_bytes"]
    assert step["argument_bytes"] >= step["weights_bytes"] + step["kv_bytes"]
    assert step["argument_bytes"] + step["temp_bytes"] <= report["hbm_bytes"]


@pytest.mark.parametrize("key", STEPS)
def test_kernels_per_decode_iteration(report, key):
    step = report["steps"][key]
    # One attention kernel per layer. Where batch x kv heads are too few programs to fill the card
    # (batch 1; batch 64 over a card's 4 kv heads at TP 2) it splits each context, and one more
    # kernel per layer merges the splits.
    layers = report["num_layers"]
    split = key != "64"
    expected = {"jaxserve_paged_decode": layers, **({"jaxserve_combine_splits": layers} if split else {})}
    assert step["triton_kernels"] == expected
    # The fp8 cache is widened to float16 for the dots (one conversion per two values on Hopper;
    # bfloat16 takes one more per value: pallas_kernels.gpu_paged_attention.resolve_dot_dtype).
    assert step["decode_dot_types"] == ["f16"]
    assert step["loop"]["kernels"] <= MAX_KERNELS[key], step["loop"]
    assert step["loop"]["conditionals"] <= 2, step["loop"]


@pytest.mark.parametrize("key", STEPS)
def test_collectives_per_decode_iteration(report, key):
    ops = report["steps"][key]["loop"]["ops"]
    all_reduces = ops.get("all-reduce", 0) + ops.get("all-reduce-start", 0)
    others = {op: n for op, n in ops.items() if op.startswith(("all-gather", "reduce-scatter", "all-to-all",
                                                               "collective-permute"))}
    assert not others, others  # nothing is gathered: the cache, weights and logits stay split
    if key.startswith("tp"):
        assert 2 * report["num_layers"] <= all_reduces <= 2 * report["num_layers"] + 4, ops
    else:
        assert all_reduces == 0, ops


def test_mixture_of_experts_decode_step(report):
    """Qwen3-30B-A3B's layers (4 of them) at batch 64: each layer's experts are three launches of
    the grouped-matmul kernel (gate, up, down), which load only the routed experts' weights;
    XLA:GPU's ragged dot (a dense product over all 128 experts) is nowhere. The cache and batch
    are updated in place and no weight is copied. Kernels per iteration as compiled on
    2026-11-30 (172) plus headroom."""
    step, layers = report["steps"]["moe-64"], report["moe_layers"]
    assert step["triton_kernels"] == {"jaxserve_paged_decode": layers, "jaxserve_combine_splits": layers,
                                      "jaxserve_grouped_matmul": 3 * layers}
    assert step["ragged_dot_ops"] == 0
    assert step["cache_copies"] == 0 and step["alias_bytes"] >= step["kv_bytes"] + step["batch_bytes"]
    sampler = 16 * 64 * report["moe_vocab_size"] * 4
    assert step["temp_bytes"] < 0.05 * step["layer_bytes"] + sampler, step["temp_bytes"]
    assert step["loop"]["kernels"] <= 172 + 8 and step["loop"]["conditionals"] <= 2, step["loop"]
