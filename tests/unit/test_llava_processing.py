"""LLaVA-OneVision / LLaVA-NeXT host inputs match HF transformers: the PIL image processors'
pixel_values and image_sizes (the backend HF uses without torchvision), and the number of
`<image>` tokens the full HF processor expands a prompt's `<image>` into."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

from jaxserve.multimodal.llava_processing import LlavaImageProcessor

IMAGE_TOKEN_ID = 1
TINY_PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]
SIGLIP = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]

CASES = {  # name: (preprocessor_config.json, config.json)
    # The HF class defaults (OneVision's are CLIP's mean/std; its checkpoints name SigLIP's).
    "onevision-defaults": ({}, {"model_type": "llava_onevision"}),
    "onevision-checkpoint": ({**SIGLIP, "size": {"height": 384, "width": 384}, "resample": 3},
                             {"model_type": "llava_onevision", "vision_feature_select_strategy": "full",
                              "vision_aspect_ratio": "anyres_max_9",
                              "vision_config": {"model_type": "siglip_vision_model", "image_size": 384,
                                                "patch_size": 14}}),
    # anyres_max_1: every multi-tile grid is above the limit, so the shrinking rule always runs.
    "onevision-tiny": ({**SIGLIP, "size": {"height": 56, "width": 56}, "image_grid_pinpoints": TINY_PINPOINTS},
                       {"model_type": "llava_onevision", "image_grid_pinpoints": TINY_PINPOINTS,
                        "vision_aspect_ratio": "anyres_max_1",
                        "vision_config": {"model_type": "siglip_vision_model", "image_size": 56, "patch_size": 14}}),
    # NeXT's class default tiles are 224 (cut from 336-multiple canvases: partial edge tiles).
    "next-defaults": ({}, {"model_type": "llava_next",
                           "vision_config": {"model_type": "clip_vision_model", "image_size": 224, "patch_size": 14}}),
    "next-checkpoint": ({"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
                         "image_grid_pinpoints": NEXT_PINPOINTS, "resample": 3},
                        {"model_type": "llava_next", "image_grid_pinpoints": NEXT_PINPOINTS}),
    "next-tiny": ({"size": {"shortest_edge": 56}, "crop_size": {"height": 56, "width": 56},
                   "image_grid_pinpoints": TINY_PINPOINTS},
                  {"model_type": "llava_next", "image_grid_pinpoints": TINY_PINPOINTS,
                   "vision_config": {"model_type": "clip_vision_model", "image_size": 56, "patch_size": 14}}),
}
SHAPES = {  # name: (height, width)
    "square": (300, 300), "wide-3:1": (150, 450), "tall-1:2": (400, 200), "tiny": (7, 10), "large": (1000, 700),
}


def _image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    return Image.fromarray(pixels, "RGBA").convert(mode)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level vocabulary is all the processors need: they count `<image>` ids."""
    vocab = {"[UNK]": 0, "<image>": IMAGE_TOKEN_ID, "<video>": 2, "hi": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                   extra_special_tokens={"image_token": "<image>", "video_token": "<video>"})


def _hf_processor(name: str, tokenizer):
    """The HF processor a checkpoint with these configs loads (processor_config.json's values
    derived from config.json as the hub's llava-hf checkpoints carry them)."""
    pre, model = CASES[name]
    vision = model.get("vision_config") or {}
    if model["model_type"] == "llava_onevision":
        patches = vision.get("image_size", 384) // vision.get("patch_size", 14)
        # The processor insists on a video processor, which needs torchvision; images never use it.
        no_video = object.__new__(transformers.BaseVideoProcessor)
        return LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessorPil(**pre), tokenizer=tokenizer, video_processor=no_video,
            num_image_tokens=patches**2, vision_feature_select_strategy=model.get("vision_feature_select_strategy",
                                                                                  "full"),
            vision_aspect_ratio=model.get("vision_aspect_ratio", "anyres_max_9"))
    return LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(**pre), tokenizer=tokenizer, patch_size=vision.get("patch_size", 14),
        vision_feature_select_strategy="default", num_additional_image_tokens=1)  # CLIP's CLS


