"""jaxserve's TPU kernels through the real TPU compiler (XLA:TPU + Mosaic), without a TPU.

Interpret mode (tests/kernels) proves the kernels right; only the real compiler says whether Mosaic
accepts them (layouts, tiling, block shapes, DMAs, VMEM) and what the compiled step costs. Here the
TPU Pallas kernels (decode, ragged prefill) and the KV write are compiled with `interpret=False` for
one abstract chip at Llama-3-8B (32 q / 8 kv heads) and Llama-3-70B (64 q / 8 kv heads) head shapes,
head_dim 128, bfloat16, page sizes 16, 32 and 64, over the engine's stacked cache: 32 layers (the
kernels read one layer in place, so the layer count only sets the cache size) of a 64Ki-token
cache per layer (4096/2048/1024 pages, 8 GiB of K+V), with the layer and the window as traced
int32 arguments, as the engine's per-layer loop passes them. Decode: batch 64, 8192-token contexts;
prefill: 1024 tokens of 8 sequences, 8192-token contexts.

Each step is jitted the way the engine runs it: `write_kv` then the attention kernel, with the
cache donated, and `memory_analysis()` must show the cache aliased (updated in place: no
cache-sized temporary) and the program within the chip's HBM. A kernel's VMEM is checked by the
compiler itself (over-VMEM scratch fails the compile, which `test_compiler_rejects_a_kernel_over_vmem`
keeps honest) and against a budget here.

Coverage: the full cross product (2 chips x 2 head shapes x 3 page sizes for decode, ragged
prefill and the write; the ragged kernel also at a decode bucket on v5e), about 30 s on two cores,
the compiles being 0.2-0.5 s (decode, write) and 1-1.5 s (ragged) each.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

pytest.importorskip(
    "libtpu",
    reason="libtpu is not installed (the `test` extra installs it on Linux x86_64; the lent GPU machine "
    "has none): the deviceless TPU compile checks need the TPU compiler",
)

from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from pallas_kernels import get_decode_attention, get_ragged_attention, write_kv  # noqa: E402
from pallas_kernels.ragged_paged_attention import default_q_block, max_work_items  # noqa: E402
from pallas_kernels.tpu_paged_attention import block_page_tables  # noqa: E402

MiB = 1 << 20
DTYPE = jnp.bfloat16
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
CACHE_TOKENS = 64 * 1024  # per layer
CONTEXT = 8192
DECODE_BATCH = 64
PREFILL_TOKENS, PREFILL_SEQS = 1024, 8
Q_HEADS = {"llama3_8b": 32, "llama3_70b": 64}
# A kernel's own VMEM (K/V scratch, q block, pipelined q/out blocks) stays within v5e's default
# scoped VMEM limit (16 MiB), leaving the rest of the 128 MiB to the compiler.
VMEM_BUDGET = 16 * MiB

V5E, V6E = "v5e:2x2", "v6e:2x2"
CASES = [(topology, model, page) for topology in (V5E, V6E) for model in Q_HEADS for page in (16, 32, 64)]
# The ragged kernel also runs decode buckets (a token per sequence: q_block 1-2, 8-row blocks).
RAGGED_CASES = [case + (PREFILL_TOKENS, PREFILL_SEQS) for case in CASES]
RAGGED_CASES += [(V5E, model, 16, DECODE_BATCH, DECODE_BATCH) for model in Q_HEADS]
WRITE_CASES = [(topology, page) for topology in (V5E, V6E) for page in (16, 32, 64)]


def case_id(case: tuple) -> str:
    """(topology, model, page_size[, tokens, seqs]) -> "v5e-llama3_8b-p16[-1024x8]"."""
    topology, model, page_size, *bucket = case
    return "-".join([topology.split(":")[0], model, f"p{page_size}"] + (["{}x{}".format(*bucket)] if bucket else []))


def write_id(case: tuple) -> str:
    return f"{case[0].split(':')[0]}-p{case[1]}"


def cache_shape(page_size: int) -> tuple[int, ...]:
    return (LAYERS, KV_HEADS, CACHE_TOKENS // page_size, page_size, HEAD_DIM)


def nbytes(shape: tuple[int, ...], dtype: Any = DTYPE) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def compile_on(chip, fn, shapes: list[tuple[tuple[int, ...], Any]], *, donate: tuple[str, ...] = (), label: str = ""):
    """`fn` jitted (donating `donate`) and compiled for `chip` from abstract (shape, dtype) arguments."""
    replicated = NamedSharding(chip.mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes]
    start = time.perf_counter()
    with jax.sharding.use_abstract_mesh(chip.mesh.abstract_mesh):
        compiled = jax.jit(fn, donate_argnames=donate).lower(*args).compile()
    print(f"{label}: lower + compile {time.perf_counter() - start:.2f}s")
    return compiled


def bytes_accessed(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def worst_case_kv_bytes(walks: int, max_pages: int, page_size: int) -> int:
    """K and V bytes when every page-table entry of every walk is read once by every kv head."""
    return 2 * walks * max_pages * page_size * KV_HEADS * HEAD_DIM * jnp.dtype(DTYPE).itemsize


def pages_per_block(page_size: int, max_pages: int) -> int:
    """The kernels' default block of pages (their own rule, `block_page_tables`)."""
    return block_page_tables(jnp.zeros((1, max_pages), jnp.int32), page_size, None)[1]


