"""ModelRunner: the only owner of device arrays (the weights, the KV cache and the persistent device
batch). It compiles the model's programs (jaxserve.engine.programs) for every command shape ahead of
time and runs a step's commands through them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from jaxserve.engine import device_batch
from jaxserve.engine.kv_cache import KVCache
from jaxserve.engine.programs import STEP_KINDS, StepOutput, StepPrograms
from jaxserve.engine.step_inputs import Key, Payload, StepCommands
from jaxserve.models import products
from jaxserve.models.decoder import Decoder
from jaxserve.parallel import mesh_of
from jaxserve.parallel.multihost import is_leader, to_host

log = logging.getLogger("jaxserve.engine")

# Programs XLA compiles at once at start-up (at most one per core): each compile holds a program's
# compiler state in host memory, so a few at a time, not all of them.
COMPILE_THREADS = 4

# XLA:GPU rematerializes (recomputes activations, duplicating kernels) when a program's estimated
# peak exceeds its limit, and its estimate counts the donated KV cache twice: in and out, though
# the step updates it in place. With a cache of 32 GB beside 16 GB of Llama-3-8B weights on an H100
# every step was rematerialized ("Can't reduce memory use below ...": 80 GiB estimated against a
# 57 GiB limit) and the batch-1 decode step ran 3% slower. The slop factor scales the limit (percent
# of what the weights and cache leave); the engine sizes the cache after the measured scratch, so
# the estimate is not needed as a guard.
#
# XLA:GPU merges dots that share an operand into one product (DotMerger: a layer's q, k and v
# projections become one GEMM whose kernel reads the three weights in place), but only dots whose
# operands are under a size threshold (default 32 MB): Llama-3-8B's gate and up projections (117 MB
# each) stayed two GEMMs, one kernel more per layer and per token. At 256 MB they merge. Seen in
# the decode step compiled for an H100 on a machine without one (tests/gpu_aot): 614 -> 582
# kernels per batch-1 iteration.
GPU_COMPILER_OPTIONS = {"xla_gpu_memory_limit_slop_factor": 1000, "xla_gpu_dot_merger_threshold_mb": 256}


def min_product_rows(platform: str, dtype: Any, native_products: bool = False) -> int:
    """Rows a step's products are padded to (one-token steps get a padding token, one-sequence
    heads a padding row; the attention still runs on the real rows only).

    XLA:CPU computes a bfloat16 product with a single row in a plain loop at ~1.3 GB/s, about 10x
    slower than with two rows (which go to the matmul library); the native kernel streams one row
    at the memory's rate. XLA:GPU rewrites a single-row product with a weight of under 10M elements
    (Llama-3-8B's k and v projections) as a multiply and a reduction that writes the weight-sized
    product out, 3x a matmul's bytes (H100 trace, benchmarks/RESULTS.md); two rows stay a matmul."""
    if platform == "gpu":
        return 2
    if platform == "cpu" and not native_products and jnp.dtype(dtype) == jnp.bfloat16:
        return 2
    return 1


def compiler_options(platform: str) -> dict[str, Any] | None:
    """XLA options for the engine's step programs on `platform` (None: the defaults)."""
    return dict(GPU_COMPILER_OPTIONS) if platform == "gpu" else None


def compile_each(keys: list[Any], lower: Callable[[Any], Any], compile_one: Callable[[Any, Any], Any], desc: str,
                 unit: str = "step") -> list[Any]:
    """compile_one(key, lower(key)) for every key, results in the keys' order. Tracing and lowering
    hold the GIL, so they run here one program after another, while XLA compiles (or loads from the
    cache) the programs already lowered on a pool of threads: the Python work of the next program
    overlaps the compiler's of the last ones, and on a multi-core host several programs compile at
    once (XLA releases the GIL). A progress bar counts the programs done; the first error is raised
    and the compiles not yet started are dropped."""
    workers = max(1, min(len(keys), os.cpu_count() or 1, COMPILE_THREADS))
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
    try:
        with tqdm(total=len(keys), desc=desc, unit=unit, disable=None) as bar:
            def done(key: Any) -> Callable[[concurrent.futures.Future], None]:
                def update(_: concurrent.futures.Future) -> None:
                    bar.set_postfix_str(" ".join(map(str, key)) if isinstance(key, tuple) else str(key))
                    bar.update()
                return update

            futures = []
            for key in keys:
                future = pool.submit(compile_one, key, lower(key))
                future.add_done_callback(done(key))
                futures.append(future)
            return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class ModelRunner:
    def __init__(
        self,
        decoder: Decoder,
        num_pages: int,
        page_size: int,
        max_pages_per_seq: int,
        num_slots: int,
        *,
        kv_dtype: Any = None,
        attention_backend: str = "reference",
        matmul_backend: str = "xla",
        quantization: str = "none",
        quantization_group: int = 32,
        blocks: Callable[[tuple], Any] | None = None,
        decode_steps: int = 1,
        take_weights: bool = False,
    ):
        """take_weights: the runner may free `decoder`'s weight buffers once it has its own copies
        (the CPU kernel's packed layout), so the caller must not use `decoder` afterwards."""
        self.cfg = decoder.cfg
        self.graphdef, params = nnx.split(decoder)
        # The weights' types pick their products (jaxserve.models.products).
        self.params = products.place(params, matmul_backend, decoder.head_path, quantization=quantization,
                                     group=quantization_group, blocks=blocks, consume=take_weights)
        self.max_pages_per_seq = max_pages_per_seq
        self.num_slots = num_slots
        platform = jax.devices()[0].platform
        native = matmul_backend == "cpu" and platform == "cpu" and _native_products_available()
        min_rows = min_product_rows(platform, decoder.dtype, native)
        # Tensor parallelism is the loaded parameters' layout: weights on a mesh mean a sharded
        # step; weights on one device mean the plain single-device step.
        mesh = mesh_of(self.params)
        self.programs = StepPrograms(
            self.graphdef, self.cfg, page_size=page_size, decode_steps=decode_steps,
            attention_backend=attention_backend, min_rows=min_rows, mesh=mesh,
            params_sharding=jax.tree_util.tree_map(lambda a: a.sharding, self.params) if mesh is not None else None)
        self.kv = KVCache.create(self.cfg, num_pages, page_size, kv_dtype or decoder.dtype, self.programs.kv_sharding,
                                 platform)  # the platform num_pages_for sized it for
        self.batch = device_batch.create_batch(num_slots, self.cfg.vocab_size, max_pages_per_seq,
                                               self.programs.replicated)
        self.param_leaves = self.programs.flat_params(self.params)  # what the steps take (programs.py)
        self._programs: dict[Key, Any] = {}
        # Multi-host: the leader sends each command here before running it (set by the builder).
        self.channel: Any = None

    def write_lora_slot(self, slot: int, rank: int, factors: dict[tuple[int, str], Any]) -> None:
        """Write a LoRA adapter's factors into adapter slot `slot` (jaxserve.models.lora.write_slot);
        the next step reads them."""
        from jaxserve.models import lora

        lora.write_slot(self.param_leaves, lora.slot_leaves(self.params), slot, rank, factors)
        self.params = jax.tree.unflatten(self.programs.param_treedef, self.param_leaves)

    @property
    def min_rows(self) -> int:
        return self.programs.min_rows

    @min_rows.setter
    def min_rows(self, rows: int) -> None:  # read while tracing: set it before compiling
        self.programs.min_rows = rows

    @property
    def attention_backend(self) -> str:
        return self.programs.attention_backend

    # ---- ahead-of-time compilation ----------------------------------------------------------------
    def compile(self, keys: list[Key], abstract: Callable[[Key], dict[str, tuple[tuple[int, ...], Any]]]) -> dict[Key, float]:
        """Compile every command shape now (progress bar; seconds per step shape logged). With the
        persistent compilation cache warm, this is mostly cache reads. Lowered here one by one,
        compiled a few at once on threads (`compile_each`)."""
        options = compiler_options(jax.devices()[0].platform)

        def lower(key: Key) -> tuple[jax.stages.Lowered, float]:
            start = time.perf_counter()
            lowered = self.programs.lower(key, self.params, self.kv, self.batch, abstract(key))
            return lowered, time.perf_counter() - start

        def compile_one(key: Key, lowered: tuple[jax.stages.Lowered, float]) -> float:
            program, lowering_seconds = lowered
            start = time.perf_counter()
            self._programs[key] = program.compile(compiler_options=options)
            took = lowering_seconds + time.perf_counter() - start
            if key[0] in STEP_KINDS:
                log.info("compiled %s step %s in %.2fs", key[0], key[1:], took)
            return took

        return dict(zip(keys, compile_each(keys, lower, compile_one, "compiling steps", unit="shape")))

    @property
    def compiled_steps(self) -> dict[Key, Any]:
        """The compiled prefill and decode programs, by key."""
        return {k: c for k, c in self._programs.items() if k[0] in STEP_KINDS}

    # ---- running ------------------------------------------------------------------------------------
    def call(self, key: Key, payload: Payload) -> StepOutput | None:
        """Run one command (asynchronously: a step's outputs are futures until read)."""
        compiled = self._programs.get(key)
        if compiled is None:
            raise RuntimeError(f"command shape {key} was not compiled at start-up")
        if self.channel is not None and is_leader():
            self.channel.send(key, payload)
        if key[0] in STEP_KINDS:
            self.kv, self.batch, out = compiled(self.param_leaves, self.kv, self.batch, payload)
            return out
        if key[0] == "copy":
            self.kv = compiled(self.kv, payload)
            return None
        self.batch = compiled(self.batch, payload)
        return None

    def close(self) -> None:
        """Release the other processes of a multi-host job (they exit); nothing to do otherwise."""
        if self.channel is not None and is_leader():
            self.channel.stop()
            self.channel = None

    def execute(self, step: StepCommands) -> "StepHandle":
        """Run a step's commands; the handle reads its outputs back when asked."""
        outputs: dict[Key, StepOutput] = {}
        for command in step.commands:
            out = self.call(command.key, command.payload)
            if out is not None:
                outputs[command.key] = out
        return StepHandle(outputs.get(step.prefill) if step.prefill else None,
                          outputs.get(step.decode) if step.decode else None)


@dataclasses.dataclass
class StepHandle:
    """A dispatched step's outputs, on the device until `prefill_output()` / `decode_output()`."""

    _prefill: Any
    _decode: Any

    def prefill_output(self) -> Any:
        return None if self._prefill is None else to_host(self._prefill)

    def decode_output(self) -> Any:
        return None if self._decode is None else to_host(self._decode)


def _native_products_available() -> bool:
    from pallas_kernels import cpu_matmul

    return cpu_matmul.available()