@pytest.mark.parametrize("name", CASES)
def test_pixels_image_size_and_token_count_match_hf(name, tokenizer):
    ours = LlavaImageProcessor.from_hf(*CASES[name])
    hf = _hf_processor(name, tokenizer)
    for shape_name, (height, width) in SHAPES.items():
        image = _image(height, width)
        got = ours.preprocess(image)
        want = hf(images=image, text="<image>\nhi", return_tensors="np")
        assert got.pixel_values.dtype == np.float32
        # One image: HF's batch holds exactly its tiles, no padding tiles.
        assert got.pixel_values.shape == want["pixel_values"][0].shape, shape_name
        np.testing.assert_allclose(got.pixel_values, want["pixel_values"][0], atol=1e-6, rtol=0, err_msg=shape_name)
        assert got.image_size == (height, width) == tuple(want["image_sizes"][0].tolist())
        assert got.num_tokens == int((want["input_ids"] == IMAGE_TOKEN_ID).sum()), shape_name


@pytest.mark.parametrize("name", CASES)
def test_token_counts_match_hf_for_many_sizes(name, tokenizer):
    """Sizes around tile boundaries, extreme strips and huge images (which OneVision's anyres_max_9
    shrinks), by HF's own counting without pixels. 1536x1000 unpads a 4x3-tile grid to just above
    9 tiles' worth: within the 10% slack, so not shrunk."""
    ours = LlavaImageProcessor.from_hf(*CASES[name])
    hf = _hf_processor(name, tokenizer)
    sides = [1, 7, 55, 56, 57, 111, 200, 335, 336, 337, 384, 385, 700, 1009, 2000, 4321]
    sizes = [(h, w) for h in sides for w in sides] + [(1536, 1000), (1000, 1536)]
    want = hf._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [ours.num_tokens(h, w) for h, w in sizes] == want


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK"])
def test_any_mode_is_converted_as_hf_converts_it(mode, tokenizer):
    for name in ("onevision-tiny", "next-tiny"):
        ours = LlavaImageProcessor.from_hf(*CASES[name])
        image = _image(90, 61, mode)
        want = _hf_processor(name, tokenizer).image_processor(images=image, return_tensors="np")
        np.testing.assert_allclose(ours.preprocess(image).pixel_values, want["pixel_values"][0], atol=1e-6, rtol=0)


def test_the_onevision_shrinking_rule_is_exercised():
    """anyres_max_1 on a 2x2 grid of 4x4 patches: 8x8 features shrink to floor(8 / 2) = 4 per side."""
    ours = LlavaImageProcessor.from_hf(*CASES["onevision-tiny"])
    assert ours.num_tokens(112, 112) == 16 + 4 * 4 + 4
    nine = LlavaImageProcessor.from_hf(CASES["onevision-tiny"][0],
                                       {**CASES["onevision-tiny"][1], "vision_aspect_ratio": "anyres_max_9"})
    assert nine.num_tokens(112, 112) == 16 + 8 * 8 + 8


@pytest.mark.parametrize("pre,model,match", [
    ({"image_grid_pinpoints": [[56, 56]]}, {"image_grid_pinpoints": [[56, 112]]}, "different image_grid_pinpoints"),
    ({}, {"model_type": "llava_next"}, "vision tower reads 336x336"),  # 224 tiles for a 336 tower
    ({}, {"vision_aspect_ratio": "anyres"}, "anyres_max_N"),
    ({}, {"vision_feature_select_strategy": "cls"}, "'default' or 'full'"),
    ({"size": {"shortest_edge": 384, "longest_edge": 800}}, {}, "size must be"),
    ({}, {"model_type": "llava"}, "model_type must be"),
])
def test_configs_the_model_cannot_read_are_refused(pre, model, match):
    with pytest.raises(ValueError, match=match):
        LlavaImageProcessor.from_hf(pre, {"model_type": "llava_onevision", **model})


@pytest.mark.parametrize("name", ["onevision-checkpoint", "onevision-tiny"])
def test_onevision_multi_image_prompts_match_hf(name, tokenizer):
    """Several images in one prompt: OneVision reads each as one square-padded tile (HF's
    batch_num_images > 1), and the processor expands each `<image>` into one tile plus a newline."""
    pre, model = CASES[name]
    ours = LlavaImageProcessor.from_hf(pre, model)
    images = [_image(*SHAPES["wide-3:1"], seed=1), _image(*SHAPES["tall-1:2"], seed=2)]
    hf = _hf_processor(name, tokenizer)
    out = hf(images=[images], text=["<image>\n<image>\nhi"], return_tensors="np")
    expected = out["input_ids"][0].tolist().count(IMAGE_TOKEN_ID)
    got = [ours.preprocess(image, multi_image=True) for image in images]
    assert sum(g.num_tokens for g in got) == expected
    for i, g in enumerate(got):
        assert g.pixel_values.shape[0] == 1
        np.testing.assert_allclose(g.pixel_values[0], out["pixel_values"][i][0], atol=1e-6)
        assert tuple(out["image_sizes"][i]) == g.image_size
