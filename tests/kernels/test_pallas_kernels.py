"""The Pallas kernels against the references (and the naive NumPy attention), on the CPU.

GPU kernels run through the generic Pallas interpreter (`interpret=True`); TPU kernels through TPU
interpret mode (`pltpu.InterpretParams`: simulated HBM/VMEM/DMAs/semaphores, out-of-bounds reads
raising, uninitialised memory NaN). The kernels read the engine's layout: the stacked cache
[layers, kv_heads, pages, page_size, head_dim] and a traced layer index, with the other layers
poisoned (NaN below, other finite values above). Shapes are tiny because interpretation is slow;
tolerances are the per-dtype ones of `paged_cases.TOLERANCES`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import (
    DECODE_LENGTHS,
    TOLERANCES,
    decode_case,
    naive_decode,
    naive_ragged,
    ragged_case,
    run_ragged,
    stack_layers,
    with_cache_dtype,
)

from pallas_kernels import (
    get_decode_attention,
    get_ragged_attention,
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)

DECODE_BACKENDS = ["pallas_gpu", "pallas_tpu", "cpu"]  # cpu: the native kernel, not Pallas
NUM_LAYERS = 3


def stacked(cache, layer, seed=0):
    """The case's pages as layer `layer` of a NUM_LAYERS stacked cache (the other layers poisoned)."""
    rng = np.random.default_rng(seed)
    return tuple(stack_layers(p, rng, layer=layer, num_layers=NUM_LAYERS) for p in (cache.k_pages, cache.v_pages))


def check_decode(backend, q, cache, *, windows=(0,), layer=1, **kw):
    kernel = jax.jit(functools.partial(get_decode_attention(backend), **kw))
    reference = jax.jit(functools.partial(paged_decode_attention_reference, scale=kw["scale"], softcap=kw.get("softcap")))
    dtype = str(np.dtype(q.dtype))
    k_all, v_all = stacked(cache, layer)
    args = (q, k_all, v_all, cache.page_tables, cache.kv_lens)
    for window in windows:  # traced, like the layer: one compile for all windows
        out = kernel(*args, window=jnp.int32(window), layer=jnp.int32(layer))
        assert out.dtype == q.dtype and out.shape == q.shape
        out = np.asarray(out, np.float64)
        assert np.isfinite(out).all(), "NaN from an unused page or another layer leaked into the result"
        ref = np.asarray(reference(*args, window=jnp.int32(window), layer=jnp.int32(layer)), np.float64)
        np.testing.assert_allclose(out, ref, **TOLERANCES[dtype])
        naive = naive_decode(q.astype(np.float64), cache, scale=kw["scale"], softcap=kw.get("softcap"), window=window)
        np.testing.assert_allclose(out, naive, **TOLERANCES[dtype])
        np.testing.assert_array_equal(out[np.asarray(cache.kv_lens) == 0], 0.0)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_kernel_gqa_and_window(backend, group):
    q, cache = decode_case(group, group=group, dtype="float32")
    check_decode(backend, q, cache, scale=0.25, windows=(0, 3), layer=group % NUM_LAYERS)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_decode_kernel_bf16_softcap(backend):
    q, cache = decode_case(21, group=4, dtype="bfloat16", head_dim=32)
    check_decode(backend, q, cache, scale=32**-0.5, softcap=2.0, windows=(0, 6))


@pytest.mark.parametrize(
    "backend,options",
    [
        ("pallas_gpu", dict(pages_per_block=1, num_splits=1)),
        ("pallas_gpu", dict(pages_per_block=1, num_splits=4)),
        ("pallas_gpu", dict(pages_per_block=4, num_splits=2)),
        ("pallas_gpu", dict(pages_per_block=1, num_splits=3)),  # not a power of two: XLA merges them
        ("pallas_tpu", dict(pages_per_block=1)),
        ("pallas_tpu", dict(pages_per_block=3)),
    ],
)
def test_decode_kernel_block_and_split_options(backend, options):
    """Blocks of pages and flash-decoding splits of every size give the same answer (merged by the
    merge kernel, or by XLA where its blocks would not be powers of two)."""
    q, cache = decode_case(5, group=2, dtype="float32")
    check_decode(backend, q, cache, scale=0.3, windows=(5,), **options)


