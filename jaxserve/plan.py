"""Capacity planning for a TPU you do not have: compile your real serving configuration for a TPU
topology through the real TPU compiler, on this machine, and read what it needs.

    python -m jaxserve.plan --model DIR --topology v6e:2x4 --tensor-parallel-size 8 \\
        [--max-model-len 8192] [--max-num-seqs 128] [--max-num-batched-tokens 2048] [--json FILE]

DIR needs only the checkpoint's config.json: the weights are abstract (shapes and shardings), so
nothing is loaded or allocated. With libtpu installed (`pip install 'jaxserve[test]'` or
`libtpu==0.0.48.*`), `jax.experimental.topologies` gives the slice's chips without a TPU, and every
prefill and decode step of the bucket grid is compiled exactly as `python -m jaxserve` compiles it
on the slice (the same programs, shardings and Pallas kernels). Printed per chip: whether it
compiles (or the compiler's error), HBM for the weights, the KV pages and the steps' scratch, how
many KV tokens fit, the bytes each decode step reads against its floor (every weight once plus the
KV pages it can see), and the tokens/s that implies at the chip's HBM bandwidth.

The KV cache is sized as the server sizes it on the chip: what --kv-cache-memory-fraction leaves
of the HBM after the weights, the device batch and the largest step's scratch.

Bytes per step: XLA's cost analysis counts a buffer that memory-space assignment prefetches into
VMEM three times (the HBM read, the VMEM write, the consumer's VMEM read), so the decode steps'
byte figures come from a second compile with prefetching off (BYTES_OPTIONS); the program read is
the same, the prefetch only moves it earlier. Even then XLA:TPU stages some buffers in VMEM on its
own: much of the sampler's work, and on v5e at TP 4 with 2-8 rows the q, k and v weight shards,
copied there transposed for the small-batch dots (~0.4 GB of copies per chip, which put the
counted bytes 1 GB over the floor). The VMEM side of those accesses is not HBM traffic, so it is taken out
(`vmem_access_bytes`): what is left is what the floor bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from jaxserve.config import KV_CACHE_DTYPES

GiB = 1 << 30
# Compiler options of the byte-counting compile: memory-space assignment judges every prefetch
# into VMEM inefficient, so none happens (see the module doc).
BYTES_OPTIONS = {"xla_tpu_msa_inefficient_use_to_copy_ratio": "1000000"}

# device_kind -> (HBM a program may use, HBM bandwidth in bytes/s). Usable HBM for v5e and v6e is
# what XLA:TPU reports as available in its out-of-memory errors; for v5p and v4, 98% of the chip's.
CHIPS: dict[str, tuple[int, float]] = {
    "TPU v5 lite": (int(15.75 * GiB), 819e9),  # v5e: 16 GiB, 819 GB/s
    "TPU v6 lite": (int(31.24 * GiB), 1640e9),  # v6e (Trillium): 32 GiB, 1,640 GB/s
    "TPU v5": (int(0.98 * 95 * 1e9), 2765e9),  # v5p: 95 GB, 2,765 GB/s
    "TPU v4": (int(0.98 * 32 * GiB), 1228e9),  # v4: 32 GiB, 1,228 GB/s
}


@dataclasses.dataclass
class StepReport:
    kind: str  # "prefill" | "decode"
    tokens: int
    seqs: int
    compile_s: float
    temp_bytes: int  # scratch of the step
    argument_bytes: int  # weights + KV cache + device batch + inputs, per chip
    alias_bytes: int  # donated buffers updated in place (the KV cache and the device batch)
    bytes_accessed: float  # decode: HBM bytes of the byte-counting compile, per chip (0: not counted)
    sampler_bytes: float  # decode: of which the sampler's own (the sampler compiled alone)
    floor_bytes: float  # decode: every weight once (the embedding's looked-up rows only) + the KV
    # pages its rows can see (full context)
    tokens_per_s: float = 0.0  # decode: rows / (bytes_accessed / HBM bandwidth)


@dataclasses.dataclass
class Plan:
    topology: str
    chip: str
    tensor_parallel_size: int
    hbm_bytes: int  # per chip, usable
    bandwidth: float  # bytes/s per chip
    weights_bytes: int  # per chip
    batch_bytes: int  # the persistent device batch, per chip
    scratch_bytes: int  # the largest step's, per chip
    kv_page_bytes: int  # one page of every layer's K and V, per chip
    num_pages: int
    page_size: int
    max_model_len: int
    steps: list[StepReport] = dataclasses.field(default_factory=list)
    error: str | None = None
    kv_dtype: str = "bfloat16"

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.kv_page_bytes


def topology_mesh(topology: str, tensor_parallel_size: int) -> Any:
    """A one-axis ("model") mesh over the first `tensor_parallel_size` chips of an abstract slice."""
    import jax
    import numpy as np
    from jax.experimental import topologies

    from jaxserve.parallel.mesh import MODEL_AXIS

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU to lock; let other processes compile too
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size}: the topology {topology} has "
                         f"{len(devices)} chips")
    return jax.sharding.Mesh(np.asarray(devices[:tensor_parallel_size]), (MODEL_AXIS,))


def abstract_params(cfg: Any, dtype: Any, mesh: Any, lora: tuple[int, int] = (0, 0)) -> tuple[Any, Any]:
    """(graphdef, state) of the decoder with every parameter a ShapeDtypeStruct in its serving
    sharding on `mesh` (nothing allocated). lora: (slots, rank) of LoRA adapter slots on every
    projection, as --enable-lora --max-loras --max-lora-rank give the server ((0, 0): none)."""
    import jax
    from flax import nnx

    from jaxserve.models.decoder import Decoder
    from jaxserve.models.lora import add_lora_slots
    from jaxserve.parallel import ShardingPlan
    from jaxserve.weights.lora_adapter import TARGETS

    plan = ShardingPlan(mesh, cfg)
    module = nnx.eval_shape(lambda: Decoder(cfg, dtype))
    if lora[0]:
        add_lora_slots(module, *lora, TARGETS, abstract=True, dtype=dtype)  # a TPU's factors: the model's dtype
    if cfg.moe is not None and plan.rules["experts"]:
        from jaxserve.models.moe import shard_experts

        shard_experts(module, mesh)
    graphdef, state = nnx.split(module)

    def place(path: tuple, leaf: Any) -> Any:
        names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        shape = tuple(leaf.shape)
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=plan.param_sharding(names, shape))

    return graphdef, jax.tree_util.tree_map_with_path(place, state)


def per_chip_bytes(tree: Any) -> int:
    """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (4-bit types at half a byte,
    as TPUs pack them)."""
    import jax
    import numpy as np

    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
               // (2 if np.dtype(a.dtype).name in ("int4", "uint4") else 1)
               for a in jax.tree_util.tree_leaves(tree))


def plan(cfg: Any, *, topology: str, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
         max_model_len: int | None = None, max_num_seqs: int = 16, max_num_batched_tokens: int = 256,
         max_prefill_seqs: int = 4, page_size: int = 16, num_pages: int | None = None,
         kv_cache_memory_fraction: float = 0.9, decode_buckets: tuple[int, ...] | None = None,
         prefill_buckets: tuple[int, ...] | None = None, attention_backend: str = "pallas_tpu",
         serving_compile: bool = True, kinds: tuple[str, ...] = ("prefill", "decode"),
         quantization: str = "none", kv_cache_dtype: str = "auto", lora: tuple[int, int] = (0, 0)) -> Plan:
    """Compile every step of the configuration for `topology` and measure it (see the module doc).
    serving_compile=False compiles the decode steps only once, for the byte count (their memory
    figures then come from that compile); `kinds` limits the steps compiled (CI's quicker forms).
    quantization: the weights' form, as --quantization (int8: one byte per weight, and a scale
    per output channel; int4: half a byte, and a float16 scale and minimum per group of 32 rows,
    the head int8). kv_cache_dtype: as --kv-cache-dtype (fp8: one byte per cached value). lora:
    (slots, rank) of LoRA adapter slots on every projection (abstract_params)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.config import SchedulerConfig
    from jaxserve.engine.buckets import BucketTable
    from jaxserve.engine.build import largest_steps, scratch_reserve
    from jaxserve.engine.device_batch import abstract_batch
    from jaxserve.engine.kv_cache import KVCache, bytes_per_page, cache_dtype
    from jaxserve.engine.programs import StepPrograms
    from jaxserve.engine.runner import compile_each
    from jaxserve.engine.step_inputs import StepInputBuilder
    from jaxserve.parallel import ShardingPlan

    jdtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype]
    kv_dtype = cache_dtype(kv_cache_dtype, jdtype)
    max_model_len = max_model_len or cfg.max_position_embeddings
    mesh = topology_mesh(topology, tensor_parallel_size)
    chip = mesh.devices.flat[0].device_kind
    if chip not in CHIPS:
        raise ValueError(f"no HBM figures for {chip!r}; known: {', '.join(CHIPS)}")
    hbm, bandwidth = CHIPS[chip]
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_prefill_seqs=max_prefill_seqs, max_model_len=max_model_len,
                            decode_buckets=decode_buckets, prefill_buckets=prefill_buckets)
    max_pages_per_seq = math.ceil(max_model_len / page_size)
    builder = StepInputBuilder(num_slots=max_num_seqs + 1, vocab_size=cfg.vocab_size, page_size=page_size,
                               max_pages_per_seq=max_pages_per_seq, buckets=BucketTable(sched),
                               max_prefill_seqs=max_prefill_seqs, decode_steps=1, row_params=lambda seq: None)
    sharding = ShardingPlan(mesh, cfg)
    graphdef, params = abstract_params(cfg, jdtype, mesh, lora)
    from jaxserve.models import products

    head_path = ("embed_tokens",) if cfg.tie_word_embeddings else ("lm_head",)
    params = products.abstract_place(params, head_path, quantization)
    programs = StepPrograms(graphdef, cfg, page_size=page_size, attention_backend=attention_backend, mesh=mesh,
                            params_sharding=jax.tree_util.tree_map(lambda a: a.sharding, params))
    batch = abstract_batch(max_num_seqs + 1, cfg.vocab_size, max_pages_per_seq, sharding.replicated())
    platform = mesh.devices.flat[0].platform
    kv_page = -(-bytes_per_page(cfg, page_size, kv_dtype, platform) // sharding.kv_shards)

    def kv(pages: int) -> KVCache:
        shape = KVCache.shape(cfg, pages, page_size, platform)
        return KVCache(*(jax.ShapeDtypeStruct(shape, kv_dtype, sharding=sharding.kv_cache()) for _ in range(2)))

    result = Plan(topology, chip, tensor_parallel_size, hbm, bandwidth, per_chip_bytes(params),
                  per_chip_bytes(batch), 0, kv_page, 0, page_size, max_model_len, kv_dtype=kv_dtype.name)
    # Read per step: every weight but the embedding, of which a step looks up a few rows (a tied
    # embedding is also the LM head, which reads it whole).
    read_weights = result.weights_bytes
    if not cfg.tie_word_embeddings:
        read_weights -= per_chip_bytes(params["embed_tokens"])
    keys = [k for k in builder.keys() if k[0] in kinds]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        try:
            if num_pages is None:
                # The server's sizing: the largest steps' scratch, measured against a tiny cache.
                probe = compile_each(
                    largest_steps(keys, kinds),
                    lambda k: programs.lower(k, params, kv(max_pages_per_seq + 1), batch, builder.abstract(k)),
                    lambda _, lowered: lowered.compile(), "sizing the KV cache")
                result.scratch_bytes = max(c.memory_analysis().temp_size_in_bytes for c in probe)
                reserve = scratch_reserve(result.scratch_bytes)
                free = hbm - result.weights_bytes - result.batch_bytes - reserve
                num_pages = int(free * kv_cache_memory_fraction) // kv_page
                if num_pages < 2:
                    raise ValueError(f"no room for the KV cache: the weights take {result.weights_bytes / GiB:.2f} "
                                     f"GiB and the steps {reserve / GiB:.2f} GiB of {hbm / GiB:.2f} GiB per chip")
            result.num_pages = num_pages
            cache = kv(num_pages)

            def compile_step(key: tuple, lowered: Any) -> tuple[Any, Any, float]:
                start = time.perf_counter()
                counted = None
                if key[0] == "decode":
                    counted = lowered.compile(compiler_options=BYTES_OPTIONS)
                compiled = lowered.compile() if serving_compile or counted is None else counted
                return compiled, counted, time.perf_counter() - start

            compiled_steps = compile_each(keys, lambda key: programs.lower(key, params, cache, batch,
                                                                           builder.abstract(key)),
                                          compile_step, f"compiling steps for {topology}")
            sampler = _sampler_cost(cfg.vocab_size, batch, sharding.replicated(), sharding.logits(), chip)
            for key, (compiled, counted, seconds) in zip(keys, compiled_steps):
                report = _report(key, compiled, counted, seconds, result, read_weights, max_pages_per_seq)
                if counted is not None:
                    report.sampler_bytes = sampler(report.seqs)
                result.steps.append(report)
            result.scratch_bytes = max(result.scratch_bytes, *(s.temp_bytes for s in result.steps))
        except Exception as e:  # the compiler's own words: out of HBM, a kernel it rejects, ...
            result.error = f"{type(e).__name__}: {e}"
    return result


# (chip, mesh size, logits' spec, vocab, rows, device batch shapes) -> the sampler's bytes. Under
# tensor parallelism the LM head is split over the vocabulary and nothing gathers its logits, so
# the step samples on the shards: each chip's sampler bytes shrink with the mesh, and a sampler
# compiled replicated (as this once was, to share one compile between mesh sizes) counted eight
# chips' work at TP 8, which made the model's part look smaller than its floor (1.05 of floor at
# 64 rows). Each mesh size costs a compile of its own (3-6 s at a 128k vocabulary).
_SAMPLER_BYTES: dict[tuple, float] = {}


def _sampler_cost(vocab_size: int, batch: Any, replicated: Any, logits_sharding: Any, chip: str) -> Any:
    """rows -> bytes the sampler alone accesses for that many rows, its logits sharded as the step's
    LM head leaves them: the work a step does beyond reading weights and KV pages, shown apart."""
    import jax
    import jax.numpy as jnp

    from jaxserve.engine import device_batch
    from jaxserve.engine.sampler import sample

    def step(b: Any, logits: jax.Array, slots: jax.Array, steps: jax.Array) -> Any:
        return sample(logits, device_batch.sampling_rows(b, slots, steps), row_loops=True)  # TPU's forms

    shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(batch))
    mesh_size = logits_sharding.mesh.size

    def cost(rows: int) -> float:
        key = (chip, mesh_size, logits_sharding.spec, vocab_size, rows, shapes)
        if key not in _SAMPLER_BYTES:
            i32 = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=replicated)
            logits = jax.ShapeDtypeStruct((rows, vocab_size), jnp.float32, sharding=logits_sharding)
            compiled = jax.jit(step).lower(batch, logits, i32, i32).compile(compiler_options=BYTES_OPTIONS)
            _SAMPLER_BYTES[key] = hbm_bytes_accessed(compiled)
        return _SAMPLER_BYTES[key]

    return cost


