"""The GPU Pallas kernels lower for the real `cuda` platform, on a machine with no GPU (CI).

The kernel tests in tests/kernels run the GPU kernels in the Pallas interpreter, which never runs
their Triton lowering. Here they are lowered for cuda, as an H100 would compile them, from the CPU:

    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=H100)):
        jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=("cuda",))

`lowering_platforms` (or `jax.export.export(..., platforms=("cuda",))`) alone is not enough: the
Pallas Triton lowering asks for the target's compute capability (`gpu_info.get_gpu_info()` in
jax/_src/pallas/triton/pallas_call_registration.py) and, with no GPU and no abstract device, raises
"No supported GPU devices found, please specify an abstract GPU device using AbstractDevice". An
`AbstractDevice` whose kind names an H100 answers it (sm_90). No jax-cuda plugin is needed: jaxlib
bundles the Triton dialect. The kernels are called with `interpret=False`: their default is the
interpreter whenever `jax.default_backend()` is not a GPU, which on a CPU host lowers to plain HLO
(no Triton call) even for cuda.

What this checks: every op of each kernel has a Triton lowering and its block shapes are legal
(powers of two, dots >= 16 rows); each kernel is exactly one `__gpu$xla.gpu.triton` custom call with
the expected launch grid; the stacked cache reaches the kernel whole (no gather, slice or copy of it
in XLA, so no fallback to the reference); the dots run in bf16 with float32 accumulation; the cache
is addressed with 64-bit offsets (it is over 4 GiB). Where the `triton` package is installed (torch
brings it), the kernels' Triton IR is also compiled to a cubin for sm_90 with that package's own
NVIDIA pipeline and ptxas, all on the CPU, to check shared memory and registers. That pipeline is a
proxy: XLA compiles the custom call with its own bundled Triton, in the CUDA plugin's backend;
tests/gpu_aot runs that compile too, without a GPU, for the engine's whole decode steps.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels import get_decode_attention, get_ragged_attention, write_kv
from pallas_kernels.gpu_paged_attention import default_splits, pages_per_block_for
from pallas_kernels.gpu_ragged_attention import MAX_ROWS, _next_pow2, gpu_q_block
from pallas_kernels.ragged_paged_attention import max_work_items

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

TRITON_TARGET = "__gpu$xla.gpu.triton"
H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
H100_SMS = 132
H100_MAX_SHARED_BYTES = 227 * 1024  # per block, opt-in
MAX_CONTEXT = 8192  # tokens: max_pages_per_seq = MAX_CONTEXT // page_size
CACHE_TOKENS = 131072  # pages of the cache: CACHE_TOKENS // page_size (8 GiB per K for Llama-3-8B)


class Model(NamedTuple):
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int


MODELS = {"llama3-8b": Model(32, 32, 8, 128), "llama3-70b": Model(80, 64, 8, 128)}
# Other head shapes for the register check: SmolLM2-135M (head_dim 64, 3 q heads per kv head) and
# Gemma2-9B (head_dim 256, 2 q heads per kv head), two layers of each.
HEAD_SHAPES = {"smollm2": Model(2, 9, 3, 64), "gemma2-9b": Model(2, 16, 8, 256)}
S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def cache_struct(model: Model, page_size: int, dtype: Any = BF16) -> S:
    # [num_layers, num_kv_heads, num_pages, page_size, head_dim]: the engine's stacked cache
    return S((model.num_layers, model.kv_heads, CACHE_TOKENS // page_size, page_size, model.head_dim), dtype)


def lower_for_cuda(f, *args: S, donate_argnums: tuple[int, ...] = ()) -> jax.stages.Lowered:
    with use_abstract_mesh(AbstractMesh((), (), abstract_device=H100)):
        return jax.jit(f, donate_argnums=donate_argnums).trace(*args).lower(lowering_platforms=("cuda",))


def walk(op: Any) -> Iterator[Any]:
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child.operation
                yield from walk(child.operation)


def main_func(lowered: jax.stages.Lowered):
    module = lowered.compiler_ir("stablehlo")
    funcs = (op for op in walk(module.operation) if op.name == "func.func")
    return next(op for op in funcs if str(op.attributes["sym_name"]) == '"main"')


class KernelCall(NamedTuple):
    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    ttir: str  # the kernel's Triton IR, as text


def custom_calls(lowered: jax.stages.Lowered) -> list[Any]:
    return [op for op in walk(lowered.compiler_ir("stablehlo").operation) if op.name == "stablehlo.custom_call"]


def triton_calls(lowered: jax.stages.Lowered) -> list[KernelCall]:
    """The Pallas Triton kernels of a lowered module; fails on any other custom call."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context  # the Triton dialect's context (private)

    calls = []
    for op in custom_calls(lowered):
        assert str(op.attributes["call_target_name"]) == f'"{TRITON_TARGET}"', op.attributes["call_target_name"]
        config = op.attributes["mhlo.backend_config"]
        with _new_ir_context():
            ttir = str(ir.Module.parse(config["ir"].value_bytes))
        as_int = lambda key: ir.IntegerAttr(config[key]).value  # noqa: E731
        calls.append(
            KernelCall(
                name=ir.StringAttr(config["name"]).value,
                grid=(as_int("grid_x"), as_int("grid_y"), as_int("grid_z")),
                num_warps=as_int("num_warps"),
                num_stages=as_int("num_stages"),
                ttir=ttir,
            )
        )
    return calls


