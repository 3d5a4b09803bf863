"""Image-side parity for LLaVA-OneVision (SigLIP tower) and LLaVA-NeXT (CLIP tower). Tiny random-init HF
models saved with save_pretrained are loaded by jaxserve.weights.vision_loader; for the tiles HF's own
image processor makes of images of several sizes and aspect ratios, encode_tiles (all images' tiles
in one zero-padded batch, as the engine runs them) + pack_image_features per image give the rows of
HF's get_image_features within 1e-4 in float32: one image; two images each cut into its anyres
grid (unpadding, and OneVision's anyres_max bilinear downsampling); and OneVision's multi-image
mode (base tile only). Both checkpoint layouts load to the same weights, and a missing tensor is
named."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from PIL import Image
from safetensors.numpy import load_file, save_file

from jaxserve.models.config import UnsupportedModelError
from jaxserve.models.vision import (
    VisionConfig,
    bilinear_resize,
    num_tiles,
    pack_image_features,
    vision_config_from_hf,
)
from jaxserve.weights.safetensors_dir import WeightsError
from jaxserve.weights.source import resolve
from jaxserve.weights.vision_loader import load_vision, random_vision, vision_tensor

# A tile's side in pixels: OneVision's is no multiple of the patch (SigLIP-so400m reads 27x27 patches
# of 14 from 384 pixels), NeXT's is. 4x4 patches of 14 either way.
TILE = {"onevision": 60, "next": 56}
GRID = [[1, 1], [1, 2], [2, 1], [2, 2], [1, 3], [3, 1]]  # image_grid_pinpoints in tiles
# (height, width). With 4x4 features per tile and anyres_max_2 (OneVision): (48, 128) takes a 1x3
# grid unpadded from 4x12 to 4x10, which OneVision shrinks to 3x8; (30, 100) a 1x2 grid unpadded to
# 2x8 and kept; (100, 100) a 2x2 grid, which OneVision shrinks from 8x8 to 5x5.
SINGLE = [[(48, 128)]]
PAIR = [[(30, 100)], [(100, 100)]]  # two prompts of one image each: both cut into grids
MULTI = [[(40, 150), (60, 100)]]  # one prompt of two images: OneVision encodes base tiles only
CASES = [("onevision", -1), ("next", -2), ("next", [0, -1])]
# rows per image: the base tile's 16, the (unpadded, shrunk) grid and a newline per grid row
ROWS = {"onevision": {(48, 128): 16 + 3 * 8 + 3, (30, 100): 16 + 2 * 8 + 2, (100, 100): 16 + 5 * 5 + 5},
        "next": {(48, 128): 16 + 4 * 10 + 4, (30, 100): 16 + 2 * 8 + 2, (100, 100): 16 + 8 * 8 + 8}}


def _tiny(kind: str, feature_layer: int | list[int], tmp_path):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )

    torch.manual_seed(0)
    pinpoints = [[h * TILE[kind], w * TILE[kind]] for h, w in GRID]
    tower = dict(image_size=TILE[kind], patch_size=14, hidden_size=32, intermediate_size=48, num_attention_heads=4)
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128)
    if kind == "onevision":
        cfg = LlavaOnevisionConfig(vision_config=SiglipVisionConfig(**tower, num_hidden_layers=2),
                                   text_config=Qwen2Config(**text), image_grid_pinpoints=pinpoints,
                                   vision_aspect_ratio="anyres_max_2", vision_feature_layer=feature_layer,
                                   image_token_index=127, video_token_index=126)
        model = LlavaOnevisionForConditionalGeneration(cfg)
    else:
        cfg = LlavaNextConfig(vision_config=CLIPVisionConfig(**tower, num_hidden_layers=3, projection_dim=16),
                              text_config=LlamaConfig(**text), image_grid_pinpoints=pinpoints,
                              vision_feature_layer=feature_layer, vision_feature_select_strategy="default",
                              image_token_index=127)
        model = LlavaNextForConditionalGeneration(cfg)
    model = model.float().eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _processor(kind: str):
    if kind == "onevision":
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        tile = TILE[kind]
        return LlavaOnevisionImageProcessorPil(size={"height": tile, "width": tile},
                                               image_grid_pinpoints=[[h * tile, w * tile] for h, w in GRID])
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tile = TILE[kind]
    return LlavaNextImageProcessorPil(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                      image_grid_pinpoints=[[h * tile, w * tile] for h, w in GRID])


def _images(prompts: list[list[tuple[int, int]]]) -> list[list[Image.Image]]:
    rng = np.random.default_rng(1)
    return [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
            for sizes in prompts]


def _ours(model, cfg: VisionConfig, pixel_values: np.ndarray, image_sizes: np.ndarray,
          multi_image: list[bool]) -> list[np.ndarray]:
    counts = [num_tiles(tuple(size), cfg, multi) for size, multi in zip(image_sizes, multi_image)]
    tiles = np.concatenate([pv[:n] for pv, n in zip(pixel_values, counts)])
    bucket = -(-len(tiles) // 8) * 8  # zero tiles pad the batch to a bucket; their rows are dropped
    tiles = np.concatenate([tiles, np.zeros((bucket - len(tiles), *tiles.shape[1:]), tiles.dtype)])
    features = np.asarray(model.encode_tiles(jnp.asarray(tiles)))
    assert features.shape == (bucket, cfg.tokens_per_tile, cfg.text_hidden_size)
    newline = np.asarray(model.image_newline[...])
    starts = np.cumsum([0, *counts])
    return [pack_image_features(features[a:b], tuple(size), newline, cfg)
            for a, b, size in zip(starts, starts[1:], image_sizes)]


@pytest.mark.parametrize("kind,feature_layer", CASES, ids=[f"{k}{f}" for k, f in CASES])
def test_image_features_match_hf(kind, feature_layer, tmp_path):
    hf = _tiny(kind, feature_layer, tmp_path)
    source = resolve(tmp_path)
    cfg = vision_config_from_hf(source.config)
    assert cfg is not None and cfg.tower == ("siglip" if kind == "onevision" else "clip")
    assert cfg.num_layers_used == (3 if feature_layer == [0, -1] else 2)
    model = load_vision(source, cfg, jnp.float32)
    processor = _processor(kind)
    groups = [SINGLE, PAIR] + ([MULTI] if kind == "onevision" else [])
    for prompts in groups:
        images = _images(prompts)
        inputs = processor(images if kind == "onevision" else [im for ims in images for im in ims],
                           return_tensors="np")
        pixel_values, image_sizes = inputs["pixel_values"], inputs["image_sizes"]
        multi = [len(ims) > 1 for ims in images for _ in ims]
        kwargs = {"batch_num_images": torch.tensor([len(ims) for ims in images])} if kind == "onevision" else {}
        with torch.no_grad():
            ref = hf.model.get_image_features(pixel_values=torch.from_numpy(pixel_values),
                                              image_sizes=torch.from_numpy(image_sizes), **kwargs).pooler_output
        ours = _ours(model, cfg, pixel_values, image_sizes, multi)
        assert len(ours) == len(ref) == len(multi)
        for got, want, size, is_multi in zip(ours, ref, image_sizes, multi):
            assert got.shape == tuple(want.shape) == (17 if is_multi else ROWS[kind][tuple(size)], cfg.text_hidden_size)
            np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)


def test_bilinear_resize_matches_torch():
    rng = np.random.default_rng(0)
    for shape, size in [((3, 8, 8), (5, 5)), ((2, 6, 8), (4, 6)), ((2, 4, 12), (3, 9)), ((1, 5, 7), (8, 11)),
                        ((2, 9, 4), (9, 2))]:
        x = rng.standard_normal(shape).astype(np.float32)
        want = torch.nn.functional.interpolate(torch.from_numpy(x)[None], list(size), mode="bilinear")[0].numpy()
        np.testing.assert_allclose(bilinear_resize(x, *size), want, atol=1e-6, rtol=0)


def _rewrite(src, dst, rename, drop: str | None = None) -> None:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    save_file({rename(k): v for k, v in tensors.items() if k != drop}, dst / "model.safetensors")


def test_checkpoint_layouts_load_alike_and_missing_tensor_is_named(tmp_path):
    _tiny("onevision", -1, tmp_path / "saved")
    saved = tmp_path / "saved"
    names = list(load_file(saved / "model.safetensors"))
    assert "vision_tower.encoder.layers.0.self_attn.q_proj.weight" in names  # 5.17 drops vision_model.
    hub = lambda k: k.replace("vision_tower.", "vision_tower.vision_model.", 1)  # noqa: E731
    memory = lambda k: "model." + k if vision_tensor(k) else k  # noqa: E731
    _rewrite(saved, tmp_path / "hub", hub)
    _rewrite(saved, tmp_path / "memory", memory)  # transformers' own names: model.vision_tower.encoder...
    cfg = vision_config_from_hf(json.loads((saved / "config.json").read_text()))
    trees = []
    for layout in ("saved", "hub", "memory"):
        model = load_vision(resolve(tmp_path / layout), cfg, jnp.float32)
        trees.append(model)
    flat = [dict(nnx.to_flat_state(nnx.state(m))) for m in trees]
    for other in flat[1:]:
        assert other.keys() == flat[0].keys()
        for key in flat[0]:
            np.testing.assert_array_equal(np.asarray(other[key][...]), np.asarray(flat[0][key][...]))
    missing = "vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias"
    _rewrite(saved, tmp_path / "broken", hub, drop="vision_tower.encoder.layers.1.mlp.fc2.bias")
    with pytest.raises(WeightsError, match=missing.replace(".", r"\.")):
        load_vision(resolve(tmp_path / "broken"), cfg, jnp.float32)
    assert vision_tensor("model.image_newline") and vision_tensor("multi_modal_projector.linear_1.weight")
    assert not vision_tensor("language_model.model.layers.0.mlp.up_proj.weight")
    assert not vision_tensor("lm_head.weight")
    dummy = random_vision(cfg, jnp.float32)
    out = dummy.encode_tiles(jnp.zeros((2, 3, cfg.image_size, cfg.image_size)))
    assert out.shape == (2, cfg.tokens_per_tile, cfg.text_hidden_size) and bool(jnp.isfinite(out).all())


def test_config_parsing():
    assert vision_config_from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}) is None
    # transformers writes config.json as a diff against its defaults: an empty NeXT config is llava-v1.6's.
    cfg = vision_config_from_hf({"architectures": ["LlavaNextForConditionalGeneration"]})
    assert (cfg.tower, cfg.image_size, cfg.patch_size, cfg.num_layers) == ("clip", 336, 14, 24)
    assert cfg.feature_layers == (-2,) and cfg.select_strategy == "default"
    assert (cfg.tokens_per_tile, cfg.num_layers_used, cfg.vision_aspect_ratio) == (576, 23, None)
    ov = vision_config_from_hf({"architectures": ["LlavaOnevisionForConditionalGeneration"],
                                "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                                                  "intermediate_size": 4304, "patch_size": 14, "image_size": 384,
                                                  "num_hidden_layers": 26, "num_attention_heads": 16}})
    assert (ov.tokens_per_tile, ov.max_num_patches, ov.select_strategy) == (729, 9, "full")
    assert len(ov.image_grid_pinpoints) == 36 and ov.num_layers_used == 26
    with pytest.raises(UnsupportedModelError, match="full"):
        vision_config_from_hf({"architectures": ["LlavaNextForConditionalGeneration"],
                               "vision_feature_select_strategy": "full"})
