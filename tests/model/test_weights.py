"""Weight loading: GGUF (names, RoPE permutation, quant types), safetensors layouts, refusals,
and the orbax cache."""

from __future__ import annotations

import json
import shutil

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tiny_gguf import write_llama_gguf
from tiny_models import make_tiny_model

from jaxserve.models.config import UnsupportedModelError
from jaxserve.weights import WeightsError, load_model, resolve, resolve_dtype

TOKENS = np.array([[1, 5, 9, 200, 3, 17, 44, 8]], np.int32)


def _logits(decoder) -> np.ndarray:
    positions = np.arange(TOKENS.shape[1], dtype=np.int32)[None]
    return np.asarray(decoder(jnp.asarray(TOKENS), jnp.asarray(positions), jnp.asarray([TOKENS.shape[1]])))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    return d, make_tiny_model("llama-mha-tied-bias", d).config


def test_gguf_f32_equals_safetensors(tiny_llama, tmp_path):
    hf_dir, config = tiny_llama
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_dir, config)
    ref = _logits(load_model(hf_dir, "float32", use_cache=False).model)
    ours = _logits(load_model(path, "float32", use_cache=False).model)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    # A directory holding exactly one .gguf resolves to it.
    assert resolve(tmp_path).path == path


@pytest.mark.parametrize("qtype, tol", [(Q.F16, 2e-3), (Q.BF16, 1e-2), (Q.Q8_0, 1e-2), (Q.Q4_0, 0.15), (Q.Q4_1, 0.15)])
def test_gguf_quant_types_dequantize(tiny_llama, tmp_path, qtype, tol):
    """Each quantized tensor loads to within that format's rounding of the original weight."""
    hf_dir, config = tiny_llama
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_llama_gguf(path, hf_dir, config, qtype)
    loaded = load_model(path, "float32", use_cache=False).model
    original = load_model(hf_dir, "float32", use_cache=False).model
    for layer, (got_layer, want_layer) in enumerate(zip(loaded.layers, original.layers)):
        for name in ("q_proj", "k_proj", "o_proj"):
            got = np.asarray(getattr(got_layer.self_attn, name).kernel[...])
            want = np.asarray(getattr(want_layer.self_attn, name).kernel[...])
            err = np.abs(got - want).max()
            assert err <= tol * np.abs(want).max(), (layer, name, err)


def _kquant_gguf(path, qtype: Q, blocks: np.ndarray, rows: int) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("t", blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _load_raw(path) -> np.ndarray:
    reader = gguf.GGUFReader(path)
    t = reader.tensors[0]
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))


def test_k_quant_blocks_decode_by_the_format(tmp_path):
    """Q4_K and Q6_K super-blocks built by hand decode to the values the format defines."""
    rng = np.random.default_rng(0)
    # Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles. With every
    # sub-block scale 1 and min 0, value = d * nibble; nibble order: 4 groups of 64 values,
    # low nibbles first then high nibbles of the same 32 bytes.
    d = np.float16(0.5)
    scales = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)
    qs = rng.integers(0, 256, 128, dtype=np.uint8)
    block = np.concatenate([np.array([d], np.float16).view(np.uint8), np.zeros(2, np.uint8), scales, qs])
    _kquant_gguf(tmp_path / "q4k.gguf", Q.Q4_K, block[None], 1)
    nib = qs.reshape(4, 32)
    expected = np.concatenate([np.concatenate([g & 15, g >> 4]) for g in nib]) * 0.5
    np.testing.assert_array_equal(_load_raw(tmp_path / "q4k.gguf")[0], expected)
    # Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d;
    # value = d * scale * (q - 32). All-zero quants with scale 1 give -32 * d.
    block = np.concatenate([np.zeros(192, np.uint8), np.ones(16, np.int8).view(np.uint8),
                            np.array([np.float16(0.25)], np.float16).view(np.uint8)])
    _kquant_gguf(tmp_path / "q6k.gguf", Q.Q6_K, block[None], 1)
    np.testing.assert_array_equal(_load_raw(tmp_path / "q6k.gguf")[0], np.full(256, -8.0))


def test_sharded_safetensors_with_index(tiny_llama, tmp_path):
    hf_dir, _ = tiny_llama
    from safetensors.numpy import load_file, save_file

    tensors = load_file(hf_dir / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / fname)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in halves.items() for k in ks}})
    )
    shutil.copy(hf_dir / "config.json", tmp_path / "config.json")
    np.testing.assert_allclose(_logits(load_model(tmp_path, "float32", use_cache=False).model),
                               _logits(load_model(hf_dir, "float32", use_cache=False).model), atol=0)


def test_bfloat16_safetensors_checkpoint(tmp_path):
    hf = make_tiny_model("qwen2", tmp_path)
    hf.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, "auto", use_cache=False)
    assert loaded.config.dtype == "bfloat16"
    assert loaded.dtype == resolve_dtype("auto", "bfloat16", "cpu")  # bfloat16 iff this CPU has it natively
    assert resolve_dtype("auto", "bfloat16", "cpu", native_bf16=False) == jnp.float32
    assert resolve_dtype("auto", "q4_1", "cpu", native_bf16=True) == jnp.bfloat16
    assert resolve_dtype("auto", "float32", "cpu", native_bf16=True) == jnp.float32
    assert resolve_dtype("auto", "bfloat16", "gpu") == jnp.bfloat16
    assert resolve_dtype("auto", "float16", "tpu") == jnp.bfloat16
    assert resolve_dtype("auto", "float32", "gpu") == jnp.float32


def test_orbax_cache_restores_identical_weights(tiny_llama, tmp_path):
    hf_dir, _ = tiny_llama
    first = load_model(hf_dir, "float32", cache_dir=tmp_path)
    second = load_model(hf_dir, "float32", cache_dir=tmp_path)
    assert not first.from_cache and second.from_cache
    np.testing.assert_array_equal(_logits(first.model), _logits(second.model))
    # Another dtype is its own cache entry; touching the source invalidates it.
    assert not load_model(hf_dir, "bfloat16", cache_dir=tmp_path).from_cache
    st = (hf_dir / "model.safetensors").stat()
    import os

    os.utime(hf_dir / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert not load_model(hf_dir, "float32", cache_dir=tmp_path).from_cache


def test_refusals(tiny_llama, tmp_path):
    hf_dir, _ = tiny_llama
    with pytest.raises(WeightsError, match="does not exist"):
        resolve(tmp_path / "nope")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(hf_dir / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(WeightsError, match="never loads pickle"):
        resolve(pickled)
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(WeightsError, match="2 .gguf files"):
        resolve(two)
    with pytest.raises(WeightsError, match="not a readable GGUF"):
        load_model(two / "a.gguf", use_cache=False)

    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        load_model(bad, use_cache=False)
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(WeightsError, match="mlp.down_proj.weight has shape"):
        load_model(bad, use_cache=False)