def check_ragged(backend, batch, *, windows=(0,), layer=1, **kw):
    kernel = get_ragged_attention(backend)
    dtype = str(np.dtype(batch.q.dtype))
    pages = stacked(batch.cache, layer)
    for window in windows:
        out = np.asarray(run_ragged(batch, kernel, stacked=pages, layer=layer, window=jnp.int32(window), **kw))
        out = out.astype(np.float64)
        assert out.shape == batch.q.shape
        assert np.isfinite(out).all(), "NaN from an unused page, another layer or a padding row leaked"
        ref_kw = dict(scale=kw["scale"], softcap=kw.get("softcap"), window=jnp.int32(window))
        ref = run_ragged(batch, ragged_paged_attention_reference, stacked=pages, layer=layer, **ref_kw)
        ref = np.asarray(ref, np.float64)
        np.testing.assert_allclose(out, ref, **TOLERANCES[dtype])
        naive = naive_ragged(batch, scale=kw["scale"], softcap=kw.get("softcap"), window=window)
        np.testing.assert_allclose(out, naive, **TOLERANCES[dtype])
        np.testing.assert_array_equal(out[batch.cu_q_lens[batch.num_seqs] :], 0.0)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("group,window", [(1, 3), (4, 0), (8, 5)])
def test_ragged_kernel_gqa_and_window(backend, group, window):
    batch = ragged_case(group + 40, group=group, dtype="float32", total_tokens=24)
    check_ragged(backend, batch, scale=0.25, windows=(window,), layer=group % NUM_LAYERS)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_ragged_kernel_bf16_softcap(backend):
    batch = ragged_case(47, group=4, dtype="bfloat16", total_tokens=24, head_dim=32)
    check_ragged(backend, batch, scale=32**-0.5, softcap=2.0, windows=(6,))


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
def test_ragged_kernel_small_q_block_and_pages(backend):
    """Many items per sequence, one page per block: crosses every item and page edge."""
    batch = ragged_case(48, group=2, dtype="float32", total_tokens=24)
    check_ragged(backend, batch, scale=0.3, windows=(5,), q_block=2, pages_per_block=1)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("cache_dtype, q_dtype", [("fp8_e4m3", "bfloat16"), ("fp8_e5m2", "float32")])
def test_kernels_read_an_8bit_cache(backend, cache_dtype, q_dtype):
    """An 8-bit cache (--kv-cache-dtype fp8*): the kernels widen the stored values exactly, so they
    agree with the reference and the float64 attention over the same rounded keys and values at the
    query dtype's usual tolerance; NaN in unwritten slots and other layers still never leaks."""
    q, cache = decode_case(31, group=4, dtype=q_dtype, head_dim=32)
    check_decode(backend, q, with_cache_dtype(cache, cache_dtype), scale=32**-0.5, softcap=2.0, windows=(6,))
    batch = ragged_case(33, group=2, dtype=q_dtype, total_tokens=24, head_dim=32)
    batch = dataclasses.replace(batch, cache=with_cache_dtype(batch.cache, cache_dtype))
    check_ragged(backend, batch, scale=32**-0.5, windows=(5,))


@pytest.mark.parametrize("dot_dtype", ["bfloat16", "float16"])
def test_gpu_decode_kernel_dots_an_8bit_cache_in_either_16bit_type(dot_dtype):
    """An 8-bit cache's keys, values and bfloat16 queries widened to float16 (the default) or
    bfloat16 for the dots give the reference's result at bfloat16's tolerance, in q's dtype, with
    nothing leaking from unwritten slots or other layers."""
    q, cache = decode_case(31, group=4, dtype="bfloat16", head_dim=32)
    check_decode("pallas_gpu", q, with_cache_dtype(cache, "fp8_e4m3"), scale=32**-0.5, softcap=2.0,
                 windows=(0, 6), dot_dtype=dot_dtype)


