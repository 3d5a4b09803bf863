"""Gemma2, Gemma3 and Phi-3 GGUF files (llama.cpp's `gemma2` / `gemma3` / `phi3` architectures) load
as the model their HF checkpoint is: logits equal HF's. Gemma: the norms' stored 1 + w taken back
to w, its four norms per layer named, and the settings llama.cpp keeps in its code (query scale,
layer pattern, the sliding layers' RoPE base) read as llama.cpp reads them. Phi-3: the fused
attn_qkv and gate-and-up ffn_up split into the model's projections, for float tensors and for the
blocks the products read as stored."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxserve.weights import load_model
from tiny_gguf import write_gguf
from tiny_models import _BASE, TINY_CONFIGS, dense_logits, randomize_weights

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18], [1, 42]]
CLASSES = {"gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config",
           "phi3-longrope": "Phi3Config"}


def _tiny(arch: str, directory):
    # A GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5 below 27B, so
    # the checkpoint must too for the file to mean the same model.
    overrides = {**TINY_CONFIGS[arch][1], **({"query_pre_attn_scalar": 16} if arch.startswith("gemma") else {})}
    config = getattr(transformers, CLASSES[arch])(**{**_BASE, **overrides})
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize_weights(model)
    model.save_pretrained(directory, safe_serialization=True)
    return model



def _assert_hf_logits(decoder, hf, prompts=PROMPTS) -> None:
    ours = dense_logits(decoder, prompts)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float().numpy()
        np.testing.assert_allclose(ours[i, : len(prompt)], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_logits_match_hf(tmp_path, arch):
    hf = _tiny(arch, tmp_path / "hf")
    tokens = [f"w{i}" for i in range(256)]
    tokens[107] = "<end_of_turn>"
    path = tmp_path / "model.gguf"
    write_gguf(path, tmp_path / "hf", hf.config, arch, tokens=tokens)
    loaded = load_model(path, "float32", use_cache=False)
    cfg = loaded.model.cfg
    assert cfg.architecture == hf.config.architectures[0]
    assert cfg.windows() == tuple(5 if t == "sliding_attention" else 0 for t in hf.config.layer_types)
    # llama.cpp ends a Gemma generation at <end_of_turn> as well as at the file's eos.
    assert cfg.eos_token_ids == (2, 107)
    _assert_hf_logits(loaded.model, hf)



def test_gemma3_gguf_tokenizer(tmp_path):
    """A Gemma3 GGUF's tokenizer (SentencePiece pieces and scores, as llama.cpp's converter stores
    them) builds: spaces become ▁, pieces win by score, control tokens stay whole."""
    import gguf

    from jaxserve.tokenizer import load_tokenizer

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "▁hello", "▁world", "user",
              "model", "\n", "▁", "h", "e", "l", "o", "w", "r", "d"]
    w = gguf.GGUFWriter(tmp_path / "tok.gguf", "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 6 + [-1.0, -1.5, -2.0, -2.0, -3.0, -4.0] + [-5.0] * 7)
    w.add_token_types([3, 3, 3, 2, 3, 3] + [1] * 13)  # 3: control, 2: unknown, 1: normal
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)  # as llama.cpp's converter writes Gemma's
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = load_tokenizer(tmp_path, "tok.gguf")
    assert tok.encode(" hello world") == [6, 7]
    assert tok.encode("hello world") == [12, 13, 14, 14, 15, 7]  # no piece "hello" without its space
    assert tok.encode("<start_of_turn>user\n hello<end_of_turn>") == [4, 8, 10, 6, 5]
    assert tok.decode([6, 7]) == " hello world"


@pytest.mark.parametrize("name", ["phi3", "phi3-longrope"])
def test_phi3_gguf_logits_match_hf(tmp_path, name):
    """Phi-3, and with LongRoPE (its factors stored as tensors, read into the config) on prompts
    on both sides of the switch."""
    hf = _tiny(name, tmp_path / "hf")
    write_gguf(tmp_path / "phi3.gguf", tmp_path / "hf", hf.config, "phi3")
    loaded = load_model(tmp_path / "phi3.gguf", "float32", use_cache=False)
    # rope.dimension_count: half of head_dim 16 for the first, all of it for the LongRoPE one.
    assert (loaded.model.cfg.rotary_dim, loaded.model.cfg.rope.kind) == (
        (8, "default") if name == "phi3" else (0, "longrope"))
    _assert_hf_logits(loaded.model, hf, PROMPTS + [[1] + [(7 * i) % 250 + 3 for i in range(20)]])


def test_phi3_q8_0_blocks_split_and_served_as_stored(tmp_path):
    """A Q8_0 Phi-3 GGUF's fused blocks split by rows into q/k/v and gate/up blocks, which the
    products read as stored: the same logits as the file's dequantized model."""
    import jax
    from flax import nnx
    from gguf import GGMLQuantizationType as Q

    from jaxserve.models import products
    from jaxserve.weights.loader import stored_blocks

    hf = _tiny("phi3", tmp_path / "hf")
    write_gguf(tmp_path / "q8.gguf", tmp_path / "hf", hf.config, "phi3", Q.Q8_0)
    loaded = load_model(tmp_path / "q8.gguf", "float32", use_cache=False)
    ref = dense_logits(loaded.model, PROMPTS)
    blocks = stored_blocks(loaded.source, loaded.model.head_path)
    graphdef, state = nnx.split(loaded.model)
    kept = nnx.merge(graphdef, products.place(state, "xla", loaded.model.head_path, quantization="gguf",
                                              blocks=blocks))
    weights = [x for x in jax.tree.leaves(nnx.split(kept)[1], is_leaf=lambda x: isinstance(x, products.GroupWeight))
               if isinstance(x, products.GroupWeight)]
    assert len(weights) == 7 * loaded.config.num_layers + 1  # q k v o gate up down, and the head
    ours = dense_logits(kept, PROMPTS)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