def _report(key: tuple, compiled: Any, counted: Any, seconds: float, p: Plan, read_weights: int,
            max_pages_per_seq: int) -> StepReport:
    ma = compiled.memory_analysis()
    kind, tokens, seqs = key[0], key[1], key[2] if key[0] == "prefill" else key[1]
    accessed = floor = tokens_per_s = 0.0
    if counted is not None:
        accessed = hbm_bytes_accessed(counted)
        # Every weight once, plus every page its rows' page tables can reach (full context).
        floor = read_weights + seqs * max_pages_per_seq * p.kv_page_bytes
        tokens_per_s = seqs * p.bandwidth / accessed if accessed else 0.0
    return StepReport(kind, tokens, seqs, seconds, int(ma.temp_size_in_bytes), int(ma.argument_size_in_bytes),
                      int(ma.alias_size_in_bytes), accessed, 0.0, floor, tokens_per_s)


def bytes_accessed(compiled: Any) -> float:
    """The cost analysis' bytes accessed of a compiled program, whatever the memory space."""
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost).get("bytes accessed", 0.0))


def hbm_bytes_accessed(compiled: Any) -> float:
    """A byte-counting compile's HBM bytes: its bytes accessed, less the VMEM side of the accesses
    its top-level instructions make (`vmem_access_bytes`)."""
    return bytes_accessed(compiled) - vmem_access_bytes(compiled.as_text())


