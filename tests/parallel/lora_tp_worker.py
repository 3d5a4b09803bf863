"""Run in a subprocess by test_lora_tp.py with 4 virtual CPU devices: LoRA adapters under tensor
parallelism. For TP 1, 2 and 4: the tiny Llama loaded onto the mesh, two PEFT adapters attached,
and one batch of base-model and adapter requests decoded greedily. Writes a JSON report: the
tokens of each request at each TP size, the `peft` models' own greedy tokens, and how the
adapters' factors are split.

usage: python lora_tp_worker.py OUT.json WORK_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tiny_models, lora_adapters

import torch  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from jaxserve.engine.build import EngineConfig, build_engine  # noqa: E402
from jaxserve.engine.core import run_to_completion  # noqa: E402
from jaxserve.engine.request import SamplingParams  # noqa: E402
from jaxserve.models.lora import add_lora_slots  # noqa: E402
from jaxserve.parallel import make_mesh, param_sharding_for  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402
from jaxserve.weights.lora_adapter import TARGETS  # noqa: E402
from lora_adapters import make_adapter  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18], [1, 9, 8, 7, 6, 5, 4]]
MAX_TOKENS = 10
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=48),
    scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32, max_prefill_seqs=6, max_model_len=32,
                              decode_buckets=(6,), prefill_buckets=(32,)),
)
JOBS = [(name, i) for i in range(len(PROMPTS)) for name in (None, "sql", "poet")]
INSPECT = {"q_proj.lora_b": ("self_attn", "q_proj", "lora_b"), "q_proj.lora_a": ("self_attn", "q_proj", "lora_a"),
           "o_proj.lora_a": ("self_attn", "o_proj", "lora_a"), "down_proj.lora_a": ("mlp", "down_proj", "lora_a"),
           "k_proj.lora_b": ("self_attn", "k_proj", "lora_b")}


def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def main(out: Path, work: Path) -> None:
    hf = make_tiny_model("llama3", work / "base")
    references = {None: hf}
    for i, name in enumerate(("sql", "poet")):
        references[name] = make_adapter(hf, name, work / name, seed=30 + i)
    report: dict = {"num_devices": jax.device_count(), "peft": [greedy(references[n], PROMPTS[i]) for n, i in JOBS],
                    "engine": {}, "layout": {}}
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, lora=name) for name, _ in JOBS]
    for tp in (1, 2, 4):
        mesh = make_mesh(tp)
        model = load_model(work / "base", "float32", use_cache=False,
                           sharding_for=param_sharding_for(mesh) if mesh is not None else None).model
        add_lora_slots(model, 2, 8, TARGETS)
        engine = build_engine(model, None, CONFIG, eos_ids=[2])
        for name in ("sql", "poet"):  # written into the sharded slots
            engine.load_lora(name, work / name)
        layer = nnx.to_pure_dict(engine.runner.params)["layers"][1]
        report["layout"][tp] = {
            label: {"spec": [None if a is None else str(a) for a in getattr(array.sharding, "spec", ())],
                    "devices": len(array.sharding.device_set),
                    "shard_shapes": sorted({tuple(s.data.shape) for s in array.addressable_shards})}
            for label, (part, proj, factor) in INSPECT.items() for array in [layer[part][proj][factor]]}
        ids = [f"{tp}-{k}" for k in range(len(JOBS))]
        for rid, (_, i), p in zip(ids, JOBS, params):
            engine.add_request(rid, PROMPTS[i], p)
        results = run_to_completion(engine, ids)
        report["engine"][tp] = [results[r].outputs[0].token_ids for r in ids]
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
