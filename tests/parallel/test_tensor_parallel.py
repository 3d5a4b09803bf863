"""Tensor parallelism on 8 virtual CPU devices: greedy engine output at TP 2 / 4 / 8 equals TP 1
and the no-cache reference token for token, and parameters and KV pages really are split.

The device count is fixed when jax initialises its backends, so the work runs in a subprocess
(tp_worker.py) and the rest of the suite keeps its single CPU device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import _BASE, TINY_CONFIGS

pytestmark = pytest.mark.slow

# llama3: GQA with 2 kv heads (replicated KV at TP 4 and 8); qwen2: tied embeddings and qkv biases;
# gemma3: sliding windows with their own RoPE, q/k norms and sandwich norms (as gemma2, whose soft-caps
# are elementwise); qwen3-moe: 8 routed experts (expert parallel at every size) and a dense layer;
# qwen2-moe: 6 experts (expert parallel at TP 2, every expert's width split at 4 and 8) and a
# shared expert. All have 4 q heads (replicated at TP 8).
NAMES = ("llama3", "qwen2", "gemma3", "qwen3-moe", "qwen2-moe")
SIZES = (1, 2, 4, 8)
# Quantized weights at one size of each kind: unsplit, q heads split (as at 2), q heads replicated.
QUANTIZED_SIZES = (1, 4, 8)

# label -> (logical axis, index of the split dimension in the parameter; layers' are [in, out])
SPLIT = {
    "embed_tokens": ("vocab_size", 0),
    "q_proj": ("num_attention_heads", 1),
    "k_proj": ("num_key_value_heads", 1),
    "o_proj": ("num_attention_heads", 0),
    "gate_proj": ("intermediate_size", 1),
    "down_proj": ("intermediate_size", 0),
    "input_layernorm": (None, None),
    "kv_k": ("num_key_value_heads", 1),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("tp")
    out = work / "report.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    worker = Path(__file__).with_name("tp_worker.py")
    done = subprocess.run([sys.executable, str(worker), str(out), str(work), ",".join(NAMES),
                           ",".join(map(str, SIZES)), ",".join(map(str, QUANTIZED_SIZES))],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def _size(name: str, key: str) -> int:
    return {**_BASE, **TINY_CONFIGS[name][1]}[key]


def test_runs_on_eight_devices(report):
    assert report["num_devices"] == 8


@pytest.mark.parametrize("name", NAMES)
def test_greedy_output_is_the_same_at_every_tp_size(report, name):
    model = report[name]
    assert model["layout"]["1"]["preemptions"] > 0  # the run exercised preemption and recompute
    for tp in map(str, SIZES):
        for round_ in model["engine"][tp]:  # round 2 hits the prefix cache
            assert round_ == model["reference"], f"{name} at TP {tp}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp", SIZES[1:])
def test_parameters_and_kv_pages_are_split(report, name, tp):
    layout = report[name]["layout"][str(tp)]
    for label, (axis, dim) in SPLIT.items():
        if label not in layout and TINY_CONFIGS[name][0].endswith("MoeConfig"):
            continue  # every layer of the tiny qwen2-moe is sparse: no dense MLP to look at
        got = layout[label]
        assert got["devices"] == tp, label
        split = axis is not None and _size(name, axis) % tp == 0
        want = list(got["shape"])
        if split:
            want[dim] //= tp
        assert got["shard_shapes"] == [want], f"{label} at TP {tp}"
        spec = got["spec"] + [None] * (len(got["shape"]) - len(got["spec"]))
        assert spec == [("model" if split and i == dim else None) for i in range(len(spec))], label


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe"])
@pytest.mark.parametrize("tp", SIZES[1:])
def test_experts_are_split_whole_or_by_their_width(report, name, tp):
    """Whole experts per device (expert parallel) where their number divides by the mesh, else a
    slice of every expert (gate/up by columns, down by rows); the router is whole everywhere."""
    layout = report[name]["layout"][str(tp)]
    cfg = {**_BASE, **TINY_CONFIGS[name][1]}
    experts, width = cfg["num_experts"], cfg["moe_intermediate_size"]
    whole = experts % tp == 0
    for label, dim in (("experts_gate", 2), ("experts_down", 1)):
        got = layout[label]
        want = list(got["shape"])
        if whole:
            want[0] //= tp
        else:
            want[dim] //= tp
        assert got["shard_shapes"] == [want], f"{label} at TP {tp}"
    assert layout["router"]["shard_shapes"] == [layout["router"]["shape"]]
    line = (f"experts (expert parallel): experts {experts} split {experts // tp} per device" if whole else
            f"every expert's gate/up/down: expert_mlp {width} split {width // tp} per device")
    assert line in layout["plan"]


def test_int8_experts_split_whole(report):
    """--quantization int8 on the tiny qwen3-moe: its experts' int8 values and scales split whole
    over 4 devices give the no-cache reference's tokens on the same quantized weights."""
    quantized = report["int8-moe"]
    for tp in ("1", "4"):
        assert quantized["engine"][tp] == quantized["reference"], f"int8 experts at TP {tp}"