def check_cache_goes_whole_to_the_kernel(lowered: jax.stages.Lowered, arg_indices: tuple[int, ...]) -> None:
    """The stacked cache's only users are the kernel's custom call: XLA neither gathers pages (the
    reference's way) nor slices a layer out (a copy of the whole layer per call)."""
    main = main_func(lowered)
    args = main.regions[0].blocks[0].arguments
    for i in arg_indices:
        users = [use.owner.name for use in args[i].uses]
        only_kernel = users and all(u == "stablehlo.custom_call" for u in users)
        assert only_kernel, f"cache argument {i} is read by {users}, not only by the kernel"


def check_ttir(call: KernelCall, cache_type: str = "bf16", dot_type: str = "bf16") -> None:
    tensor = r"tensor<(\d+)x(\d+)x(\w+)>"
    dots = re.findall(rf"tt\.dot .*: {tensor} \* {tensor} -> {tensor}", call.ttir)
    assert len(dots) == 2, f"{call.name}: expected q.k and p.v, got {dots}"
    for m, k, a_type, k2, n, b_type, m2, n2, acc_type in dots:
        types = (a_type, b_type, acc_type)
        assert types == (dot_type, dot_type, "f32"), f"{call.name}: dot {a_type} x {b_type} -> {acc_type}"
        assert min(map(int, (m, k, n))) >= 16, f"{call.name}: a {m}x{k}x{n} dot is below Triton's 16"
    # The cache is over 4 GiB: its loads must use 64-bit offsets (32-bit ones would wrap around).
    cache_ptrs = re.findall(rf"tt\.addptr .*: tensor<[\dx]+!tt\.ptr<{cache_type}>>, tensor<[\dx]+(i\d+)>", call.ttir)
    assert "i64" in cache_ptrs, f"{call.name}: no 64-bit pointer offsets for the cache loads: {cache_ptrs}"


# --- decode --------------------------------------------------------------------------------------


def decode_args(model: Model, page_size: int, batch: int, cache_dtype: Any = BF16) -> tuple[S, ...]:
    max_pages = MAX_CONTEXT // page_size
    cache = cache_struct(model, page_size, cache_dtype)
    return (
        S((batch, model.q_heads, model.head_dim), BF16),  # q
        cache,  # k_pages
        cache,  # v_pages
        S((batch, max_pages), jnp.int32),  # page_tables
        S((batch,), jnp.int32),  # lengths
        S((), jnp.int32),  # layer (traced, as in the engine's layer scan)
    )


def decode_fn(model: Model, **options):
    kernel = get_decode_attention("pallas_gpu")

    def decode(q, k_pages, v_pages, page_tables, lengths, layer):
        return kernel(q, k_pages, v_pages, page_tables, lengths, scale=model.head_dim**-0.5, layer=layer,
                      interpret=False, **options)

    return decode