def tile_rows(rows: int) -> int:
    """`rows` rounded up to whole bfloat16 VMEM tiles (16 rows x 128 lanes)."""
    return -(-rows // 16) * 16


def kv_scratch_bytes(page_size: int, max_pages: int) -> int:
    return 2 * 2 * pages_per_block(page_size, max_pages) * page_size * HEAD_DIM * 2  # K, V x two slots


def check_in_place(compiled, cache_bytes: int, chip) -> None:
    """The donated cache is updated in place and the whole program fits the chip's HBM."""
    mem = compiled.memory_analysis()
    print(
        f"  args {mem.argument_size_in_bytes / MiB:.1f} MiB, out {mem.output_size_in_bytes / MiB:.1f} MiB, "
        f"alias {mem.alias_size_in_bytes / MiB:.1f} MiB, temp {mem.temp_size_in_bytes / MiB:.2f} MiB"
    )
    assert mem.alias_size_in_bytes >= cache_bytes, "the donated cache is not aliased to the output"
    # No copy of the cache, not even of one layer: temporaries stay under an eighth of a layer's K+V.
    assert mem.temp_size_in_bytes < cache_bytes / LAYERS / 8
    footprint = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    assert footprint + mem.temp_size_in_bytes <= chip.hbm_bytes


SCALE = HEAD_DIM**-0.5
SCALAR = ((), jnp.int32)


@pytest.mark.parametrize("topology, model, page_size", CASES, ids=map(case_id, CASES))
def test_decode_step_compiles_with_the_cache_in_place(tpu_chip, topology, model, page_size):
    chip = tpu_chip(topology)
    q_heads, max_pages = Q_HEADS[model], CONTEXT // page_size
    attention = functools.partial(get_decode_attention("pallas_tpu"), scale=SCALE, interpret=False)

    def step(q, k_new, v_new, k_pages, v_pages, slots, page_tables, lengths, layer, window):
        k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, slots, layer=layer)
        out = attention(q, k_pages, v_pages, page_tables, lengths, window=window, layer=layer)
        return out, k_pages, v_pages

    batch, cache = DECODE_BATCH, cache_shape(page_size)
    new = ((batch, KV_HEADS, HEAD_DIM), DTYPE)
    shapes = [((batch, q_heads, HEAD_DIM), DTYPE), new, new, (cache, DTYPE), (cache, DTYPE)]
    shapes += [((batch,), jnp.int32), ((batch, max_pages), jnp.int32), ((batch,), jnp.int32), SCALAR, SCALAR]
    compiled = compile_on(chip, step, shapes, donate=("k_pages", "v_pages"), label=f"decode {model} p{page_size}")

    check_in_place(compiled, 2 * nbytes(cache), chip)
    group = q_heads // KV_HEADS
    vmem = kv_scratch_bytes(page_size, max_pages) + 2 * 2 * tile_rows(group) * HEAD_DIM * 2  # + q/out blocks
    print(f"  step bytes accessed {bytes_accessed(compiled) / MiB:.1f} MiB, kernel VMEM {vmem / 1024:.0f} KiB")
    # The kernel's cost estimate puts its worst-case KV reads into the step's cost.
    assert bytes_accessed(compiled) >= worst_case_kv_bytes(batch, max_pages, page_size)
    assert vmem <= VMEM_BUDGET


