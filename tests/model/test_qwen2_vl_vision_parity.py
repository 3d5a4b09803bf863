"""Qwen2.5-VL's vision encoder matches HF transformers (PyTorch, float32): a tiny random model with
window attention that matters (windows of 2x2 merged tokens, images that do not fill whole
windows), full-attention blocks, one image, several images of different sizes (which must not see
each other), a two-frame input, and padded buckets (the long one attends in query blocks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from jaxserve.models.qwen2_vl_vision import vision_layout
from jaxserve.weights.qwen2_vl_vision_loader import load_vision_model, vision_tensor
from jaxserve.weights.safetensors_dir import WeightsError

PATCH_DIM = 3 * 2 * 14 * 14


def _hf_model() -> Qwen2_5_VLForConditionalGeneration:
    config = Qwen2_5_VLConfig(
        # window_size // merge // patch = 2: windows of 2x2 merged tokens (16 patches).
        vision_config={"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                       "window_size": 56, "fullatt_block_indexes": [1, 3]},
        text_config={"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 300, "bos_token_id": 1, "eos_token_id": 2,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}},
        image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    # HF initialises norms to one and biases to zero; random ones make every parameter count.
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            scale = 0.5 if p.ndim == 1 else p[0].numel() ** -0.5
            p.copy_(torch.randn(p.shape) * scale + (1.0 if "norm" in name or "ln_q" in name else 0.0))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = _hf_model()
    hf.save_pretrained(directory)
    loaded = load_vision_model(directory, jnp.float32)
    graphdef, state = nnx.split(loaded.model)
    encode = jax.jit(lambda state, pixels, layout: nnx.merge(graphdef, state).encode(pixels, layout))
    return directory, hf, loaded, lambda pixels, layout: np.asarray(encode(state, pixels, layout))


def _hf_embeds(hf, pixels: np.ndarray, grids: list) -> np.ndarray:
    with torch.no_grad():
        return hf.model.visual(torch.from_numpy(pixels), grid_thw=torch.tensor(grids)).pooler_output.numpy()


def _ours(tiny, pixels: np.ndarray, grids: list, bucket: int) -> np.ndarray:
    _, _, loaded, encode = tiny
    padded = np.zeros((bucket, PATCH_DIM), np.float32)
    padded[: len(pixels)] = pixels
    out = encode(padded, vision_layout(loaded.config, grids, bucket))
    assert out.shape == (bucket // 4, 64) and np.isfinite(out).all()
    return out[: len(pixels) // 4]


def _pixels(grids: list, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((sum(t * h * w for t, h, w in grids), PATCH_DIM), np.float32)


GRID_A = (1, 10, 14)  # 5x7 merged tokens: the last window row and column are partial
GRID_B = (1, 8, 6)
FRAMES = (2, 4, 6)  # two frames: attention never crosses them


@pytest.mark.parametrize("grids,bucket", [
    ([GRID_A], 140),  # exactly full
    ([GRID_A], 160),  # padded
    ([GRID_A, GRID_B], 200),
    ([GRID_B, FRAMES, GRID_A], 640),  # past one query block: attends in blocks
], ids=["one image", "one image padded", "two images", "three inputs long bucket"])
def test_encode_matches_hf(tiny, grids, bucket):
    _, hf, _, _ = tiny
    pixels = _pixels(grids)
    want = _hf_embeds(hf, pixels, grids)
    np.testing.assert_allclose(_ours(tiny, pixels, grids, bucket), want, atol=1e-4, rtol=0)


def test_images_do_not_see_each_other(tiny):
    """Image B's tokens are the same alone and after image A; and HF's get_image_features split
    agrees with our per-image rows."""
    _, hf, _, _ = tiny
    pixels = _pixels([GRID_A, GRID_B])
    both = _ours(tiny, pixels, [GRID_A, GRID_B], 200)
    alone = _ours(tiny, pixels[140:], [GRID_B], 64)
    np.testing.assert_allclose(both[35:], alone, atol=1e-5, rtol=0)
    with torch.no_grad():
        split = hf.model.get_image_features(torch.from_numpy(pixels), torch.tensor([GRID_A, GRID_B])).pooler_output
    np.testing.assert_allclose(both[:35], split[0].numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(both[35:], split[1].numpy(), atol=1e-4, rtol=0)


def test_windows_matter(tiny):
    """The test model's window blocks are not full attention in disguise."""
    _, hf, loaded, encode = tiny
    pixels = _pixels([GRID_A])
    layout = vision_layout(loaded.config, [GRID_A], 140)
    wrong = encode(pixels, layout.replace(window_segments=layout.full_segments))
    assert np.abs(wrong - _hf_embeds(hf, pixels, [GRID_A])).max() > 1e-2


def test_loads_the_model_visual_layout_too(tiny, tmp_path):
    directory, hf, _, _ = tiny
    tensors = load_file(directory / "model.safetensors")
    assert any(vision_tensor(n) for n in tensors) and not vision_tensor("model.language_model.norm.weight")
    renamed = {("model." + n if n.startswith("visual.") else n): v for n, v in tensors.items()}
    assert all(vision_tensor(n) for n in renamed if "visual" in n)
    save_file(renamed, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    loaded = load_vision_model(tmp_path, jnp.float32)
    pixels = _pixels([GRID_B])
    out = np.asarray(loaded.model.encode(pixels, vision_layout(loaded.config, [GRID_B], 48)))
    np.testing.assert_allclose(out, _hf_embeds(hf, pixels, [GRID_B]), atol=1e-4, rtol=0)

    del renamed["model.visual.merger.ln_q.weight"]
    save_file(renamed, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="merger.ln_q.weight is missing"):
        load_vision_model(tmp_path, jnp.float32)


def test_layout_refuses_a_bucket_that_cannot_hold_the_images(tiny):
    _, _, loaded, _ = tiny
    with pytest.raises(ValueError, match="cannot hold 140"):
        vision_layout(loaded.config, [GRID_A], 136)
    with pytest.raises(ValueError, match="multiple of 4"):
        vision_layout(loaded.config, [GRID_A], 142)
