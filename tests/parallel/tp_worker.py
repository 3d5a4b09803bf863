"""Run in a subprocess by test_tensor_parallel.py with 8 virtual CPU devices (the device count is
fixed when jax starts its backends, and the rest of the suite must keep its single device).

For each tiny config: the no-cache reference and the engine at TP 1, then the engine at every
other TP size. Writes a JSON report: greedy tokens, and per TP size the parameter and KV cache
shardings (spec and per-device shard shapes); then the start-up loader at the largest TP size,
from the checkpoint and from the orbax weight cache.

usage: python tp_worker.py OUT.json WORK_DIR NAME[,NAME...] TP[,TP...] QUANTIZED_TP[,TP...]
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tiny_models

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from jaxserve.engine.build import EngineConfig, build_engine  # noqa: E402
from jaxserve.engine.core import run_to_completion  # noqa: E402
from jaxserve.engine.request import SamplingParams  # noqa: E402
from jaxserve.models.reference import greedy_reference  # noqa: E402
from jaxserve.parallel import ShardingPlan, make_mesh, mesh_of, param_sharding_for  # noqa: E402
from jaxserve.startup import load  # noqa: E402
from jaxserve.tokenizer import load_tokenizer  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402
from tiny_models import make_tiny_model, save_tiny_tokenizer  # noqa: E402

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18, 40, 41, 42, 43, 44, 45, 46], [1, 42], [1, 9, 8, 7, 6, 5, 4]]
MAX_TOKENS = 16
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=14),  # 13 usable pages of 4 tokens: forces preemption
    # One decode bucket: 18 engines are built here, and the shardings, not the grid, are under test.
    scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_seqs=2, max_model_len=48,
                              decode_buckets=(2,)),
)
INSPECT = {  # parameters whose layout the test checks
    "embed_tokens": ("embed_tokens",),
    "q_proj": ("layers", 1, "self_attn", "q_proj", "kernel"),
    "k_proj": ("layers", 1, "self_attn", "k_proj", "kernel"),
    "o_proj": ("layers", 1, "self_attn", "o_proj", "kernel"),
    "gate_proj": ("layers", 1, "mlp", "gate_proj", "kernel"),
    "down_proj": ("layers", 1, "mlp", "down_proj", "kernel"),
    "input_layernorm": ("layers", 1, "input_layernorm", "weight"),
}
# A mixture of experts' layer 0 (sparse; the tiny qwen3-moe's layer 1 is dense): stacked experts
# [experts, in, out] and the router.
MOE_INSPECT = {
    "experts_gate": ("layers", 0, "mlp", "experts", "gate_proj", "kernel"),
    "experts_down": ("layers", 0, "mlp", "experts", "down_proj", "kernel"),
    "router": ("layers", 0, "mlp", "gate", "kernel"),
}


def layout(array: jax.Array) -> dict:
    spec = getattr(array.sharding, "spec", None)
    return {
        "shape": list(array.shape),
        "spec": [None if a is None else str(a) for a in spec] if spec is not None else None,
        "devices": len(array.sharding.device_set),
        "shard_shapes": sorted({tuple(s.data.shape) for s in array.addressable_shards}),
    }


def collectives(compiled: object) -> list[tuple[int, ...]]:
    """Result shapes of the cross-device collectives GSPMD put into a compiled step."""
    found = re.findall(r"= \w+\[([\d,]*)\]\S* (?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                       r"(?:-start)?\(", compiled.as_text())
    return [tuple(int(d) for d in dims.split(",") if d) for dims in found]


def run(name: str, sizes: list[int], work: Path) -> dict:
    directory = work / name
    make_tiny_model(name, directory)
    save_tiny_tokenizer(directory)
    tokenizer = load_tokenizer(directory)
    report: dict = {"engine": {}, "layout": {}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for tp in sizes:
        mesh = make_mesh(tp)
        sharding_for = param_sharding_for(mesh) if mesh is not None else None
        model = load_model(directory, "float32", use_cache=False, sharding_for=sharding_for).model
        if tp == 1:
            report["reference"] = greedy_reference(model, PROMPTS, MAX_TOKENS)
        engine = build_engine(model, tokenizer, CONFIG)
        outputs = []
        for round_ in range(2):  # the second round hits the prefix cache
            ids = [f"{round_}-{i}" for i in range(len(PROMPTS))]
            for rid, prompt in zip(ids, PROMPTS):
                engine.add_request(rid, prompt, params)
            results = run_to_completion(engine, ids)
            outputs.append([results[r].outputs[0].token_ids for r in ids])
            engine.check_idle_integrity()
        report["engine"][tp] = outputs
        pure = nnx.to_pure_dict(nnx.split(model)[1])
        entry = {}
        inspect = {**INSPECT, **(MOE_INSPECT if model.cfg.moe else {})}
        for label, path in inspect.items():
            node = pure
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None:  # a sparse layer has no dense gate_proj / down_proj
                entry[label] = layout(node)
        entry["kv_k"] = layout(engine.runner.kv.k)
        entry["collectives"] = sorted({shape for c in engine.runner.compiled_steps.values() for shape in collectives(c)})
        entry["param_shapes"] = sorted({tuple(a.shape) for a in jax.tree.leaves(pure)})
        entry["preemptions"] = engine.num_preemptions
        mesh = mesh_of(engine.runner.params)
        entry["plan"] = ShardingPlan(mesh, model.cfg).describe() if mesh is not None else []
        report["layout"][tp] = entry
    return report


def quantized(name: str, sizes: list[int], work: Path, quantization: str) -> dict:
    """--quantization int8 or int4 (groups of 32) at every TP size: the engine's greedy tokens, the
    no-cache reference on the same quantized weights, and how the values and their scales are
    split."""
    from jaxserve.models import products

    directory = work / name
    tokenizer = load_tokenizer(directory)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    report: dict = {"engine": {}, "layout": {}}
    for tp in sizes:
        mesh = make_mesh(tp)
        sharding_for = param_sharding_for(mesh) if mesh is not None else None
        model = load_model(directory, "float32", use_cache=False, sharding_for=sharding_for).model
        if tp == 1:
            graphdef, state = nnx.split(model)
            placed = nnx.merge(graphdef, products.place(state, "xla", model.head_path, quantization=quantization))
            report["reference"] = greedy_reference(placed, PROMPTS, MAX_TOKENS)
        engine = build_engine(model, tokenizer, dataclasses.replace(CONFIG, quantization=quantization))
        ids = [str(i) for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS):
            engine.add_request(rid, prompt, params)
        results = run_to_completion(engine, ids)
        report["engine"][tp] = [results[r].outputs[0].token_ids for r in ids]
        weights = nnx.to_pure_dict(engine.runner.params)["layers"][1]
        report["layout"][tp] = {
            label: {"q": layout(w.q), "scale": layout(w.scale if quantization == "int8" else w.d)}
            for label, w in (("q_proj", weights["self_attn"]["q_proj"]["kernel"]),
                             ("down_proj", weights["mlp"]["down_proj"]["kernel"]))}
    return report


def startup_and_orbax(work: Path, name: str, tp: int) -> dict:
    """The CLI's loading path at TP > 1, from the source and then from the orbax weight cache
    (written unsharded at TP 1, restored straight into the shards)."""
    directory = work / name
    cache = work / "cache"
    cfg = ModelConfig(model=str(directory), served_model_name=name, dtype="float32", cache_dir=cache)
    plain = load(dataclasses.replace(cfg, weight_cache=False), tp).loaded
    load(cfg, 1)  # writes the orbax cache
    cached = load(cfg, tp).loaded
    a = nnx.to_pure_dict(nnx.split(plain.model)[1])
    b = nnx.to_pure_dict(nnx.split(cached.model)[1])
    same = all(bool((np.asarray(x) == np.asarray(y)).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return {"from_cache": cached.from_cache, "same_values": same,
            "source": layout(a["embed_tokens"]), "cached": layout(b["embed_tokens"])}


def main() -> None:
    out, work, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    sizes, quantized_sizes = ([int(s) for s in arg.split(",")] for arg in sys.argv[4:6])
    report = {"num_devices": jax.local_device_count()}
    for name in names:
        report[name] = run(name, sizes, work)
    report["startup"] = startup_and_orbax(work, names[0], sizes[-1])
    report["int8"] = quantized(names[0], quantized_sizes, work, "int8")
    report["int4"] = quantized(names[0], quantized_sizes, work, "int4")
    if "qwen3-moe" in names:  # int8 experts, split whole over 4 devices (expert parallel)
        report["int8-moe"] = quantized("qwen3-moe", [1, 4], work, "int8")
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