# HLO element types -> bits (sub-byte types pack: s4 is half a byte).
_HLO_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "s16": 16, "u16": 16,
             "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64}
_HLO_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]\{([^}]*)\}")
# name = shape opcode(operands), attributes; a tuple's shape may hold "/*index=5*/" comments.
_HLO_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)")
# Instructions whose VMEM accesses are left counted. XLA's cost analysis counts none for some (they
# move nothing; control flow is costed by its computations, a loop's body once), counts only a
# part for others (a slice reads what it keeps, an update-slice writes its update), and takes a
# custom call's or an async start's cost from elsewhere; taking out their whole operands and
# results could take out traffic it never counted, so they are not visited, and the HBM figure errs
# high if anything.
_NOT_VISITED = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                "after-all", "add-dependency", "domain", "slice", "dynamic-slice", "gather", "dynamic-update-slice",
                "scatter", "custom-call", "async-start", "async-update", "async-done"}


def _vmem_bytes(shape: str) -> int:
    """Bytes of the arrays of an HLO shape (an array or a tuple's) that live in VMEM (memory space 1)."""
    total = 0
    for element, dims, layout in _HLO_ARRAY.findall(shape):
        if "S(1)" in layout and element in _HLO_BITS:
            total += math.prod(int(d) for d in dims.split(",") if d) * _HLO_BITS[element] // 8
    return total