def test_replication_is_explained(report):
    plan = report["llama3"]["layout"]["4"]["plan"]
    assert "k/v projections and KV cache: REPLICATED on every device (kv_heads 2 is not divisible by 4)" in plan
    assert "attention q/o projections: heads 4 split 1 per device" in plan
    plan = report["llama3"]["layout"]["8"]["plan"]
    assert "attention q/o projections: REPLICATED on every device (heads 4 is not divisible by 8)" in plan
    assert "MLP gate/up/down: intermediate_size 128 split 16 per device".replace("intermediate_size", "mlp") in plan


def test_startup_loads_into_shards_also_from_the_orbax_cache(report):
    got = report["startup"]
    assert got["from_cache"] and got["same_values"]
    for which in ("source", "cached"):
        assert got[which]["spec"][0] == "model" and got[which]["shard_shapes"] == [[256 // 8, 64]], which


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp", SIZES[1:])
def test_steps_move_activations_not_weights_or_pages(report, name, tp):
    """GSPMD's collectives must carry activations and logits only: a weight- or cache-shaped
    collective would mean every step re-gathers the model or the KV cache."""
    layout = report[name]["layout"][str(tp)]
    assert layout["collectives"], "a sharded step communicates"
    heavy = {tuple(layout["kv_k"]["shape"])} | {tuple(s) for s in layout["param_shapes"] if len(s) > 1}
    assert not heavy & {tuple(s) for s in layout["collectives"]}


# (quantization, the scales' column axis): int8 has one scale per column [N], int4 one per group
# and column [K / 32, N].
@pytest.mark.parametrize("quantization, column_axis", [("int8", 0), ("int4", 1)])
def test_quantized_weights_split_with_their_scales(report, quantization, column_axis):
    """--quantization int8 or int4 (XLA's dot on 4-bit groups of 32) under tensor parallelism: the
    same greedy tokens at every size as the no-cache reference on the same quantized weights; each
    quantized weight keeps its bf16/f32 weight's split, and a column-split weight's scales are
    split with its columns."""
    quantized = report[quantization]
    for tp in map(str, QUANTIZED_SIZES):
        assert quantized["engine"][tp] == quantized["reference"], f"{quantization} at TP {tp}"
    for tp in map(str, QUANTIZED_SIZES[1:]):
        q_proj, down = quantized["layout"][tp]["q_proj"], quantized["layout"][tp]["down_proj"]
        assert q_proj["q"]["spec"] == report[NAMES[0]]["layout"][tp]["q_proj"]["spec"]
        assert down["q"]["spec"] == report[NAMES[0]]["layout"][tp]["down_proj"]["spec"]
        heads = _size(NAMES[0], "num_attention_heads")
        if heads % int(tp) == 0:  # q_proj's columns are split: so are its scales
            scale = q_proj["scale"]
            assert scale["shard_shapes"][0][column_axis] == scale["shape"][column_axis] // int(tp)
