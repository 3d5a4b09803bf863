"""Gemma3 beyond the shared parity tests (tests/model/test_model_parity.py runs the tiny Gemma3ForCausalLM):
the Hub's configs, which leave Gemma3TextConfig's defaults out and name the local RoPE base and the
layer pattern the old way, and the 4B-27B checkpoints (Gemma3ForConditionalGeneration), served as
their language model with images refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from jaxserve.models.config import RopeConfig, decoder_config_from_hf
from jaxserve.weights import load_model
from tiny_models import _BASE, TINY_CONFIGS, dense_logits, randomize_weights

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18], [1, 42]]

# google/gemma-3-1b-it's config.json (transformers 4.50's layout).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "bos_token_id": 2,
    "cache_implementation": "hybrid", "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 262144,
}

# google/gemma-3-4b-it's config.json, vision_config shortened: text_config says only what differs
# from Gemma3TextConfig's defaults.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model", "patch_size": 14},
}


def test_hub_1b_config():
    cfg = decoder_config_from_hf(GEMMA3_1B)
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.rope == RopeConfig(theta=1e6) and cfg.local_rope == RopeConfig(theta=1e4)
    assert cfg.windows() == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.norm_weight_offset == 1.0 and cfg.tie_word_embeddings
    assert cfg.embed_scale == pytest.approx(1152**0.5) and cfg.scale == pytest.approx(256**-0.5)
    assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
    assert cfg.eos_token_ids == (1, 106) and cfg.dtype == "bfloat16"


def test_hub_4b_config_fills_gemma3_defaults():
    cfg = decoder_config_from_hf(GEMMA3_4B)
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (262_208, 2560, 10240, 34)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_act) == (8, 4, 256, "gelu_pytorch_tanh")
    # rope_scaling is the full-attention layers' only; the sliding ones keep the local base.
    assert cfg.rope == RopeConfig(theta=1e6, kind="linear", factor=8.0)
    assert cfg.local_rope == RopeConfig(theta=1e4)
    assert cfg.windows()[:6] == (1024,) * 5 + (0,)
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings


def test_bidirectional_gemma3_is_refused():
    from jaxserve.models.config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        decoder_config_from_hf({**GEMMA3_1B, "use_bidirectional_attention": True})


def _tiny_gemma3_vlm(directory):
    text = {**_BASE, **TINY_CONFIGS["gemma3"][1]}
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=255, boi_token_index=253, eoi_token_index=254,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    randomize_weights(model)
    model.save_pretrained(directory, safe_serialization=True)
    return model



@pytest.mark.parametrize("hub_layout", [False, True])
def test_conditional_generation_checkpoint_serves_its_language_model(tmp_path, hub_layout):
    """A Gemma3ForConditionalGeneration checkpoint loads as its Gemma3 language model: the logits
    of text prompts are HF's, in transformers 5's layout and in the Hub's (language_model.model.*,
    text_config keeping only what differs from the defaults); the vision side is not loaded."""
    hf = _tiny_gemma3_vlm(tmp_path)
    if hub_layout:
        from safetensors.numpy import load_file, save_file

        path = tmp_path / "model.safetensors"
        tensors = load_file(path)
        renamed = {}
        for name, value in tensors.items():
            if name.startswith("model.language_model."):
                name = "language_model.model." + name[len("model.language_model."):]
            elif name.startswith("model."):
                name = name[len("model."):]  # vision_tower., multi_modal_projector.
            renamed[name] = value
        save_file(renamed, path, metadata={"format": "pt"})
        cfg = json.loads((tmp_path / "config.json").read_text())
        text = cfg["text_config"]
        params = text.pop("rope_parameters")
        text["rope_theta"] = params["full_attention"]["rope_theta"]
        text["rope_scaling"] = {k: v for k, v in params["full_attention"].items() if k != "rope_theta"}
        text["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        text["sliding_window_pattern"] = 2
        text.pop("layer_types")
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(tmp_path, "float32", use_cache=False)
    assert loaded.model.cfg.architecture == "Gemma3ForCausalLM"
    ours = dense_logits(loaded.model, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float().numpy()
        np.testing.assert_allclose(ours[i, : len(prompt)], ref, atol=1e-4, rtol=0)