def vmem_access_bytes(hlo: str) -> int:
    """Bytes that the entry computation's instructions write to or read from VMEM (memory space 1,
    `S(1)` in a layout), in an optimized TPU module's text. XLA's cost analysis counts these as
    bytes accessed like any other: a weight copied into VMEM for a dot counts three times (the HBM
    read, the VMEM write, the dot's VMEM read), though HBM sees it once. Only instructions whose
    whole operands and result XLA counts are visited (copies, fusions, elementwise and collective
    ops; see `_NOT_VISITED`), and not those inside loops and branches, so what is left counted errs
    high, but for one case: a fusion that reads only a slice of a VMEM operand, which is taken out
    whole (tests/tpu_aot bounds the result from both sides against the step's floor)."""
    start = hlo.find("\nENTRY ")
    if start < 0:
        return 0
    end = hlo.find("\n}", start + 1)
    shapes: dict[str, str] = {}
    total = 0
    for line in hlo[start:end].splitlines()[1:]:
        m = _HLO_INSTRUCTION.match(line)
        if m is None:
            continue
        name, shape, opcode, rest = m.groups()
        shapes[name] = shape
        if opcode in _NOT_VISITED:
            continue
        depth, cut = 1, len(rest)  # the operand list ends at the paren that closes the call
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                cut = i
                break
        operands = re.findall(r"%([\w.\-]+)", rest[:cut])
        total += _vmem_bytes(shape) + sum(_vmem_bytes(shapes.get(o, "")) for o in operands)
    return total


