"""Run by test_gpu_steps_compile.py in a subprocess: the engine's real decode steps for a
random-weight Llama-3-8B, compiled by XLA:GPU for an H100 on a machine without a GPU, and what the
compiled programs say, as JSON.

How: the CUDA PJRT plugin (jax-cuda13-plugin + jax-cuda13-pjrt, the pins of jax's own cuda13
extra) creates a topology from a target description instead of a local device
(`get_topology_desc("h100", "cuda", target_config=..., topology="1x1xN")`: N cards on one host,
XLA's deviceless compilation), and `lower(...).compile()` under that mesh runs the whole XLA:GPU
pipeline, the Pallas Triton kernels and the collectives of tensor parallelism included. The
plugin is kept out of the project's virtual environment (the Makefile installs it into
.venv/cuda-aot): imported where no GPU driver is, its version check prints a traceback on every jax
import, so only this process, with JAX_PLATFORMS=cpu (which skips that check), puts it on its path.
Without a device XLA skips autotuning (GEMM tiles and split-K come from its heuristics) and sorts
fall back from CUB; the program's structure (fusions, kernels per iteration, buffers, aliasing,
collectives) is what the device would compile.

usage: python gpu_aot_worker.py OUT.json [HLO_DIR]   (with the plugin on PYTHONPATH; HLO_DIR: where to
write each compiled step's optimized HLO)
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ["JAX_PLATFORMS"] = "cpu"  # the local backend; the plugin only compiles
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

TARGET = Path(__file__).with_name("h100.txtpb")
PAGE_SIZE = 16
NUM_PAGES = 40_000  # 640k tokens of fp8 cache: 42 GB beside the 16 GB of weights
MAX_MODEL_LEN = 4096
MAX_NUM_SEQS = 64
DECODE_STEPS = 8  # the engine's default on GPUs (jaxserve.startup.resolve_decode_steps)
# (tensor-parallel size, decode buckets): one card at batch 1 and 64, and the batch-64 step split
# over two cards (kv heads, q heads and the MLP split; an all-reduce after attention and after the MLP).
STEPS = ((1, (1, 64)), (2, (64,)))

# Instructions of a compiled XLA:GPU program that launch work on the device (a fusion is one
# kernel; a custom call a Triton kernel or a library call; copies and sorts their own kernels).
KERNEL_OPS = {"fusion", "custom-call", "copy", "copy-start", "sort", "all-reduce", "all-reduce-start", "all-gather",
              "all-gather-start", "reduce-scatter", "all-to-all", "collective-permute", "collective-permute-start",
              "scatter", "gather", "reduce", "dynamic-update-slice"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (\(.*?\)|\S+) ([a-z\-]+)\(")


def computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from a compiled module's text."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None and line.startswith("  "):
            current.append(line)
    return out


def triton_calls(hlo: str) -> list[tuple[str, str]]:
    """(Pallas kernel name, i.e. its pallas_call's `name`; instruction line) of every Triton call."""
    return [(re.search(r'op_name="[^"]*?([\w.\-]+)/pallas_call"', line).group(1), line)
            for line in hlo.splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in line]


def triton_kernels(hlo: str) -> dict[str, int]:
    """Pallas kernel name -> how many Triton calls the program holds."""
    return dict(Counter(name for name, _ in triton_calls(hlo)))


def kernel_operand_types(hlo: str, name: str, index: int) -> list[str]:
    """The element type of operand `index` of every Triton call named `name` (from the call's
    operand layout constraints, which list every operand's shape first)."""
    return sorted({re.findall(r"(\w+)\[[\d,]*\]\{", line.split("operand_layout_constraints={", 1)[1])[index]
                   for kernel, line in triton_calls(hlo) if kernel == name})


def decode_loop(hlo: str, cache_shape: str) -> dict:
    """The decode iterations' `while` (the one that carries the KV cache): the instructions its body
    runs per iteration, by op, and the kernels among them (each conditional counted once: what runs
    inside its branches depends on the batch)."""
    comps = computations(hlo)
    entry = re.search(r"^ENTRY %([\w.\-]+) ", hlo, re.M).group(1)
    loops = [line for line in comps[entry] if " while(" in line and cache_shape in line.split(" while(")[0]]
    assert len(loops) == 1, f"{len(loops)} loops carry the cache"
    body = re.search(r"body=%([\w.\-]+)", loops[0]).group(1)
    ops = Counter(m.group(2) for m in map(_INSTRUCTION.match, comps[body]) if m)
    return {"ops": dict(ops), "kernels": sum(n for op, n in ops.items() if op in KERNEL_OPS),
            "conditionals": ops.get("conditional", 0)}


def cache_copies(hlo: str, cache_shape: str) -> int:
    """Copies of a cache-shaped array anywhere in the program (an in-place update has none)."""
    copies = (m for m in map(_INSTRUCTION.match, hlo.splitlines()) if m and m.group(2) in ("copy", "copy-start"))
    return sum(1 for m in copies if cache_shape in m.group(1))


def compile_steps(cfg: Any, target: str, tensor_parallel: int, buckets: tuple[int, ...], hlo_dir: str | None,
                  prefix: str = "", only: tuple[int, ...] | None = None) -> dict:
    """The decode steps of `buckets` for model `cfg`, compiled for `tensor_parallel` cards of the
    `target` description (one host), and what the compiled programs say: per-device sizes, memory
    analysis, the decode loop's ops and kernels."""
    from jax.experimental import topologies

    from jaxserve.config import SchedulerConfig
    from jaxserve.engine.buckets import BucketTable
    from jaxserve.engine.device_batch import abstract_batch
    from jaxserve.engine.kv_cache import KVCache
    from jaxserve.engine.programs import StepPrograms
    from jaxserve.engine.runner import GPU_COMPILER_OPTIONS, min_product_rows
    from jaxserve.engine.step_inputs import StepInputBuilder
    from jaxserve.parallel import ShardingPlan
    from jaxserve.plan import abstract_params, per_chip_bytes

    topology = topologies.get_topology_desc("h100", "cuda", target_config=target,
                                            topology=f"1x1x{tensor_parallel}")
    mesh = jax.sharding.Mesh(np.array(topology.devices), ("model",))
    sched = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=1024, max_prefill_seqs=8,
                            max_model_len=MAX_MODEL_LEN, decode_buckets=buckets, prefill_buckets=(1024,),
                            decode_steps=DECODE_STEPS)
    max_pages = MAX_MODEL_LEN // PAGE_SIZE
    builder = StepInputBuilder(num_slots=MAX_NUM_SEQS + 1, vocab_size=cfg.vocab_size, page_size=PAGE_SIZE,
                               max_pages_per_seq=max_pages, buckets=BucketTable(sched), max_prefill_seqs=8,
                               decode_steps=DECODE_STEPS, row_params=lambda seq: None)
    sharding = ShardingPlan(mesh, cfg)
    graphdef, params = abstract_params(cfg, jnp.bfloat16, mesh)
    programs = StepPrograms(graphdef, cfg, page_size=PAGE_SIZE, decode_steps=DECODE_STEPS,
                            attention_backend="pallas_gpu", mesh=mesh, min_rows=min_product_rows("gpu", jnp.bfloat16),
                            params_sharding=jax.tree_util.tree_map(lambda a: a.sharding, params))
    kv_dtype = jnp.float8_e4m3fn  # the fp8 cache, as the served goals run (gpu_suite.sh goals)
    shape = KVCache.shape(cfg, NUM_PAGES, PAGE_SIZE)
    kv = KVCache(*(jax.ShapeDtypeStruct(shape, kv_dtype, sharding=sharding.kv_cache()) for _ in range(2)))
    batch = abstract_batch(MAX_NUM_SEQS + 1, cfg.vocab_size, max_pages, sharding.replicated())
    # What one device holds: its share of the cache (split by kv head) and of the weights.
    cache_shape = f"f8e4m3fn[{','.join(map(str, sharding.kv_cache().shard_shape(shape)))}]"
    weights = per_chip_bytes(params)
    sizes = {
        "device": topology.devices[0].device_kind, "devices": len(topology.devices),
        "weights_bytes": weights,
        # one layer's bfloat16 weights: all but the embedding and the LM head, shared out (as tests/tpu_aot)
        "layer_bytes": (weights - 2 * cfg.vocab_size * cfg.hidden_size * 2 // tensor_parallel) // cfg.num_layers,
        "kv_bytes": per_chip_bytes(kv),
        "batch_bytes": per_chip_bytes(batch),
    }
    steps = {}
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        for rows in only or buckets:
            key = ("decode", rows)
            name = prefix + (f"tp{tensor_parallel}-{rows}" if tensor_parallel > 1 else str(rows))
            start = time.perf_counter()
            compiled = programs.lower(key, params, kv, batch, builder.abstract(key)).compile(
                compiler_options=dict(GPU_COMPILER_OPTIONS))
            seconds = time.perf_counter() - start
            ma = compiled.memory_analysis()
            hlo = compiled.as_text()
            if hlo_dir:  # the compiled programs, to read what each iteration runs
                Path(hlo_dir, f"decode{name}.hlo").write_text(hlo)
            steps[name] = {
                **sizes, "compile_s": seconds, "temp_bytes": ma.temp_size_in_bytes,
                "argument_bytes": ma.argument_size_in_bytes, "alias_bytes": ma.alias_size_in_bytes,
                "loop": decode_loop(hlo, cache_shape), "cache_copies": cache_copies(hlo, cache_shape),
                "triton_kernels": triton_kernels(hlo),
                # What XLA:GPU made of any lax.ragged_dot (a dense product over every expert).
                "ragged_dot_ops": hlo.count("ragged_dot"),
                # The dtype the decode kernel dots in: its q operand's (it widens the cache to it).
                "decode_dot_types": kernel_operand_types(hlo, "jaxserve_paged_decode", 4),
            }
            print(f"decode {name}: compiled in {seconds:.1f}s, {steps[name]['loop']['kernels']} kernels per iteration",
                  flush=True)
    return steps


def main() -> None:
    from benchmarks.dummy_model import PRESETS
    from jaxserve.models.config import decoder_config_from_hf

    cfg = decoder_config_from_hf(PRESETS["llama-3-8b"])
    target = TARGET.read_text()
    hbm = int(re.search(r"device_memory_size: (\d+)", target).group(1))
    hlo_dir = sys.argv[2] if len(sys.argv) > 2 else None
    steps = {}
    for tensor_parallel, buckets in STEPS:
        steps.update(compile_steps(cfg, target, tensor_parallel, buckets, hlo_dir))
    # A mixture of experts: Qwen3-30B-A3B's layers, 4 of them, at batch 64 (8 experts a token).
    moe = decoder_config_from_hf(dict(PRESETS["qwen3-30b-a3b"], num_hidden_layers=4))
    steps.update(compile_steps(moe, target, 1, (1, 64), hlo_dir, prefix="moe-", only=(64,)))
    report = {"hbm_bytes": hbm, "num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size, "steps": steps,
              "moe_layers": moe.num_layers, "moe_vocab_size": moe.vocab_size}
    Path(sys.argv[1]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
