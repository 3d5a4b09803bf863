"""--lora-modules and PEFT adapter files on the host: the flag's two forms, the adapters' factors
in the model's orientation with their scales (against numpy), and what is refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from jaxserve.weights.lora_adapter import LoraAdapter, LoraModuleSpec, load_adapter
from jaxserve.weights.safetensors_dir import WeightsError


def test_spec_forms():
    assert LoraModuleSpec.parse("sql=/a/b") == LoraModuleSpec("sql", Path("/a/b"))
    assert LoraModuleSpec.parse('{"name": "sql", "path": "/a/b", "base_model_name": "m"}') == \
        LoraModuleSpec("sql", Path("/a/b"), "m")
    assert LoraModuleSpec.parse({"name": "sql", "path": "/a/b"}) == LoraModuleSpec("sql", Path("/a/b"))  # YAML
    # SGLang's --lora-paths: a bare path is its own name; its JSON keys, and pinned.
    assert LoraModuleSpec.parse("/a/b", "--lora-paths") == LoraModuleSpec("/a/b", Path("/a/b"))
    assert LoraModuleSpec.parse("sql=/a/b", "--lora-paths") == LoraModuleSpec("sql", Path("/a/b"))
    assert LoraModuleSpec.parse('{"lora_name": "sql", "lora_path": "/a/b", "pinned": true}', "--lora-paths") == \
        LoraModuleSpec("sql", Path("/a/b"), pinned=True)
    for bad, words in (("sql", "--lora-modules: 'sql' is not name=path"), ("=x", "needs a name"),
                       ("sql=", "needs a name"), ('{"name": "x"}', "needs a string name and path"),
                       ('{"name": "x", "path": "p", "rank": 2}', "unknown keys"), ("{bad json", "not valid JSON"),
                       ('{"name": "x", "lora_name": "y", "path": "p"}', "the name or the path twice"),
                       ('{"lora_name": "x", "lora_path": "p", "pinned": "yes"}', "a boolean pinned")):
        with pytest.raises(ValueError, match=words):
            LoraModuleSpec.parse(bad)


def _save(path: Path, tensors: dict[str, np.ndarray], config: dict) -> None:
    """A PEFT adapter directory, the safetensors file written by hand (float32)."""
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(config))
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


SHAPES = {"q_proj": (8, 8), "k_proj": (8, 4), "v_proj": (8, 4), "o_proj": (8, 8), "gate_proj": (8, 16),
          "up_proj": (8, 16), "down_proj": (16, 8)}


def test_scales(tmp_path):
    rng = np.random.default_rng(0)
    a_q, b_q = rng.normal(size=(2, 8)), rng.normal(size=(8, 2))  # PEFT's [r, in] and [out, r]
    a_d, b_d = rng.normal(size=(2, 16)), rng.normal(size=(8, 2))
    prefix = "base_model.model.model.layers"
    _save(tmp_path / "one", {f"{prefix}.1.self_attn.q_proj.lora_A.weight": a_q,
                             f"{prefix}.1.self_attn.q_proj.lora_B.weight": b_q,
                             f"{prefix}.0.mlp.down_proj.lora_A.weight": a_d,
                             f"{prefix}.0.mlp.down_proj.lora_B.weight": b_d},
          {"peft_type": "LORA", "r": 2, "lora_alpha": 6, "alpha_pattern": {"model.layers.0.mlp.down_proj": 1},
           "bias": "none"})
    one = load_adapter(LoraModuleSpec("one", tmp_path / "one"), 2, SHAPES)
    assert one.rank == 2 and one.targets == ["down_proj", "q_proj"]
    a, b = one.factors[(1, "q_proj")]
    np.testing.assert_allclose(a @ b, (3.0 * b_q @ a_q).T, rtol=1e-5)  # alpha / r = 3, in [in, out]
    a, b = one.factors[(0, "down_proj")]
    np.testing.assert_allclose(a @ b, (0.5 * b_d @ a_d).T, rtol=1e-5)  # alpha_pattern: 1 / 2
    _save(tmp_path / "rs", {f"{prefix}.0.self_attn.q_proj.lora_A.weight": np.ones((4, 8)),
                            f"{prefix}.0.self_attn.q_proj.lora_B.weight": np.ones((8, 4))},
          {"r": 4, "lora_alpha": 4, "use_rslora": True})
    rs = load_adapter(LoraModuleSpec("rs", tmp_path / "rs"), 2, SHAPES)
    np.testing.assert_allclose(rs.factors[(0, "q_proj")][1], np.full((4, 8), 2.0))  # alpha / sqrt(r)

    assert isinstance(one, LoraAdapter)


def test_refusals(tmp_path):
    _save(tmp_path / "emb", {"base_model.model.model.embed_tokens.lora_embedding_A": np.ones((2, 8))}, {"r": 2})
    with pytest.raises(WeightsError, match="not a LoRA factor of a decoder projection"):
        load_adapter(LoraModuleSpec("emb", tmp_path / "emb"), 2, SHAPES)
    _save(tmp_path / "half", {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((2, 8))},
          {"r": 2})
    with pytest.raises(WeightsError, match="without its other factor"):
        load_adapter(LoraModuleSpec("half", tmp_path / "half"), 2, SHAPES)
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "adapter_config.json").write_text("{}")
    (tmp_path / "pickle" / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(WeightsError, match="pickle"):
        load_adapter(LoraModuleSpec("pickle", tmp_path / "pickle"), 2, SHAPES)
    _save(tmp_path / "ia3", {}, {"peft_type": "IA3"})
    with pytest.raises(WeightsError, match="not LORA"):
        load_adapter(LoraModuleSpec("ia3", tmp_path / "ia3"), 2, SHAPES)
    for field, value, words in (("alora_invocation_tokens", [5, 6], "aLoRA"), ("use_dora", True, "DoRA"),
                                ("bias", "all", "biases"), ("lora_alpha", "16", "must be numbers")):
        _save(tmp_path / field, {}, {"r": 2, field: value})
        with pytest.raises(WeightsError, match=words):
            load_adapter(LoraModuleSpec(field, tmp_path / field), 2, SHAPES)
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "adapter_config.json").write_text("[1]")
    with pytest.raises(WeightsError, match="not a JSON object"):
        load_adapter(LoraModuleSpec("list", tmp_path / "list"), 2, SHAPES)