def test_gpu_kernels_dot_an_fp8_cache_in_float16_and_saturate_large_queries():
    """The default dot dtype: float16 for an 8-bit float cache under bfloat16 queries (Hopper widens
    e4m3 to float16 in one instruction per two values, to bfloat16 only through it), q's own
    otherwise. A query component past float16's range saturates instead of turning the row's
    softmax into NaN: the decode kernel stays finite and equals the reference given that component
    clipped (the ragged kernel converts q with the same `to_dot_dtype`)."""
    from pallas_kernels.gpu_paged_attention import F16_MAX, resolve_dot_dtype, to_dot_dtype

    bf16, f16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
    assert resolve_dot_dtype(bf16, jnp.float8_e4m3fn) == f16
    assert resolve_dot_dtype(bf16, jnp.float8_e5m2) == f16
    assert resolve_dot_dtype(bf16, bf16) == bf16
    assert resolve_dot_dtype(jnp.float32, jnp.float8_e4m3fn) == jnp.float32
    assert resolve_dot_dtype(bf16, jnp.float8_e4m3fn, "bfloat16") == bf16
    x = jnp.array([1e5, -1e6, 3.0, jnp.inf], jnp.bfloat16)
    assert to_dot_dtype(x, f16).tolist() == [F16_MAX, -F16_MAX, 3.0, F16_MAX]

    q, cache = decode_case(35, group=4, dtype="bfloat16", head_dim=32)
    q = np.asarray(q).copy()
    q[-1, 0, 0] = 2e5  # one component of the longest sequence's first head, past float16's 65504
    clipped = np.clip(q.astype(np.float32), -F16_MAX, F16_MAX).astype(q.dtype)
    fp8 = with_cache_dtype(cache, "fp8_e4m3")
    got = np.asarray(get_decode_attention("pallas_gpu")(q, fp8.k_pages, fp8.v_pages, fp8.page_tables, fp8.kv_lens,
                                                         scale=32**-0.5), np.float32)
    want = np.asarray(get_decode_attention("reference")(clipped, fp8.k_pages, fp8.v_pages, fp8.page_tables,
                                                        fp8.kv_lens, scale=32**-0.5), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


def test_tpu_interpret_mode_raises_on_out_of_bounds_page_or_layer():
    """The TPU kernel's DMAs are bounds-checked in interpret mode: a bad page id or a bad (traced,
    so unvalidated) layer index cannot go unnoticed."""
    from jax.experimental.pallas import tpu as pltpu

    q, cache = decode_case(9, group=1, dtype="float32", lengths=[6, 2])
    k_all, v_all = stacked(cache, 2)
    kernel = jax.jit(functools.partial(get_decode_attention("pallas_tpu"), scale=1.0))
    page_tables = cache.page_tables.copy()
    page_tables[0, 1] = cache.k_pages.shape[1] + 3  # sequence 0's second page holds tokens 4 and 5
    try:
        for tables, layer in ((page_tables, 2), (cache.page_tables, NUM_LAYERS)):
            with pytest.raises(Exception, match="[Oo]ut-of-bounds"):
                np.asarray(kernel(q, k_all, v_all, tables, cache.kv_lens, layer=jnp.int32(layer)))
            pltpu.reset_tpu_interpret_mode_state()
    finally:
        pltpu.reset_tpu_interpret_mode_state()


def production_shape_args() -> tuple[list[jax.ShapeDtypeStruct], list[jax.ShapeDtypeStruct]]:
    """Abstract (decode, ragged) kernel arguments at production shapes: 8 sequences, 32 query heads,
    8 kv heads, head_dim 128, bf16, and the engine's stacked cache of 32 layers with a page count
    that is no power of two and a size over 4 GiB (64-bit offsets in the Triton lowering)."""
    S = jax.ShapeDtypeStruct
    b, h, kv, d, layers, pages, page, per_seq, tokens = 8, 32, 8, 128, 32, 4099, 16, 32, 256
    decode_args = [
        S((b, h, d), jnp.bfloat16),
        S((layers, kv, pages, page, d), jnp.bfloat16),
        S((layers, kv, pages, page, d), jnp.bfloat16),
        S((b, per_seq), jnp.int32),
        S((b,), jnp.int32),
    ]
    ragged_args = [S((tokens, h, d), jnp.bfloat16), *decode_args[1:4], S((b + 1,), jnp.int32), S((b,), jnp.int32)]
    ragged_args.append(S((), jnp.int32))
    return decode_args, ragged_args


# window and layer, traced as in the engine's layer scan
TRACED = dict(window=jax.ShapeDtypeStruct((), jnp.int32), layer=jax.ShapeDtypeStruct((), jnp.int32))


def test_gpu_kernels_lower_to_triton_for_h100():
    """Without a GPU, check that both GPU kernels at production shapes get through the Pallas Triton
    lowering (what interpret mode cannot check: supported ops, block shapes). Triton's own
    compilation to PTX still needs a GPU."""
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration
    except ImportError:  # private API moved: nothing to check here
        pytest.skip("jax's Pallas Triton internals moved")
    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    from pallas_kernels.gpu_paged_attention import paged_decode_attention_gpu
    from pallas_kernels.gpu_ragged_attention import ragged_paged_attention_gpu

    decode_args, ragged_args = production_shape_args()
    # Both kernels over an 8-bit cache too, widened to float16 for their dots (resolve_dot_dtype).
    fp8 = [decode_args[0], *(jax.ShapeDtypeStruct(a.shape, jnp.float8_e4m3fn) for a in decode_args[1:3]),
           *decode_args[3:]]
    ragged_fp8 = [ragged_args[0], *fp8[1:4], *ragged_args[4:]]
    original = pallas_call_registration.gpu_info_lib.get_gpu_info
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h100
    try:
        for fn, args, kw in ((paged_decode_attention_gpu, decode_args, {}), (ragged_paged_attention_gpu, ragged_args, {}),
                             (paged_decode_attention_gpu, fp8, {}), (ragged_paged_attention_gpu, ragged_fp8, {})):
            f = jax.jit(functools.partial(fn, scale=0.1, softcap=50.0, interpret=False, **kw))
            with warnings.catch_warnings():  # the Triton lowering's deprecation notice
                warnings.simplefilter("ignore")
                text = f.trace(*args, **TRACED).lower(lowering_platforms=("cuda",)).as_text()
            assert "xla.gpu.triton" in text
    finally:
        pallas_call_registration.gpu_info_lib.get_gpu_info = original


def test_tpu_kernels_lower_to_mosaic_for_v5e():
    """Without a TPU, check that both TPU kernels at production shapes get through the Pallas Mosaic
    lowering (supported ops, block shapes, DMA and semaphore use). Mosaic's own compilation (layouts,
    VMEM limits) still needs a TPU."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    from pallas_kernels.tpu_paged_attention import paged_decode_attention_tpu
    from pallas_kernels.tpu_ragged_attention import ragged_paged_attention_tpu

    decode_args, ragged_args = production_shape_args()
    device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    for fn, args in ((paged_decode_attention_tpu, decode_args), (ragged_paged_attention_tpu, ragged_args)):
        f = jax.jit(functools.partial(fn, scale=0.1, softcap=50.0, interpret=False))
        with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
            text = f.trace(*args, **TRACED).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text


def test_dispatch_returns_kernels_with_the_reference_signature():
    q, cache = decode_case(3, group=2, dtype="float32", lengths=DECODE_LENGTHS[:3])
    outs = [
        np.asarray(
            get_decode_attention(backend)(
                q, cache.k_pages, cache.v_pages, cache.page_tables, cache.kv_lens, scale=0.5, window=0
            )
        )
        for backend in ("reference", "pallas_gpu", "pallas_tpu", "cpu")
    ]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], **TOLERANCES["float32"])
