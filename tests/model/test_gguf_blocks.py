"""--quantization auto on a GGUF: the file's Q4_0 / Q4_1 / Q8_0 blocks become the model's weights as
they are (products.GroupWeight on XLA, CpuGroupWeight on the native kernel), so the served model
is the file's model to float tolerance, not a requantized one; other block types are refused,
naming the tensor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as Q
from tiny_gguf import write_llama_gguf
from tiny_models import make_tiny_model

from jaxserve.models import products
from jaxserve.weights import WeightsError, load_model
from jaxserve.weights.loader import stored_blocks
from pallas_kernels import cpu_qmatmul

TOKENS = np.array([[1, 5, 9, 200, 3, 17, 44, 8]], np.int32)


def _logits(decoder) -> np.ndarray:
    positions = np.arange(TOKENS.shape[1], dtype=np.int32)[None]
    return np.asarray(decoder(jnp.asarray(TOKENS), jnp.asarray(positions), jnp.asarray([TOKENS.shape[1]])), np.float64)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    return d, make_tiny_model("llama-mha-tied-bias", d).config


def _gguf(tiny_llama, tmp_path, qtype, types=None):
    hf_dir, config = tiny_llama
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_llama_gguf(path, hf_dir, config, qtype, types)
    return path


def _kept(model, backend, blocks):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, products.place(state, backend, model.head_path, quantization="gguf", blocks=blocks))


def _group_weights(model) -> list:
    _, state = nnx.split(model)
    kinds = (products.GroupWeight, products.CpuGroupWeight)
    return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kinds)) if isinstance(x, kinds)]


@pytest.mark.parametrize("qtype, bits", [(Q.Q4_0, 4), (Q.Q4_1, 4), (Q.Q8_0, 8)])
def test_kept_blocks_are_the_dequantized_model_in_float32(tiny_llama, tmp_path, qtype, bits):
    """In float32 on XLA the kept blocks dequantize to exactly the gguf package's values, so the
    logits equal the dequantized model's to float32 rounding (RoPE rows un-interleaved alike)."""
    loaded = load_model(_gguf(tiny_llama, tmp_path, qtype), "float32", use_cache=False)
    ref = _logits(loaded.model)
    assert np.all(np.isfinite(ref))
    blocks = stored_blocks(loaded.source, loaded.model.head_path)
    assert blocks is not None
    kept = _kept(loaded.model, "xla", blocks)
    weights = _group_weights(kept)
    assert len(weights) == 7 * loaded.config.num_layers + 1  # q k v o gate up down, and the tied head
    assert all(w.q.dtype == (jnp.uint4 if bits == 4 else jnp.int8) for w in weights)
    assert all((w.mn is None) == (bits == 8) for w in weights)
    np.testing.assert_allclose(_logits(kept), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype, bits", [(Q.Q4_K, 4), (Q.Q6_K, 8)])
def test_k_quant_blocks_are_the_dequantized_model(tmp_path_factory, qtype, bits):
    """Q4_K and Q6_K (a tiny llama with rows of 256, random super-blocks) kept as float32-scaled
    groups of 32 / 16: the gguf package's dequantized model in float32 on XLA, and to bf16
    tolerance through the native kernel."""
    hf_dir = tmp_path_factory.mktemp("llama256")
    config = make_tiny_model("llama-256", hf_dir).config
    path = hf_dir.parent / f"tiny-{qtype.name}.gguf"
    write_llama_gguf(path, hf_dir, config, qtype)
    loaded = load_model(path, "float32", use_cache=False)
    ref = _logits(loaded.model)
    assert np.all(np.isfinite(ref)) and ref.std() > 0.1
    blocks = stored_blocks(loaded.source, loaded.model.head_path)
    kept = _kept(loaded.model, "xla", blocks)
    weights = _group_weights(kept)
    assert len(weights) == 7 * loaded.config.num_layers + 1
    assert all(w.d.dtype == jnp.float32 and w.d.shape[0] == w.q.shape[0] // (32 if bits == 4 else 16) for w in weights)
    np.testing.assert_allclose(_logits(kept), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    if cpu_qmatmul.available():
        bf16 = load_model(path, "bfloat16", use_cache=False)
        native = _logits(_kept(bf16.model, "cpu", stored_blocks(bf16.source, bf16.model.head_path)))
        np.testing.assert_allclose(native, ref, atol=0.03 * np.abs(ref).max(), rtol=0)


@pytest.mark.skipif(not cpu_qmatmul.available(),
                    reason="needs the native kernel (a C++ compiler; AVX512-BF16, or AVX2 with FMA)")
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_native_kernel_serves_the_blocks(tiny_llama, tmp_path, qtype):
    """bfloat16 activations through the native kernel on the kept blocks: the float32 reference's
    logits to bfloat16 tolerance."""
    path = _gguf(tiny_llama, tmp_path, qtype)
    ref = _logits(load_model(path, "float32", use_cache=False).model)
    loaded = load_model(path, "bfloat16", use_cache=False)
    kept = _kept(loaded.model, "cpu", stored_blocks(loaded.source, loaded.model.head_path))
    assert len(_group_weights(kept)) == 7 * loaded.config.num_layers + 1
    got = _logits(kept)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, atol=0.03 * np.abs(ref).max(), rtol=0)
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.85


def test_float_gguf_has_no_blocks(tiny_llama, tmp_path):
    """A GGUF of float tensors keeps nothing: auto is then none."""
    loaded = load_model(_gguf(tiny_llama, tmp_path, Q.F16), "float32", use_cache=False)
    assert stored_blocks(loaded.source, loaded.model.head_path) is None
    assert products.resolve_quantization("auto", gguf_blocks=False) == "none"
    assert products.resolve_quantization("auto", gguf_blocks=True) == "gguf"
    assert products.resolve_quantization("gguf", gguf_blocks=False) == "none"
    with pytest.raises(ValueError, match="auto, none, int8, int4, gguf"):
        products.resolve_quantization("int3")


def test_other_block_types_refused_by_gguf_dequantized_by_auto(tiny_llama, tmp_path, caplog):
    """A product weight in a block type no kernel reads (Q5_0 here, as llama.cpp's Q4_K_M files hold
    where rows are no whole number of 256): --quantization gguf refuses it, naming the tensor, its
    type, the supported set and the flags that load it; auto keeps the other blocks and runs that
    one dequantized, naming it in a warning; the logits equal the dequantized model's."""
    path = _gguf(tiny_llama, tmp_path, Q.Q4_1, types={"blk.1.ffn_up.weight": Q.Q5_0})
    with pytest.raises(WeightsError, match=r"blk\.1\.ffn_up\.weight is stored as Q5_0.*Q4_0, Q4_1, Q8_0.*"
                                           r"--quantization auto"):
        load_model(path, "float32", use_cache=False, keep_blocks="strict")
    ref = load_model(path, "float32", use_cache=False)  # none: all dequantized
    with caplog.at_level("WARNING", logger="jaxserve.weights"):
        auto = load_model(path, "bfloat16", use_cache=False, keep_blocks="auto")
    assert "blk.1.ffn_up.weight (Q5_0)" in caplog.text and "dequantized to bfloat16" in caplog.text
    assert auto.blocks is not None
    assert auto.blocks(("layers", 1, "mlp", "up_proj", "kernel")) is None  # runs dequantized
    assert auto.blocks(("layers", 1, "mlp", "down_proj", "kernel")).bits == 4
    # The same in float32 on XLA through the strict path's reader (non-strict): the file's model.
    blocks = stored_blocks(ref.source, ref.model.head_path, strict=False, dtype_name="float32")
    np.testing.assert_allclose(_logits(_kept(ref.model, "xla", blocks)), _logits(ref.model), rtol=1e-5,
                               atol=1e-5 * np.abs(_logits(ref.model)).max())


def test_auto_keeps_blocks_only_in_bfloat16(tiny_llama, tmp_path):
    """keep_blocks="auto" keeps nothing for a float32 run (the native kernel multiplies bfloat16):
    the model is the dequantized one; "strict" keeps them in any dtype."""
    path = _gguf(tiny_llama, tmp_path, Q.Q4_1)
    assert load_model(path, "float32", use_cache=False, keep_blocks="auto").blocks is None
    assert load_model(path, "float32", use_cache=False, keep_blocks="strict").blocks is not None
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(tiny_llama[0], "float32", use_cache=False, keep_blocks="strict")


def test_int4_needs_whole_groups(tiny_llama):
    """int4 refuses a kernel whose input features are not a whole number of groups, naming it (and,
    before loading, the config's widths that are not, with the group sizes that would do)."""
    from jaxserve.models.config import decoder_config_from_hf

    cfg = decoder_config_from_hf({**tiny_llama[1].to_dict(), "architectures": ["LlamaForCausalLM"]})
    products.check_int4_shapes(cfg, 32)
    with pytest.raises(ValueError, match=r"hidden_size 64.*groups of 128.*\(32, 64\)"):
        products.check_int4_shapes(cfg, 128)
    with pytest.raises(ValueError, match="--quantization-group-size must be one of 32, 64, 128"):
        products.check_group_size(48)
    hf_dir, _ = tiny_llama
    model = load_model(hf_dir, "float32", use_cache=False).model
    _, state = nnx.split(model)
    k = model.cfg.hidden_size
    with pytest.raises(ValueError, match=r"layers\.0\..*kernel has \d+ input features.*groups of 128"):
        if k % 128 == 0:
            pytest.skip("the tiny model's hidden size is a multiple of 128")
        products.place(state, "xla", model.head_path, quantization="int4", group=128)
