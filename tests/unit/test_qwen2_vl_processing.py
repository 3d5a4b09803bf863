"""Qwen2-VL's host inputs match HF transformers: the image processor's pixel_values and grid
(Qwen2VLImageProcessorPil, the backend HF uses without torchvision) and the M-RoPE positions
(Qwen2_5_VLModel.get_rope_index)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from jaxserve.multimodal.qwen2_vl_processing import (
    Qwen2VLImageProcessor,
    mrope_frequency_axes,
    mrope_positions,
    smart_resize,
)

MODEL_CONFIG = {"vision_config": {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}
HUB_MIN, HUB_MAX = 3136, 12845056  # Qwen2.5-VL's preprocessor_config.json


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Noise over a gradient: edges everywhere for the bicubic filter, and every channel differs."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 200, width)[None, :, None] + np.linspace(0, 50, height)[:, None, None]
    pixels = np.clip(ramp + rng.integers(0, 56, (height, width, 4)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGBA").convert(mode)


def _pair(min_pixels: int, max_pixels: int) -> tuple[Qwen2VLImageProcessor, Qwen2VLImageProcessorPil]:
    ours = Qwen2VLImageProcessor.from_hf({"min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": 14,
                                          "temporal_patch_size": 2, "merge_size": 2}, MODEL_CONFIG)
    # A fresh size dict: HF's min_pixels / max_pixels arguments write into the class's default one.
    hf = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    return ours, hf


CASES = [  # (width, height, mode, min_pixels, max_pixels)
    (640, 480, "RGB", HUB_MIN, HUB_MAX),
    (333, 517, "RGB", HUB_MIN, HUB_MAX),  # neither side a multiple of 28
    (5, 7, "RGB", HUB_MIN, HUB_MAX),  # tiny: scaled up to min_pixels
    (1500, 1000, "RGB", 56 * 56, 28 * 28 * 16),  # large with a small budget: scaled down
    (1000, 30, "RGB", 56 * 56, 28 * 28 * 64),  # wide strip
    (41, 900, "RGB", 28 * 28 * 8, 28 * 28 * 32),  # tall strip, min_pixels above its area
    (120, 90, "L", HUB_MIN, HUB_MAX),  # grayscale: converted to RGB
    (97, 61, "RGBA", HUB_MIN, HUB_MAX),  # alpha dropped as Pillow's convert does
]


@pytest.mark.parametrize("width,height,mode,min_pixels,max_pixels", CASES)
def test_pixel_values_and_grid_match_hf(width, height, mode, min_pixels, max_pixels):
    ours, hf = _pair(min_pixels, max_pixels)
    image = _image(width, height, mode)
    got = ours.preprocess(image)
    want = hf(images=[image], return_tensors="np")
    assert got.grid_thw == tuple(want["image_grid_thw"][0].tolist())
    assert got.pixel_values.dtype == np.float32
    np.testing.assert_allclose(got.pixel_values, want["pixel_values"], atol=1e-6, rtol=0)
    t, h, w = got.grid_thw
    assert got.num_tokens == t * h * w // 4 == ours.num_tokens(height, width)
    assert got.num_tokens == hf.get_number_of_image_patches(height, width) // 4


def test_smart_resize_refuses_extreme_aspect_ratios():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 28, HUB_MIN, HUB_MAX)


def test_from_hf_reads_size_and_refuses_a_geometry_the_model_does_not_have():
    proc = Qwen2VLImageProcessor.from_hf({"size": {"shortest_edge": 100, "longest_edge": 5000}}, MODEL_CONFIG)
    assert (proc.min_pixels, proc.max_pixels, proc.patch_size, proc.merge_size) == (100, 5000, 14, 2)
    with pytest.raises(ValueError, match="patch_size=16"):
        Qwen2VLImageProcessor.from_hf({"patch_size": 16}, MODEL_CONFIG)


def test_mm_processor_kwargs_resize_as_hf_given_the_same_bounds():
    """vLLM's mm_processor_kwargs {min_pixels, max_pixels} on a processor: the pixels HF's
    processor makes with those bounds; a request may not raise max_pixels over the server's."""
    server, _ = _pair(HUB_MIN, 28 * 28 * 64)
    image = _image(900, 600)
    ours = server.with_kwargs({"max_pixels": 28 * 28 * 16, "min_pixels": 56 * 56}, "mm_processor_kwargs")
    _, hf = _pair(56 * 56, 28 * 28 * 16)
    got, want = ours.preprocess(image), hf(images=[image], return_tensors="np")
    assert got.grid_thw == tuple(want["image_grid_thw"][0].tolist())
    np.testing.assert_allclose(got.pixel_values, want["pixel_values"], atol=1e-6, rtol=0)
    assert got.num_tokens < server.preprocess(image).num_tokens
    for kwargs, message in [({"max_pixels": 28 * 28 * 65}, "at most 50176, the server's"),
                            ({"num_crops": 4}, "unknown key"), ({"min_pixels": 10}, "at least 784"),
                            ({"max_pixels": True}, "an integer"),
                            ({"min_pixels": 28 * 28 * 20, "max_pixels": 28 * 28 * 10}, "exceeds max_pixels")]:
        with pytest.raises(ValueError, match=message):
            server.with_kwargs(kwargs, "mm_processor_kwargs")
    # smart_resize rounds a scaled-up image's sides up: min_pixels at the server's max_pixels can
    # make an image larger than the encoder takes, which is refused (a 400 at the server).
    tight = server.with_kwargs({"min_pixels": 28 * 28 * 64}, "mm_processor_kwargs")
    with pytest.raises(ValueError, match="over the 256 the vision encoder takes"):
        tight.preprocess(_image(10, 353))
    from jaxserve.errors import InvalidRequestError
    from jaxserve.multimodal.images import ImageSupport
    from jaxserve.multimodal.media import MediaPolicy

    with pytest.raises(InvalidRequestError) as caught:
        ImageSupport(tight, 1, "<image>", MediaPolicy()).prepare_image(_image(10, 353), param="messages")
    assert caught.value.param == "messages"
    # The server's own flag may raise it (it sizes the encoder).
    assert server.with_kwargs({"max_pixels": HUB_MAX}, "--mm-processor-kwargs", capped=False).max_pixels == HUB_MAX