def floor_ratio(s: StepReport) -> float:
    """How close a decode step's model part (its bytes minus the sampler's) is to its floor."""
    return s.floor_bytes / (s.bytes_accessed - s.sampler_bytes)


def format_plan(p: Plan) -> str:
    lines = [f"{p.topology} ({p.chip}), tensor parallel over {p.tensor_parallel_size} chip(s): "
             f"{p.hbm_bytes / GiB:.2f} GiB HBM and {p.bandwidth / 1e9:,.0f} GB/s per chip"]
    if p.error:
        lines.append(f"DOES NOT COMPILE: {p.error}")
    lines += [
        f"per chip: weights {p.weights_bytes / GiB:.2f} GiB, device batch {p.batch_bytes / 2**20:.1f} MiB, "
        f"largest step's scratch {p.scratch_bytes / GiB:.2f} GiB",
        f"KV cache: {p.num_pages} pages of {p.page_size} tokens = {p.kv_tokens:,} tokens "
        f"({p.kv_bytes / GiB:.2f} GiB per chip, {p.kv_dtype}); max_model_len {p.max_model_len}",
    ]
    if p.steps:
        lines.append(f"{'step':<8} {'tokens':>6} {'seqs':>5} {'compile s':>9} {'scratch MiB':>11} "
                     f"{'HBM GiB':>8} {'GB/step':>8} {'sampler':>8} {'floor GB':>8} {'of floor':>8} {'tok/s':>9}")
    for s in p.steps:
        hbm = (s.argument_bytes + s.temp_bytes) / GiB
        dash = f"{'-':>8}"
        counted = bool(s.floor_bytes and s.bytes_accessed)
        ratio = f"{floor_ratio(s):8.2f}" if counted else dash
        tps = f"{s.tokens_per_s:9,.0f}" if s.tokens_per_s else f"{'-':>9}"
        floor = f"{s.floor_bytes / 1e9:8.2f}" if counted else dash
        total = f"{s.bytes_accessed / 1e9:8.2f}" if counted else dash
        sampler = f"{s.sampler_bytes / 1e9:8.2f}" if counted else dash
        lines.append(f"{s.kind:<8} {s.tokens:>6} {s.seqs:>5} {s.compile_s:>9.1f} {s.temp_bytes / 2**20:>11.1f} "
                     f"{hbm:>8.2f} {total} {sampler} {floor} {ratio} {tps}")
    if any(s.tokens_per_s for s in p.steps):
        lines.append("GB/step: HBM bytes per decode step, of which sampler: the sampler's (every filter "
                     "branch counted); of floor: floor / (GB/step - sampler); tok/s: rows / (GB/step / HBM "
                     "bandwidth). Every row at max_model_len (the kernels' worst case): shorter contexts read "
                     "fewer pages")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The plan's command line (its own: `python -m jaxserve.plan`, not the server's)."""
    from jaxserve.cli import _HelpFormatter

    class Formatter(argparse.RawDescriptionHelpFormatter, _HelpFormatter):
        """The module's text as written, and each flag's default as the server's --help shows it."""

    p = argparse.ArgumentParser(prog="python -m jaxserve.plan", description=__doc__, formatter_class=Formatter)
    p.add_argument("--model", required=True, help="a Hugging Face model directory (only config.json is read)")
    p.add_argument("--topology", required=True, help="TPU slice, e.g. v5e:2x2, v6e:2x4 (jax topology names)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="chips to shard the model over")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the weights' and activations' dtype, as the server's --dtype")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="the weights' form, as the server's --quantization (int8: a byte per weight; int4: half a "
                   "byte plus float16 scales and minima per group of 32 rows, the head int8)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus output, in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="largest decode batch (as python -m jaxserve)")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="largest prefill step, in tokens")
    p.add_argument("--max-prefill-seqs", type=int, default=4, help="most prompts in one prefill step")
    p.add_argument("--decode-buckets", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes to compile, as the server's flag (default: powers of two up to "
                   "--max-num-seqs, which the largest must equal)")
    p.add_argument("--prefill-buckets", type=int, nargs="+", default=None, metavar="N",
                   help="prefill step sizes in tokens, as the server's flag (default: powers of two from 16 to "
                   "--max-num-batched-tokens, which the largest must equal)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype, as the server's flag: auto = --dtype; fp8 (= fp8_e4m3) and fp8_e5m2 "
                   "hold a byte per value, twice the tokens of bfloat16 and half the KV bytes per step")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: sized as the server does)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                   help="share of the HBM left after weights that the KV cache may take")
    p.add_argument("--attention-backend", default="pallas_tpu", choices=["pallas_tpu", "reference"],
                   help="pallas_tpu: the Mosaic kernels the server runs; reference: plain XLA attention")
    p.add_argument("--max-loras", type=int, default=0, metavar="N",
                   help="LoRA adapter slots on every projection, as the server's --enable-lora --max-loras N "
                   "(0: none); their factors count in the weights and in every step's bytes")
    p.add_argument("--max-lora-rank", type=int, default=16, metavar="R", help="with --max-loras: the slots' rank")
    p.add_argument("--json", default=None, help="also write the plan here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs nothing; the TPU is abstract
    try:
        import libtpu  # noqa: F401
    except ImportError:
        print("jaxserve.plan needs the TPU compiler: pip install 'libtpu==0.0.48.*' (the version jax 0.11.2 "
              "pins)", file=sys.stderr)
        return 2
    from jaxserve.config import SchedulerConfig
    from jaxserve.engine.buckets import BucketTable, in_flag_words
    from jaxserve.models.config import decoder_config_from_hf

    try:  # the grid first: a mistyped bucket list should not wait for the topology
        sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                decode_buckets=args.decode_buckets, prefill_buckets=args.prefill_buckets)
        BucketTable(sched)
    except ValueError as e:
        print(f"jaxserve.plan: {in_flag_words(e)}", file=sys.stderr)
        return 2
    for flag, value, low in (("--tensor-parallel-size", args.tensor_parallel_size, 1),
                             ("--page-size", args.page_size, 1), ("--max-prefill-seqs", args.max_prefill_seqs, 1),
                             ("--num-pages", args.num_pages, 2), ("--max-model-len", args.max_model_len, 1),
                             ("--max-loras", args.max_loras, 0), ("--max-lora-rank", args.max_lora_rank, 1)):
        if value is not None and value < low:
            print(f"jaxserve.plan: {flag} must be at least {low}, got {value}", file=sys.stderr)
            return 2
    if not 0 < args.kv_cache_memory_fraction <= 1:
        print(f"jaxserve.plan: --kv-cache-memory-fraction must be in (0, 1], got {args.kv_cache_memory_fraction}",
              file=sys.stderr)
        return 2
    config_json = Path(args.model) / "config.json"
    try:
        cfg = decoder_config_from_hf(json.loads(config_json.read_text()))
    except OSError as e:
        print(f"jaxserve.plan: {config_json}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyError as e:
        print(f"jaxserve.plan: {config_json}: no {e} (a Hugging Face config.json names the model's sizes)",
              file=sys.stderr)
        return 2
    except ValueError as e:  # not JSON, or not a decoder (a pooling model has no KV cache to plan)
        print(f"jaxserve.plan: {config_json}: {e}; the plan is for the decoders the server generates with",
              file=sys.stderr)
        return 2
    try:
        topology_mesh(args.topology, args.tensor_parallel_size)
    except ValueError as e:
        print(f"jaxserve.plan: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # jax's JaxRuntimeError: INVALID_ARGUMENT for a name libtpu does not know
        print(f"jaxserve.plan: --topology {args.topology}: {e} (e.g. v5e:2x2, v6e:2x4, v5p:2x2x1)", file=sys.stderr)
        return 2
    result = plan(cfg, topology=args.topology, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_seqs=args.max_prefill_seqs,
                  page_size=args.page_size, num_pages=args.num_pages,
                  kv_cache_memory_fraction=args.kv_cache_memory_fraction, attention_backend=args.attention_backend,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                  lora=(args.max_loras, args.max_lora_rank if args.max_loras else 0),
                  decode_buckets=sched.decode_buckets, prefill_buckets=sched.prefill_buckets)
    print(format_plan(result))
    if args.json:
        Path(args.json).write_text(json.dumps(dataclasses.asdict(result), indent=1))
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
