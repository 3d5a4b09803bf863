"""--matmul-backend: how it resolves, and the decoder and the engine with their products on the
native CPU kernel (backend "cpu") instead of XLA's dot."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine, compile_engine
from jaxserve.engine.core import Engine, run_to_completion
from jaxserve.engine.request import SamplingParams
from jaxserve.models import products
from jaxserve.models.reference import forward_logits
from jaxserve.weights import load_model
from pallas_kernels import cpu_matmul
from smollm2 import smollm2_gguf
from tiny_models import make_tiny_model

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(),
                                  reason=f"needs a C++ compiler and a CPU with {cpu_matmul.NEEDS}")


def test_resolve_backend():
    assert products.resolve_backend("xla", jnp.bfloat16, "cpu") == "xla"
    assert "packed in strips" in products.describe_backend("cpu")
    # The kernel computes bfloat16 only, on the CPU only, and has no sharding rule.
    assert products.resolve_backend("auto", jnp.float32, "cpu") == "xla"
    assert products.resolve_backend("auto", jnp.bfloat16, "gpu") == "xla"
    assert products.resolve_backend("auto", jnp.bfloat16, "cpu", tensor_parallel=2) == "xla"
    expected = "cpu" if cpu_matmul.available() else "xla"
    assert products.resolve_backend("auto", jnp.bfloat16, "cpu") == expected
    with pytest.raises(ValueError, match="CPU only"):
        products.resolve_backend("cpu", jnp.bfloat16, "gpu")
    with pytest.raises(ValueError, match="tensor-parallel-size 2"):
        products.resolve_backend("cpu", jnp.bfloat16, "cpu", tensor_parallel=2)
    if cpu_matmul.available():
        assert products.resolve_backend("cpu", jnp.bfloat16, "cpu") == "cpu"
        with pytest.raises(ValueError, match="runs in float32"):
            products.resolve_backend("cpu", jnp.float32, "cpu")
    with pytest.raises(ValueError, match="auto, xla, cpu"):
        products.resolve_backend("blas", jnp.bfloat16, "cpu")


def test_bfloat16_runs_fast_where_the_products_do():
    """--dtype auto on the CPU: bfloat16 where the products run fast in it (the native kernel, or
    bfloat16 dot instructions for XLA's), float32 where XLA:CPU would emulate bfloat16 products."""
    from jaxserve.weights.loader import cpu_has_native_bf16

    assert products.bfloat16_runs_fast("xla", platform="gpu") and products.bfloat16_runs_fast("auto", platform="tpu")
    kernel = cpu_matmul.available()
    assert products.bfloat16_runs_fast("auto", platform="cpu") == (kernel or cpu_has_native_bf16())
    assert products.bfloat16_runs_fast("cpu", platform="cpu") == (kernel or cpu_has_native_bf16())
    # XLA's dot, or tensor parallelism (the kernel has no sharding rule): only bf16 instructions help.
    assert products.bfloat16_runs_fast("xla", platform="cpu") == cpu_has_native_bf16()
    assert products.bfloat16_runs_fast("auto", tensor_parallel=2, platform="cpu") == cpu_has_native_bf16()
    if kernel:
        assert cpu_matmul.isa() in ("AVX512-BF16", "AVX2") and cpu_matmul.isa() in products.describe_backend("cpu")


@needs_kernel
@pytest.mark.parametrize("name", ["llama-mha-tied-bias", "qwen3"])  # tied head + biases; untied head
def test_decoder_logits_with_kernel_products(name, tmp_path):
    """The bfloat16 decoder traced with the kernel's products is as close to the float32 model as
    the one traced with XLA's (both round float32 sums to bfloat16, added in different orders, so
    they rarely differ at all): at most 1.5x XLA's error, and the same argmax wherever float32 has
    a clear winner."""
    make_tiny_model(name, tmp_path)
    f32 = load_model(tmp_path, "float32", use_cache=False).model
    bf16 = load_model(tmp_path, "bfloat16", use_cache=False).model
    tokens = jnp.asarray([[1, 17, 99, 5, 200, 33, 7, 250], [1, 42, 9, 8, 7, 6, 5, 4]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    lengths = jnp.asarray([8, 8])
    ref = np.asarray(f32(tokens, positions, lengths))
    xla = np.asarray(bf16(tokens, positions, lengths))
    graphdef, state = nnx.split(bf16)
    native_model = nnx.merge(graphdef, products.place(state, "cpu", bf16.head_path))
    native = np.asarray(native_model(tokens, positions, lengths))
    traced = str(jax.make_jaxpr(lambda t: native_model(t, positions, lengths))(tokens))
    # The kernel really runs: 7 products per layer (traced once, called per layer) and the head.
    assert traced.count(cpu_matmul.TARGET) == 8, traced.count(cpu_matmul.TARGET)
    # The embedding lookup reads the packed head's columns: the same rows as the plain embedding.
    tied = bf16.lm_head is None
    placed = products.place(state, "cpu", bf16.head_path)
    assert isinstance(placed["embed_tokens"].get_value() if tied else placed["lm_head"].get_value(), products.CpuWeight)
    ids = jnp.asarray([[0, 31, 32, 255]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(native_model.embed(ids)), np.asarray(bf16.embed(ids)))
    xla_err, native_err = np.abs(xla - ref).max(), np.abs(native - ref).max()
    assert native_err <= 1.5 * xla_err, (native_err, xla_err)
    top2 = np.sort(ref, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 4 * xla_err
    assert clear.any() and (native.argmax(-1) == ref.argmax(-1))[clear].all()


@needs_kernel
def test_place_consume_frees_the_originals_once_packed(tmp_path):
    """With consume (what start-up asks for), each original kernel buffer is freed once its packed
    copy exists, so start-up never holds the model twice; the packed weights multiply the same."""
    make_tiny_model("qwen3", tmp_path)
    model = load_model(tmp_path, "bfloat16", use_cache=False).model
    _, state = nnx.split(model)
    kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state) if "'kernel'" in jax.tree_util.keystr(path)]
    assert len(kernels) == 7 * model.cfg.num_layers
    x = jnp.ones((3, kernels[0].shape[0]), jnp.bfloat16)
    expected = np.asarray(x @ kernels[0], np.float32)
    placed = products.place(state, "cpu", model.head_path, consume=True)
    assert all(k.is_deleted() for k in kernels)
    first = [w for w in jax.tree_util.tree_leaves(placed, is_leaf=lambda a: isinstance(a, products.CpuWeight))
             if isinstance(w, products.CpuWeight)]
    packed = next(w for w in first if w.n == expected.shape[1] and w.value.shape[1] == x.shape[1])
    np.testing.assert_allclose(np.asarray(products.linear(x, packed), np.float32), expected, rtol=2**-7)


@needs_kernel
@pytest.mark.slow
def test_smollm2_bfloat16_engine_same_greedy_tokens(cache_dir, smollm2_tokenizer):
    """SmolLM2 in bfloat16 (what --dtype auto gives on this CPU): the engine with the kernel's
    products decodes the same greedy tokens as with XLA's, one sequence (a one-row step: the kernel
    needs no padding row) and four at once with chunked prefill. Both sum in float32 but in another
    order, and bfloat16 logits come in steps of 1/16 to 1/8 at SmolLM2's magnitudes, so a sequence
    may part where the two best tokens are within a few steps of each other (even XLA's cached and
    uncached forwards part at such places): there, and only there, the sequences may differ."""
    config = EngineConfig(
        cache=CacheConfig(page_size=16, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=256,
                                  decode_buckets=(1, 4), prefill_buckets=(32,)),
        attention_backend="reference",
    )
    prompts = [smollm2_tokenizer.encode(p) for p in
               ["The capital of France is", "def fibonacci(n):\n", "1, 2, 3, 4,",
                "Write a haiku about the sea and a lighthouse keeper who is waiting for news from far away"]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def engine(matmul: str) -> Engine:
        model = load_model(smollm2_gguf(), "bfloat16", cache_dir=cache_dir).model
        # XLA's products pad a one-row step to two rows anyway: its one sequence runs in the bucket
        # of 4 (padding changes no token), one SmolLM2 compile fewer.
        buckets = config.scheduler.decode_buckets if matmul == "cpu" else (4,)
        engine = build_engine(model, smollm2_tokenizer, dataclasses.replace(
            config, matmul_backend=matmul, scheduler=dataclasses.replace(config.scheduler, decode_buckets=buckets)),
            compile=False)
        assert engine.runner.min_rows == (2 if matmul == "xla" else 1)
        compile_engine(engine)
        return engine

    def greedy(engine: Engine, batch: list[list[int]], tag: str) -> list[list[int]]:
        ids = [f"{tag}{i}" for i in range(len(batch))]
        for rid, p in zip(ids, batch):
            engine.add_request(rid, p, params)
        results = run_to_completion(engine, ids)
        return [results[rid].outputs[0].token_ids for rid in ids]

    reference = load_model(smollm2_gguf(), "bfloat16", cache_dir=cache_dir).model

    def same_but_for_near_ties(got: list[list[int]], want: list[list[int]], batch: list[list[int]]) -> None:
        for prompt, g, w in zip(batch, got, want, strict=True):
            assert len(g) == len(w) == params.max_tokens
            part = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
            if part is None:
                continue
            logits = np.asarray(forward_logits(reference, jnp.asarray(prompt + w[:part])))[-1]
            gap = abs(float(logits[g[part]] - logits[w[part]]))
            assert gap <= 0.5, f"parted at token {part}: {g[part]} vs {w[part]}, {gap} logits apart"

    kernel, xla = engine("cpu"), engine("xla")
    same_but_for_near_ties(greedy(kernel, prompts[:1], "one"), greedy(xla, prompts[:1], "one"), prompts[:1])
    same_but_for_near_ties(greedy(kernel, prompts, "four"), greedy(xla, prompts, "four"), prompts)


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_place_int8_quantizes_kernels_and_the_head(backend, tmp_path):
    """--quantization int8: every Linear kernel and the LM head become int8 with a scale per output
    channel (CpuInt8Weight on the native kernel, Int8Weight on XLA), the originals are freed with
    consume, an embedding lookup of the tied int8 head returns its dequantized rows, and products
    equal x @ (q * scale) to bfloat16 rounding."""
    if backend == "cpu" and not cpu_matmul.available():
        pytest.skip(f"needs a C++ compiler and a CPU with {cpu_matmul.NEEDS}")
    make_tiny_model("llama-mha-tied-bias", tmp_path)
    model = load_model(tmp_path, "bfloat16", use_cache=False).model
    assert model.lm_head is None and model.head_path == ("embed_tokens",)
    graphdef, state = nnx.split(model)
    embedding = np.asarray(state["embed_tokens"].get_value(), np.float32)
    kernel = state["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
    x = jax.random.normal(jax.random.key(0), (3, kernel.shape[0]), jnp.bfloat16)
    q, scale = cpu_matmul.quantize_int8(kernel)
    expected = np.asarray(x, np.float64) @ (np.asarray(q, np.float64) * np.asarray(scale, np.float64))
    originals = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)
                 if "'kernel'" in jax.tree_util.keystr(path)]
    placed = products.place(state, backend, model.head_path, quantization="int8", consume=True)
    assert all(k.is_deleted() for k in originals)
    kind = products.CpuInt8Weight if backend == "cpu" else products.Int8Weight
    weights = [w for w in jax.tree_util.tree_leaves(placed, is_leaf=lambda a: isinstance(a, kind)) if isinstance(w, kind)]
    assert len(weights) == 7 * model.cfg.num_layers + 1
    up = placed["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
    np.testing.assert_allclose(np.asarray(products.linear(x, up), np.float64), expected,
                               rtol=2**-7, atol=2**-7 * np.abs(expected).max())
    head = placed["embed_tokens"].get_value()
    ids = jnp.asarray([[0, 31, 32, 255]], jnp.int32)
    rows = np.asarray(products.rows(head, ids, jnp.bfloat16), np.float32)
    # Each row is its int8 values times the row's scale: within half a step of the original.
    step = np.abs(embedding).max(axis=1) / 127
    assert np.all(np.abs(rows[0] - embedding[ids[0]]) <= step[ids[0]][:, None] * 0.5 + 2**-7 * np.abs(embedding[ids[0]]))
    quantized = nnx.merge(graphdef, placed)
    tokens = jnp.asarray([[1, 17, 99, 5]], jnp.int32)
    logits = np.asarray(quantized(tokens, jnp.arange(4)[None], jnp.asarray([4])))
    assert logits.shape == (1, 4, model.cfg.vocab_size) and np.isfinite(logits).all()