@pytest.mark.parametrize("topology, model, page_size, tokens, seqs", RAGGED_CASES, ids=map(case_id, RAGGED_CASES))
def test_ragged_step_compiles_with_the_cache_in_place(tpu_chip, topology, model, page_size, tokens, seqs):
    chip = tpu_chip(topology)
    q_heads, max_pages = Q_HEADS[model], CONTEXT // page_size
    attention = functools.partial(get_ragged_attention("pallas_tpu"), scale=SCALE, interpret=False)

    def step(q, k_new, v_new, k_pages, v_pages, slots, page_tables, cu_q_lens, kv_lens, num_seqs, layer, window):
        k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, slots, layer=layer)
        out = attention(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, num_seqs, window=window, layer=layer)
        return out, k_pages, v_pages

    cache = cache_shape(page_size)
    new = ((tokens, KV_HEADS, HEAD_DIM), DTYPE)
    shapes = [((tokens, q_heads, HEAD_DIM), DTYPE), new, new, (cache, DTYPE), (cache, DTYPE)]
    shapes += [((tokens,), jnp.int32), ((seqs, max_pages), jnp.int32), ((seqs + 1,), jnp.int32)]
    shapes += [((seqs,), jnp.int32), SCALAR, SCALAR, SCALAR]
    label = f"ragged {model} p{page_size} {tokens}x{seqs}"
    compiled = compile_on(chip, step, shapes, donate=("k_pages", "v_pages"), label=label)

    check_in_place(compiled, 2 * nbytes(cache), chip)
    group = q_heads // KV_HEADS
    q_block = max(default_q_block(tokens, seqs), -(-8 // group))  # the kernel's rule
    items = max_work_items(tokens, seqs, q_block)
    q_vmem = q_block * tile_rows(group) * HEAD_DIM * 2 + 2 * tile_rows(q_block * group) * HEAD_DIM * 2
    vmem = kv_scratch_bytes(page_size, max_pages) + q_vmem  # + the q copy and the pipelined out block
    print(f"  step bytes accessed {bytes_accessed(compiled) / MiB:.1f} MiB, kernel VMEM {vmem / 1024:.0f} KiB")
    assert bytes_accessed(compiled) >= worst_case_kv_bytes(items, max_pages, page_size)
    assert vmem <= VMEM_BUDGET


@pytest.mark.parametrize("topology, page_size", WRITE_CASES, ids=map(write_id, WRITE_CASES))
def test_write_kv_updates_the_donated_cache_in_place(tpu_chip, topology, page_size):
    chip = tpu_chip(topology)
    cache = cache_shape(page_size)
    new = ((PREFILL_TOKENS, KV_HEADS, HEAD_DIM), DTYPE)

    def write(k_pages, v_pages, k_new, v_new, slots, layer):
        return write_kv(k_pages, v_pages, k_new, v_new, slots, layer=layer)

    shapes = [(cache, DTYPE), (cache, DTYPE), new, new, ((PREFILL_TOKENS,), jnp.int32), SCALAR]
    compiled = compile_on(chip, write, shapes, donate=("k_pages", "v_pages"), label=f"write_kv p{page_size}")
    check_in_place(compiled, 2 * nbytes(cache), chip)
    # The write moves the new tokens, not the cache: far less than one layer of it (128 MiB here;
    # the token-window scatter that XLA:TPU relayouts moved 32 GiB).
    print(f"  bytes accessed {bytes_accessed(compiled) / MiB:.1f} MiB")
    assert bytes_accessed(compiled) < nbytes(cache) / LAYERS


@pytest.mark.parametrize("model", list(Q_HEADS))
def test_decode_kernel_cost_is_its_worst_case_kv_reads(tpu_chip, model):
    """The decode kernel alone: cost_analysis() reports the KV bytes it may read (every page-table
    entry of every row, K and V), which dwarf q, the output and the page tables."""
    chip, page_size = tpu_chip(V5E), 16
    q_heads, max_pages, batch, cache = Q_HEADS[model], CONTEXT // page_size, DECODE_BATCH, cache_shape(page_size)
    attention = functools.partial(get_decode_attention("pallas_tpu"), scale=SCALE, interpret=False)

    def decode(q, k_pages, v_pages, page_tables, lengths, layer, window):
        return attention(q, k_pages, v_pages, page_tables, lengths, window=window, layer=layer)

    shapes = [((batch, q_heads, HEAD_DIM), DTYPE), (cache, DTYPE), (cache, DTYPE)]
    shapes += [((batch, max_pages), jnp.int32), ((batch,), jnp.int32), SCALAR, SCALAR]
    compiled = compile_on(chip, decode, shapes, label=f"decode kernel {model} p{page_size}")
    worst = worst_case_kv_bytes(batch, max_pages, page_size)
    print(f"  bytes accessed {bytes_accessed(compiled) / MiB:.1f} MiB, worst-case KV {worst / MiB:.1f} MiB")
    assert bytes_accessed(compiled) == pytest.approx(worst, rel=0.10)
    cost = compiled.cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert flops >= 4 * batch * q_heads * max_pages * page_size * HEAD_DIM  # q.k and p.v over every key


FP8_CASES = [(V5E, "llama3_8b", 16, "float8_e4m3fn"), (V6E, "llama3_70b", 64, "float8_e5m2")]


@pytest.mark.parametrize("topology, model, page_size, cache_dtype", FP8_CASES, ids=lambda x: str(x).split(":")[0])
def test_8bit_cache_steps_compile_in_place_and_read_half(tpu_chip, topology, model, page_size, cache_dtype):
    """--kv-cache-dtype fp8 on a TPU: Mosaic takes the 8-bit pages (DMA'd as bytes, widened to
    bfloat16 in VMEM), the write rounds and scatters into the donated 8-bit cache in place, and the
    decode and ragged kernels' worst-case reads are half those of a bfloat16 cache."""
    chip = tpu_chip(topology)
    cdtype = jnp.dtype(cache_dtype)
    q_heads, max_pages, cache = Q_HEADS[model], CONTEXT // page_size, cache_shape(page_size)
    decode = functools.partial(get_decode_attention("pallas_tpu"), scale=SCALE, interpret=False)
    ragged = functools.partial(get_ragged_attention("pallas_tpu"), scale=SCALE, interpret=False)

    def decode_step(q, k_new, v_new, k_pages, v_pages, slots, page_tables, lengths, layer, window):
        k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, slots, layer=layer)
        return decode(q, k_pages, v_pages, page_tables, lengths, window=window, layer=layer), k_pages, v_pages

    def ragged_step(q, k_new, v_new, k_pages, v_pages, slots, page_tables, cu_q_lens, kv_lens, num_seqs, layer,
                    window):
        k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, slots, layer=layer)
        out = ragged(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, num_seqs, window=window, layer=layer)
        return out, k_pages, v_pages

    for kind, tokens, seqs in (("decode", DECODE_BATCH, DECODE_BATCH), ("ragged", PREFILL_TOKENS, PREFILL_SEQS)):
        accessed, held = {}, {}
        for dtype in (cdtype, DTYPE):  # the same step over a bfloat16 cache, for its bytes
            new = ((tokens, KV_HEADS, HEAD_DIM), DTYPE)
            shapes = [((tokens, q_heads, HEAD_DIM), DTYPE), new, new, (cache, dtype), (cache, dtype)]
            shapes += [((tokens,), jnp.int32), ((seqs, max_pages), jnp.int32)]
            if kind == "decode":
                shapes += [((seqs,), jnp.int32), SCALAR, SCALAR]
            else:
                shapes += [((seqs + 1,), jnp.int32), ((seqs,), jnp.int32), SCALAR, SCALAR, SCALAR]
            step = decode_step if kind == "decode" else ragged_step
            label = f"{kind} {model} p{page_size} {jnp.dtype(dtype).name}"
            compiled = compile_on(chip, step, shapes, donate=("k_pages", "v_pages"), label=label)
            check_in_place(compiled, 2 * nbytes(cache, dtype), chip)
            accessed[jnp.dtype(dtype).name] = bytes_accessed(compiled)
            held[jnp.dtype(dtype).name] = compiled.memory_analysis().argument_size_in_bytes
        # The 8-bit pages are held at a byte a value in HBM (no padding of their tiles to 16-bit sizes).
        assert held[cdtype.name] == pytest.approx(held["bfloat16"] / 2, rel=0.01)
        eight, sixteen = accessed[cdtype.name], accessed["bfloat16"]
        print(f"  step bytes accessed: {eight / MiB:.1f} MiB 8-bit, {sixteen / MiB:.1f} MiB bfloat16")
        # Only the KV reads depend on the cache's dtype: the 8-bit step saves half of them, and
        # they are at least the worst case the shapes allow (every page-table entry, K and V).
        if kind == "decode":
            walks = seqs
        else:
            q_block = max(default_q_block(tokens, seqs), -(-8 // (q_heads // KV_HEADS)))  # the kernel's rule
            walks = max_work_items(tokens, seqs, q_block)
        assert sixteen - eight >= worst_case_kv_bytes(walks, max_pages, page_size) / 2
        if kind == "decode":  # reads are KV: the step reads half
            assert eight == pytest.approx(sixteen / 2, rel=0.01)


def test_compiler_rejects_a_kernel_over_vmem(tpu_chip):
    """The other tests mean something only if compile() here runs Mosaic's checks: a kernel whose
    scratch exceeds the chip's VMEM must fail to compile (if a jax/libtpu update defers kernel
    compilation to load time, this fails and says so)."""
    chip = tpu_chip(V5E)

    def kernel(x_ref, o_ref, scratch):
        scratch[...] = jnp.zeros(scratch.shape, scratch.dtype)
        o_ref[...] = x_ref[...] + scratch[0, :8]

    rows = chip.vmem_bytes // (128 * 4) // 1024 + 1  # [rows, 1024, 128] float32: just over VMEM

    def f(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            scratch_shapes=[pltpu.VMEM((rows, 1024, 128), jnp.float32)],
            interpret=False,
        )(x)

    with pytest.raises(jax.errors.JaxRuntimeError, match="(?i)vmem"):
        compile_on(chip, f, [((8, 128), jnp.float32)], label="over-VMEM kernel")