# ---- M-RoPE positions -----------------------------------------------------------------------------

IMAGE, VIDEO, START, END = 251, 252, 253, 254
TOKENS_PER_SECOND = 2


@pytest.fixture(scope="module")
def hf_model() -> Qwen2_5_VLModel:
    config = Qwen2_5_VLConfig(
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16,
                       "tokens_per_second": TOKENS_PER_SECOND},
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}},
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return Qwen2_5_VLModel(config).eval()


def _prompt(pieces: list) -> list[int]:
    """Text pieces are lists of ids; a vision piece is (placeholder, grid) and becomes
    <|vision_start|> placeholder * tokens <|vision_end|>."""
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, tuple):
            token, (t, h, w) = piece
            ids += [START, *[token] * (t * h * w // 4), END]
        else:
            ids += piece
    return ids


PROMPTS = {
    "text only": ([[1, 2, 3, 4, 5]], [], []),
    "one image": ([[1, 2, 3], (IMAGE, (1, 12, 16)), [7, 8, 9, 10]], [(1, 12, 16)], []),
    "two images of different sizes": ([[1, 2], (IMAGE, (1, 20, 6)), [5], (IMAGE, (1, 4, 8)), [7, 8, 9]],
                                      [(1, 20, 6), (1, 4, 8)], []),
    "image at the end": ([[1, 2], (IMAGE, (1, 6, 10))], [(1, 6, 10)], []),
    "image and video": ([[1], (IMAGE, (1, 8, 8)), [4, 5], (VIDEO, (3, 4, 6)), [6]], [(1, 8, 8)], [(3, 4, 6)]),
}


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_mrope_positions_match_hf_get_rope_index(hf_model, name):
    pieces, images, videos = PROMPTS[name]
    ids = _prompt(pieces)
    seconds = [2.5] * len(videos)
    positions, delta = mrope_positions(ids, images, IMAGE, 2, videos=videos, video_token_id=VIDEO,
                                       second_per_grid_ts=seconds, tokens_per_second=TOKENS_PER_SECOND)
    input_ids = torch.tensor([ids])
    kinds = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    with torch.no_grad():
        want, want_delta = hf_model.get_rope_index(
            input_ids, mm_token_type_ids=kinds,
            image_grid_thw=torch.tensor(images) if images else None,
            video_grid_thw=torch.tensor(videos) if videos else None,
            second_per_grid_ts=torch.tensor(seconds) if videos else None)
    assert positions.dtype == np.int32 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, want[:, 0].numpy())
    assert delta == int(want_delta[0, 0])


def test_mrope_positions_refuse_placeholders_that_disagree_with_the_grids():
    ids = _prompt([[1], (IMAGE, (1, 4, 4)), [2]])
    with pytest.raises(ValueError, match="consecutive placeholder"):
        mrope_positions(ids, [(1, 4, 8)], IMAGE, 2)
    with pytest.raises(ValueError, match="more image placeholders"):
        mrope_positions(ids, [], IMAGE, 2)
    with pytest.raises(ValueError, match="2 grids given for 1 images"):
        mrope_positions(ids, [(1, 4, 4), (1, 4, 4)], IMAGE, 2)


def test_mrope_frequency_axes_follow_hf_sections():
    np.testing.assert_array_equal(mrope_frequency_axes([2, 3, 3]), [0, 0, 1, 1, 1, 2, 2, 2])
    assert mrope_frequency_axes([16, 24, 24]).shape == (64,)