def expected_decode_splits(model: Model, page_size: int, batch: int) -> int:
    max_pages = MAX_CONTEXT // page_size
    num_blocks = -(-max_pages // pages_per_block_for(None, page_size, max_pages))
    return max(1, min(default_splits(batch, model.kv_heads, num_blocks), num_blocks))


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_decode_kernel_lowers_for_cuda(model_name, page_size, batch):
    model = MODELS[model_name]
    lowered = lower_for_cuda(decode_fn(model), *decode_args(model, page_size, batch))
    splits = expected_decode_splits(model, page_size, batch)
    # With splits, a second kernel merges them (one program per query head): XLA's merge is three.
    assert lowered.as_text().count(TRITON_TARGET) == 1 + (splits > 1)
    call, *combine = triton_calls(lowered)
    assert call.name == "jaxserve_paged_decode"
    assert call.grid == (batch, model.kv_heads, splits)
    # Batch 1 splits the context so the launch still fills every SM of the H100.
    assert batch * model.kv_heads * splits >= H100_SMS
    assert (call.num_warps, call.num_stages) == (4, 2)
    check_cache_goes_whole_to_the_kernel(lowered, (1, 2))
    check_ttir(call)
    if combine:
        assert combine[0].name == "jaxserve_combine_splits"
        assert combine[0].grid == (batch * model.q_heads, 1, 1)
        assert "tt.dot" not in combine[0].ttir


# --- ragged (prefill) ----------------------------------------------------------------------------

PREFILL_TOKENS, PREFILL_SEQS = 2048, 8


def ragged_args(model: Model, page_size: int, cache_dtype: Any = BF16) -> tuple[S, ...]:
    max_pages = MAX_CONTEXT // page_size
    cache = cache_struct(model, page_size, cache_dtype)
    return (
        S((PREFILL_TOKENS, model.q_heads, model.head_dim), BF16),  # q
        cache,  # k_pages
        cache,  # v_pages
        S((PREFILL_SEQS, max_pages), jnp.int32),  # page_tables
        S((PREFILL_SEQS + 1,), jnp.int32),  # cu_q_lens
        S((PREFILL_SEQS,), jnp.int32),  # kv_lens
        S((), jnp.int32),  # num_seqs
        S((), jnp.int32),  # layer
    )


def ragged_fn(model: Model, **options):
    kernel = get_ragged_attention("pallas_gpu")

    def ragged(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, num_seqs, layer):
        return kernel(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, num_seqs, scale=model.head_dim**-0.5,
                      layer=layer, interpret=False, **options)

    return ragged


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_ragged_kernel_lowers_for_cuda(model_name, page_size):
    model = MODELS[model_name]
    lowered = lower_for_cuda(ragged_fn(model), *ragged_args(model, page_size))
    assert lowered.as_text().count(TRITON_TARGET) == 1
    [call] = triton_calls(lowered)
    assert call.name == "jaxserve_ragged_paged_attention"
    heads = _next_pow2(model.q_heads // model.kv_heads)
    q_block = _next_pow2(gpu_q_block(PREFILL_TOKENS, PREFILL_SEQS, heads, model.head_dim))
    assert call.grid == (max_work_items(PREFILL_TOKENS, PREFILL_SEQS, q_block), model.kv_heads, 1)
    assert q_block * heads == MAX_ROWS and call.num_warps == 8  # 128 rows on two warpgroups
    check_cache_goes_whole_to_the_kernel(lowered, (1, 2))
    check_ttir(call)


def twice_the_pages(args: tuple[S, ...]) -> tuple[S, ...]:
    """Kernel arguments with a cache (arguments 1 and 2) of twice the pages: 8 GiB at a byte a value."""
    shape = list(args[1].shape)
    shape[2] *= 2
    cache = S(tuple(shape), args[1].dtype)
    return (args[0], cache, cache, *args[3:])


@pytest.mark.parametrize("cache_dtype, ttir_type", [(jnp.float8_e4m3fn, "f8E4M3FN"), (jnp.float8_e5m2, "f8E5M2")])
def test_kernels_lower_for_cuda_over_an_8bit_cache(cache_dtype, ttir_type):
    """--kv-cache-dtype fp8: both kernels load the 8-bit pages themselves (half the bytes; no
    widened copy of the cache in XLA) and widen them in registers to float16, bfloat16 queries
    included (`resolve_dot_dtype`: one conversion per two values on Hopper), so their dots are
    f16 x f16 with float32 accumulation. The cache is 8 GiB per K, as for bfloat16: 64-bit offsets."""
    model = MODELS["llama3-8b"]
    for fn, args in ((decode_fn(model), decode_args(model, 16, 64, cache_dtype)),
                     (ragged_fn(model), ragged_args(model, 16, cache_dtype))):
        lowered = lower_for_cuda(fn, *twice_the_pages(args))
        [call] = triton_calls(lowered)
        check_cache_goes_whole_to_the_kernel(lowered, (1, 2))
        check_ttir(call, cache_type=ttir_type, dot_type="f16")


def test_an_8bit_cache_of_2_to_4_gib_gets_wrapping_offsets():
    """Why the engine keeps an 8-bit cache's K and V arrays out of (2, 4] GiB on GPUs
    (`kv_cache.triton_safe_pages`): the Triton lowering switches to 64-bit element offsets only
    above 2**32 bytes, so a 1-byte array of exactly 4 GiB (2**32 elements) gets 32-bit ones, which
    wrap past 2**31. If a jax update changes the rule, this fails: drop the workaround then."""
    from jaxserve.engine.kv_cache import TRITON_OFFSET_WRAP

    model = MODELS["llama3-8b"]
    args = decode_args(model, 16, 64, jnp.float8_e4m3fn)
    assert args[1].size == TRITON_OFFSET_WRAP[1]  # 4 GiB of 1-byte values
    [call] = triton_calls(lower_for_cuda(decode_fn(model), *args))
    offsets = re.findall(r"tt\.addptr .*: tensor<[\dx]+!tt\.ptr<f8E4M3FN>>, tensor<[\dx]+(i\d+)>", call.ttir)
    assert offsets and set(offsets) == {"i32"}, offsets


# --- a step: matmul, cache write, attention, donated cache ----------------------------------------


def test_step_lowers_for_cuda_with_the_cache_donated():
    """A decode step shaped like the engine's: a layer scan whose body projects q/k/v (matmul),
    scatters k/v into the donated stacked cache and attends with the decode kernel."""
    model, page_size, batch, d_model = MODELS["llama3-8b"], 16, 64, 4096
    kernel = decode_fn(model)
    q_width, kv_width = model.q_heads * model.head_dim, model.kv_heads * model.head_dim

    def step(x, w_qkv, k_pages, v_pages, page_tables, lengths, slots):
        def layer_body(h, layer):
            h, k_pages, v_pages = h
            qkv = h @ w_qkv[layer]
            q = qkv[:, :q_width].reshape(batch, model.q_heads, model.head_dim)
            k = qkv[:, q_width : q_width + kv_width].reshape(batch, model.kv_heads, model.head_dim)
            v = qkv[:, q_width + kv_width :].reshape(batch, model.kv_heads, model.head_dim)
            k_pages, v_pages = write_kv(k_pages, v_pages, k, v, slots, layer=layer)
            out = kernel(q, k_pages, v_pages, page_tables, lengths, layer)
            return (out.reshape(batch, d_model), k_pages, v_pages), None

        layers = jnp.arange(model.num_layers, dtype=jnp.int32)
        (x, k_pages, v_pages), _ = jax.lax.scan(layer_body, (x, k_pages, v_pages), layers)
        return x, k_pages, v_pages

    cache = cache_struct(model, page_size)
    args = (
        S((batch, d_model), BF16),
        S((model.num_layers, d_model, q_width + 2 * kv_width), BF16),
        cache,
        cache,
        S((batch, MAX_CONTEXT // page_size), jnp.int32),
        S((batch,), jnp.int32),
        S((batch,), jnp.int32),
    )
    lowered = lower_for_cuda(step, *args, donate_argnums=(2, 3))
    text = lowered.as_text()
    assert text.count(TRITON_TARGET) == 1  # once in the scan body: one launch per layer
    assert "stablehlo.dot_general" in text and "stablehlo.scatter" in text and "stablehlo.while" in text
    # The donated caches alias the step's cache outputs (results 1 and 2): updated in place.
    args_attrs = main_func(lowered).attributes["arg_attrs"]
    aliasing = {i: str(args_attrs[i]) for i in range(len(args))}
    assert "tf.aliasing_output = 1" in aliasing[2] and "tf.aliasing_output = 2" in aliasing[3], aliasing
    assert not any("aliasing_output" in aliasing[i] for i in (0, 1, 4, 5, 6)), aliasing

    # jax.export takes the same route; the Triton call has no compatibility guarantee, so say so.
    with use_abstract_mesh(AbstractMesh((), (), abstract_device=H100)):
        exported = jax.export.export(
            jax.jit(step, donate_argnums=(2, 3)),
            platforms=("cuda",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)],
        )(*args)
    assert exported.platforms == ("cuda",)
    module = exported.mlir_module()
    assert module.count(TRITON_TARGET) == 1 and module.count("tf.aliasing_output") == 2


# --- the mixture-of-experts grouped matmul ---

# Qwen3-30B-A3B's experts: 128 of [2048 -> 768] (gate, up) and [768 -> 2048] (down); rows are
# tokens x 8 routed experts (a decode step at batch 8 and a 2048-token prefill).
MOE_SHAPES = {"gate-decode": (64, 128, 2048, 768), "down-decode": (64, 128, 768, 2048),
              "gate-prefill": (16384, 128, 2048, 768)}


def grouped_args(rows: int, experts: int, k: int, n: int) -> tuple[S, ...]:
    return S((rows, k), BF16), S((experts,), jnp.int32), S((experts, k, n), BF16)


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_grouped_matmul_lowers_for_cuda_as_one_kernel(shape):
    """The model's grouped product on CUDA is the Triton kernel: one launch over (tiles, column
    blocks), its dots bf16 with float32 accumulation; no ragged dot is left for XLA:GPU to rewrite
    as a dense product over every expert. TPUs keep XLA's ragged dot."""
    from jaxserve.models.moe import grouped_matmul
    from pallas_kernels.gpu_grouped_matmul import block_rows_for

    rows, experts, k, n = MOE_SHAPES[shape]
    lowered = lower_for_cuda(grouped_matmul, *grouped_args(rows, experts, k, n))
    (call,) = triton_calls(lowered)
    tiles = -(-rows // block_rows_for(rows, experts)) + min(experts, rows)
    assert call.name == "jaxserve_grouped_matmul" and call.grid == (tiles, n // 128, 1)
    assert re.search(r"tt\.dot .*bf16.* -> tensor<\d+x\d+xf32>", call.ttir), call.ttir[-2000:]
    assert "ragged_dot" not in lowered.as_text()
    with use_abstract_mesh(AbstractMesh((), (), abstract_device=H100)):
        tpu = jax.jit(grouped_matmul).trace(*grouped_args(rows, experts, k, n)).lower(lowering_platforms=("tpu",))
    assert "ragged_dot" in tpu.as_text()


# --- the Triton IR compiled for sm_90 on the CPU (triton package's pipeline: a proxy for XLA's) ---

COMPILE_CASES = {
    "decode-split-llama3-8b": lambda: (decode_fn(MODELS["llama3-8b"]), decode_args(MODELS["llama3-8b"], 16, 1)),
    "decode-llama3-8b": lambda: (decode_fn(MODELS["llama3-8b"]), decode_args(MODELS["llama3-8b"], 16, 64)),
    "ragged-llama3-8b": lambda: (ragged_fn(MODELS["llama3-8b"]), ragged_args(MODELS["llama3-8b"], 16)),
    "ragged-llama3-70b": lambda: (ragged_fn(MODELS["llama3-70b"]), ragged_args(MODELS["llama3-70b"], 16)),
    "decode-fp8-llama3-8b": lambda: (decode_fn(MODELS["llama3-8b"]),
                                     twice_the_pages(decode_args(MODELS["llama3-8b"], 16, 64, jnp.float8_e4m3fn))),
    **{f"ragged-{name}": (lambda m=m: (ragged_fn(m), ragged_args(m, 16))) for name, m in HEAD_SHAPES.items()},
    **{f"grouped-{name}": (lambda shape=shape: (_grouped_fn(), grouped_args(*shape)))
       for name, shape in MOE_SHAPES.items()},
}


def _grouped_fn():
    from pallas_kernels.gpu_grouped_matmul import grouped_matmul_gpu

    return functools.partial(grouped_matmul_gpu, interpret=False)


@pytest.fixture(scope="module")
def triton_for_sm90(tmp_path_factory):
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    saved = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_DEFAULT_FP_FUSION")}
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"  # its current default, set to silence its warning
    yield triton
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def resource_usage(triton, cubin: bytes, tmp_path) -> dict[str, int] | None:
    """REG, STACK (spills), SHARED, LOCAL of a cubin, from the cuobjdump that ships with triton."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cuobjdump = cuobjdump if os.path.exists(cuobjdump) else shutil.which("cuobjdump")
    if cuobjdump is None:
        return None
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([cuobjdump, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def compile_for_sm90(triton, call: KernelCall, tmp_path, tag: str = "") -> Any:
    """A kernel's Triton IR compiled for sm_90 by the triton package (skips on a version skew)."""
    from triton.backends.compiler import GPUTarget

    source = tmp_path / f"{call.name}{tag}.ttir"
    source.write_text(call.ttir)
    try:
        return triton.compile(str(source), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=call.num_warps, num_stages=call.num_stages))
    except RuntimeError as e:
        if "Parse MLIR" in str(e):  # version skew between jaxlib's Triton dialect and the package
            pytest.skip(f"triton {triton.__version__} cannot parse jaxlib's Triton IR: {e}")
        raise


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_kernel_compiles_for_sm90(case, triton_for_sm90, tmp_path):
    triton = triton_for_sm90
    f, args = COMPILE_CASES[case]()
    for call in triton_calls(lower_for_cuda(f, *args)):  # a split decode: the kernel and the merge
        compiled = compile_for_sm90(triton, call, tmp_path)
        shared = compiled.metadata.shared
        assert shared <= H100_MAX_SHARED_BYTES, f"{case}: {shared} bytes of shared memory"
        usage = resource_usage(triton, compiled.asm["cubin"], tmp_path)
        if usage is None:
            continue
        # A spill is local-memory traffic inside the key loop: with 4 warps the ragged kernel's
        # 128-row tile spilled 160-1,500 bytes a thread at every head shape here.
        assert usage["REG"] <= 255 and usage["LOCAL"] == 0 and usage["STACK"] == 0, (case, call.name, usage)


def test_float16_dots_take_the_bfloat16_widening_out_of_the_fp8_kernel(triton_for_sm90, tmp_path):
    """The fp8 cache's default float16 dots (`resolve_dot_dtype`, benchmarks/RESULTS.md): on sm_90
    Triton widens e4m3 to float16 two values per instruction (`cvt.rn.f16x2.e4m3x2`); bfloat16
    dots convert every value once more (`cvt.bf16.f16`, an F2F in SASS), and the default needs
    none of those."""
    model = MODELS["llama3-8b"]
    args = twice_the_pages(decode_args(model, 16, 64, jnp.float8_e4m3fn))
    ptx = {}
    for name, options in (("bfloat16", {"dot_dtype": jnp.bfloat16}), ("float16", {})):
        [call] = triton_calls(lower_for_cuda(decode_fn(model, **options), *args))
        ptx[name] = compile_for_sm90(triton_for_sm90, call, tmp_path, f"-{name}").asm["ptx"]
    widen = lambda text: len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", text))  # noqa: E731
    to_bf16 = lambda text: len(re.findall(r"cvt\.bf16\.f16", text))  # noqa: E731
    assert widen(ptx["bfloat16"]) == widen(ptx["float16"]) > 0
    assert to_bf16(ptx["bfloat16"]) == 2 * widen(ptx["bfloat16"])  # one per value
    assert to_bf16(ptx["float16"]) == 0
