"""LoRA adapters under tensor parallelism on 4 virtual CPU devices (in a subprocess, as
test_tensor_parallel.py): a batch mixing the base model and two adapters decodes the `peft`
models' own greedy tokens at TP 1, 2 and 4, and the adapters' factors are split with their
projections (b by q/k/v/gate/up output columns, a by o/down input rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("lora-tp")
    out = work / "report.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("lora_tp_worker.py")), str(out), str(work)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_mixed_batch_decodes_as_peft_at_every_tp_size(report):
    assert report["num_devices"] == 4
    peft = report["peft"]
    assert peft[1] != peft[0] and peft[2] != peft[0]  # (base, sql, poet) of the first prompt: adapters matter
    for tp in ("1", "2", "4"):
        assert report["engine"][tp] == peft, f"TP {tp}"


def test_factors_split_with_their_projection(report):
    # The tiny Llama: hidden 64, 4 q heads of 16, 2 kv heads, MLP 128; two slots of rank 8.
    two, four = report["layout"]["2"], report["layout"]["4"]
    assert two["q_proj.lora_b"]["shard_shapes"] == [[16, 32]] and two["q_proj.lora_b"]["devices"] == 2
    assert four["q_proj.lora_b"]["shard_shapes"] == [[16, 16]]
    assert four["q_proj.lora_a"]["shard_shapes"] == [[64, 16]]  # replicated
    assert four["o_proj.lora_a"]["shard_shapes"] == [[16, 16]]  # input rows split
    assert four["down_proj.lora_a"]["shard_shapes"] == [[32, 16]]
    assert two["k_proj.lora_b"]["shard_shapes"] == [[16, 16]]  # 2 kv heads split 2 ways...
    assert four["k_proj.lora_b"]["shard_shapes"] == [[16, 32]]  # ...replicated at 4, as the k projection
