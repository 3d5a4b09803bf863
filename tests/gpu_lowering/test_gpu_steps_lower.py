"""The engine's real prefill and decode steps (jaxserve.engine.programs) for a Llama-3-8B-shaped
model, lowered for an H100 from the CPU (see test_gpu_kernels_lower.py for how): every layer's
attention is one Pallas Triton kernel (no interpreter fallback, no reference gather), the weights
enter as one buffer per layer, and the KV cache and the device batch are donated, so XLA updates
them in place. tests/gpu_aot compiles the decode steps too, with XLA:GPU's deviceless
compilation (jax's CUDA plugin, no GPU), and checks what the compiled programs say."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")


@pytest.fixture(scope="module")
def lowered():
    """key -> the step lowered for cuda, for Llama-3-8B shapes (abstract weights: nothing allocated)."""
    from flax import nnx

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.dummy_model import PRESETS
    from jaxserve.config import SchedulerConfig
    from jaxserve.engine.buckets import BucketTable
    from jaxserve.engine.device_batch import abstract_batch
    from jaxserve.engine.kv_cache import KVCache
    from jaxserve.engine.programs import StepPrograms
    from jaxserve.engine.step_inputs import StepInputBuilder
    from jaxserve.models.config import decoder_config_from_hf
    from jaxserve.models.decoder import Decoder

    cfg = decoder_config_from_hf(PRESETS["llama-3-8b"])
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, jnp.bfloat16)))
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_prefill_seqs=8, max_model_len=8192,
                            decode_buckets=(1, 64), prefill_buckets=(1024,), decode_steps=4)
    builder = StepInputBuilder(num_slots=65, vocab_size=cfg.vocab_size, page_size=16, max_pages_per_seq=512,
                               buckets=BucketTable(sched), max_prefill_seqs=8, decode_steps=4,
                               row_params=lambda seq: None)
    from jaxserve.engine.runner import min_product_rows

    programs = StepPrograms(graphdef, cfg, page_size=16, decode_steps=4, attention_backend="pallas_gpu",
                            min_rows=min_product_rows("gpu", jnp.bfloat16))
    shape = KVCache.shape(cfg, 8192, 16)
    kv = KVCache(jax.ShapeDtypeStruct(shape, jnp.bfloat16), jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    batch = abstract_batch(65, cfg.vocab_size, 512)
    out = {}
    with use_abstract_mesh(AbstractMesh((), (), abstract_device=H100)):
        for key in (("decode", 1), ("decode", 64), ("prefill", 1024, 8)):
            traced = programs.trace(key, params, kv, batch, builder.abstract(key))
            out[key] = traced.lower(lowering_platforms=("cuda",))
    return cfg, out


@pytest.mark.parametrize("key", [("decode", 1), ("decode", 64), ("prefill", 1024, 8)], ids=str)
def test_each_layer_attends_with_one_triton_kernel(lowered, key):
    cfg, steps = lowered
    text = steps[key].as_text()
    kernels = text.count("stablehlo.custom_call @__gpu$xla.gpu.triton")
    # The layer body is traced once (or twice: the first layer's inputs differ in their types) and
    # called per layer (jaxserve.models.layers.run_layers); each body holds one kernel call, and at
    # batch 1 (a split context) one more that merges the splits.
    calls = re.findall(r"= (?:func\.)?call @(_call_layer\w*)\(", text)
    assert 1 <= len(set(calls)) <= 2 and len(calls) == cfg.num_layers
    per_layer = 2 if key == ("decode", 1) else 1
    assert kernels == per_layer * len(set(calls)), "one Triton kernel per layer, no interpreter fallback"
    assert "stablehlo.custom_call @" not in text.replace("stablehlo.custom_call @__gpu$xla.gpu.triton", "")


@pytest.mark.parametrize("key", [("decode", 1), ("prefill", 1024, 8)], ids=str)
def test_the_cache_and_the_device_batch_are_donated(lowered, key):
    _, steps = lowered
    main = re.search(r"func\.func public @main\((.*?)\) ->", steps[key].as_text(), re.S).group(1)
    args = re.split(r", %arg", main)
    aliased = [a for a in args if "tf.aliasing_output" in a]
    cache = [a for a in aliased if "32x8x8192x16x128xbf16" in a]
    assert len(cache) == 2, "both K and V are updated in place"
    assert len(aliased) >= 2 + 5  # the cache and every array of the device batch


def test_a_one_sequence_decode_multiplies_two_rows_and_attends_with_the_decode_kernel(lowered):
    """XLA:GPU rewrites a one-row product with a weight under 10M elements (k and v here) as a
    multiply + reduce that writes the weight-sized product out (H100, benchmarks/RESULTS.md), so
    batch-1 decode pads its products to two rows; the padding must not switch the attention to the
    ragged kernel (37 us a layer on the H100 against the decode kernel's 6). The kernel attends the
    padding row too (zeros, so no pad of its output per layer), with its 64 splits per kv head sized
    for the one sequence: partial results [splits, rows, kv_heads, group, head_dim]."""
    _, steps = lowered
    text = steps[("decode", 1)].as_text()
    weights = re.findall(r"stablehlo\.dot_general %\S+, %\S+.*?: \((tensor<[^>]*>), tensor<4096x1024xbf16>\)", text)
    assert weights and all(re.fullmatch(r"tensor<(1x)?2x4096xbf16>", w) for w in weights), weights
    assert "jaxserve_paged_decode" in text and "jaxserve_ragged_paged_attention" not in text
    assert "tensor<64x2x8x4x128xf32>" in text
