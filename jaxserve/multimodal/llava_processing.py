"""LLaVA-OneVision and LLaVA-NeXT image inputs on the host: an image becomes the "anyres" tiles the
vision tower reads (the whole image resized to one tile, then the tiles of a best-fit canvas), and
the number of `<image>` placeholder tokens the prompt needs for it. NumPy and Pillow only.

HF-exact (transformers 5.17): `preprocess` matches LlavaOnevisionImageProcessorPil /
LlavaNextImageProcessorPil for one image (pixel_values of its real tiles, image_sizes), and
`num_tokens` matches the count LlavaOnevisionProcessor / LlavaNextProcessor expand `<image>` into.

Only HF's single-image path: OneVision treats an image that shares its prompt with other images
differently (padded to a square in the mean color, no tiles, one tile's grid + 1 newline tokens);
that path is not ported here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from PIL import Image

__all__ = ["ImageInput", "Kind", "LlavaImageProcessor", "select_best_resolution"]

Kind = Literal["llava_onevision", "llava_next"]
Size = tuple[int, int]  # (height, width) in pixels

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_ONEVISION_PINPOINTS = tuple((384 * h, 384 * w) for h in range(1, 7) for w in range(1, 7))
_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))

# The HF image-processor class defaults (both use CLIP's statistics; OneVision checkpoints name
# SigLIP's 0.5 in preprocessor_config.json) and the model-config defaults, per kind.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llava_onevision": dict(size={"height": 384, "width": 384}, crop_size=None, do_center_crop=False,
                            pinpoints=_ONEVISION_PINPOINTS, tower=("siglip_vision_model", 384, 14),
                            strategy="full"),
    "llava_next": dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, do_center_crop=True,
                       pinpoints=_NEXT_PINPOINTS, tower=("clip_vision_model", 336, 14), strategy="default"),
}
# (image_size, patch_size) of a vision_config that names its tower but not these keys.
_TOWER_DEFAULTS = {"clip_vision_model": (224, 32), "siglip_vision_model": (224, 16)}
_ANYRES_MAX = "anyres_max_"


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """One image as the vision tower reads it."""

    pixel_values: np.ndarray  # float32 [num_tiles, 3, tile, tile]: the whole image first, then the grid row-major
    image_size: Size  # the original (height, width): the model unpads its features by it
    num_tokens: int  # `<image>` placeholders in the prompt = features the model packs for this image


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def select_best_resolution(original_size: Size, possible_resolutions: Sequence[Size]) -> Size:
    """HF's choice of anyres canvas: the most image pixels kept after fitting, then the least canvas
    wasted; ties go to the earlier pinpoint (the model repeats this choice, so the order matters)."""
    height, width = original_size
    best, best_effective, best_wasted = None, 0, float("inf")
    for h, w in possible_resolutions:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = h * w - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (h, w), effective, wasted
    return best


@dataclasses.dataclass(frozen=True)
class LlavaImageProcessor:
    """The anyres preprocessing shared by LLaVA-NeXT and LLaVA-OneVision (HF's two PIL processors
    are the same code) plus each processor's own placeholder-token count."""

    kind: Kind
    grid_pinpoints: tuple[Size, ...]  # canvases the tiles may cover, (height, width)
    size: Size | int  # each tile is resized to (height, width), or an int: its shortest edge
    crop_size: Size | None
    do_resize: bool
    do_center_crop: bool
    do_rescale: bool
    do_normalize: bool
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resample: int
    vision_image_size: int
    vision_patch_size: int
    select_strategy: str  # "default" drops the tower's first (CLS) feature, "full" keeps all
    num_additional_image_tokens: int  # NeXT: features per tile beyond the grid (CLIP's CLS)
    max_num_patches: int | None  # OneVision's anyres_max_N; None for NeXT

    def with_kwargs(self, kwargs: dict[str, Any], param: str, capped: bool = True) -> LlavaImageProcessor:
        """vLLM's mm_processor_kwargs: LLaVA's tiling is the checkpoint's own, so none is taken
        (ValueError naming `param` for any key)."""
        if kwargs:
            raise ValueError(f"{param}: LLaVA's image processor takes no options (its tiling is the checkpoint's); "
                             f"got {sorted(kwargs)}")
        return self

    @classmethod
    def from_hf(cls, preprocessor_config: dict[str, Any], model_config: dict[str, Any]) -> LlavaImageProcessor:
        """From a checkpoint's preprocessor_config.json and config.json; a missing key takes the HF
        class default. Raises ValueError when the tiles would not be what the vision tower reads."""
        kind = model_config.get("model_type")
        if kind not in _DEFAULTS:
            raise ValueError(f"model_type must be one of {sorted(_DEFAULTS)}, got {kind!r}")
        pre, defaults = preprocessor_config, _DEFAULTS[kind]
        tower, image_size, patch_size = _vision_tower(kind, model_config.get("vision_config"))
        processor = cls(
            kind=kind,
            grid_pinpoints=_pinpoints(pre, model_config, defaults["pinpoints"]),
            size=_size(_first(pre.get("size"), defaults["size"])),
            crop_size=_crop_size(_first(pre.get("crop_size"), defaults["crop_size"])),
            do_resize=bool(_first(pre.get("do_resize"), True)),
            do_center_crop=bool(_first(pre.get("do_center_crop"), defaults["do_center_crop"])),
            do_rescale=bool(_first(pre.get("do_rescale"), True)),
            do_normalize=bool(_first(pre.get("do_normalize"), True)),
            rescale_factor=float(_first(pre.get("rescale_factor"), 1 / 255)),
            image_mean=_per_channel(_first(pre.get("image_mean"), CLIP_MEAN)),
            image_std=_per_channel(_first(pre.get("image_std"), CLIP_STD)),
            resample=int(_first(pre.get("resample"), Image.Resampling.BICUBIC)),
            vision_image_size=image_size,
            vision_patch_size=patch_size,
            select_strategy=_strategy(_first(model_config.get("vision_feature_select_strategy"), defaults["strategy"])),
            # The hub's processor_config.json says 1 for NeXT's CLIP towers (HF's class default is 0,
            # one fewer than the model packs); the tower's CLS is the fact behind it.
            num_additional_image_tokens=1 if kind == "llava_next" and tower == "clip_vision_model" else 0,
            max_num_patches=_max_num_patches(model_config.get("vision_aspect_ratio")) if kind == "llava_onevision"
            else None,
        )
        processor._check_geometry()
        return processor

    def _check_geometry(self) -> None:
        # The model cuts its features into grids of vision_image_size tiles; other tiles would give
        # it a different number of features than the prompt has placeholders.
        tile, split = self.tile_size(), self._split_side()
        side = self.vision_image_size
        if tile != (side, side) or split != side:
            raise ValueError(f"image tiles are {tile[1]}x{tile[0]} cut every {split} pixels, but the vision tower "
                             f"reads {side}x{side} (vision_config.image_size)")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError(f"image_mean and image_std need 3 values, got {self.image_mean}, {self.image_std}")

    @property
    def reads_multi_image(self) -> bool:
        """Whether an image reads differently beside others in its prompt (OneVision: one tile)."""
        return self.kind == "llava_onevision"

    def tile_size(self) -> Size:
        """(height, width) of every tile in pixel_values."""
        if self.do_center_crop:
            return self.crop_size
        return self.size if isinstance(self.size, tuple) else (self.size, self.size)

    def num_tokens(self, height: int, width: int) -> int:
        """`<image>` placeholders for an image of this size, without reading its pixels: the whole
        image's grid, plus the anyres grid with its padding rows/columns removed, plus one newline
        per remaining row (OneVision: after shrinking a grid above anyres_max_N tiles' worth)."""
        tile_h, tile_w = self.tile_size()
        canvas_h, canvas_w = select_best_resolution((height, width), self.grid_pinpoints)
        if self.kind == "llava_next":
            rows, cols = tile_h // self.vision_patch_size, tile_w // self.vision_patch_size
            base = rows * cols + self.num_additional_image_tokens
        else:  # HF: int(sqrt(num_image_tokens)), num_image_tokens = (image_size // patch_size) ** 2
            rows = cols = self.vision_image_size // self.vision_patch_size
            base = rows * cols
        unpadded, newlines = self._unpadded_features(
            height, width, rows * (canvas_h // tile_h), cols * (canvas_w // tile_w), rows)
        total = base + unpadded + newlines
        # "default": the model drops every tile's first feature (CLS). Only the whole image's CLS was
        # counted (num_additional_image_tokens), so one comes off; OneVision subtracts it too though
        # it counted none (HF's rule, kept).
        return total - 1 if self.select_strategy == "default" else total

    def _unpadded_features(self, height: int, width: int, cur_h: int, cur_w: int, rows: int) -> tuple[int, int]:
        """Features of the anyres grid once the rows/columns that only saw the canvas padding are cut,
        and the number of rows (each ends with a newline feature). The same arithmetic as the
        model's unpad_image: round(..., 7) then floor, not the ceil the pixel resize uses."""
        if width / height > cur_w / cur_h:
            new_h = int(round(height * (cur_w / width), 7))
            cur_h -= (cur_h - new_h) // 2 * 2
        else:
            new_w = int(round(width * (cur_h / height), 7))
            cur_w -= (cur_w - new_w) // 2 * 2
        unpadded, newlines = cur_h * cur_w, cur_h
        if self.max_num_patches is not None:
            # OneVision bilinearly shrinks a grid above max_num_patches tiles (10% slack) to
            # floor(side / ratio); float floor division as HF, so keep the float `//`.
            ratio = math.sqrt(cur_h * cur_w / (self.max_num_patches * rows**2))
            if ratio > 1.1:
                unpadded = int(cur_h // ratio) * int(cur_w // ratio)
                newlines = int(cur_h // ratio)
        return unpadded, newlines

    def preprocess(self, image: Image.Image, multi_image: bool = False) -> ImageInput:
        """A PIL image in any mode -> its tiles, original size and placeholder count. multi_image:
        the image is one of several in its prompt, which OneVision reads as one tile of the whole
        image padded to a square (HF's batch_num_images > 1)."""
        if image.mode != "RGB":
            # As HF's convert_to_rgb: Pillow's convert, which drops alpha without compositing.
            image = image.convert("RGB")
        pixels = np.asarray(image)  # uint8 [H, W, 3]; tiles stay uint8 until rescale, as in HF
        height, width = pixels.shape[:2]
        if multi_image and self.kind == "llava_onevision":
            side = self.vision_image_size // self.vision_patch_size
            count = side * side + 1  # one tile's features and one newline
            tile = self._finish_tile(_pad_square(pixels, tuple(int(m * 255) for m in self.image_mean)))
            return ImageInput(tile[None], (height, width), count - 1 if self.select_strategy == "default" else count)
        tiles = [self._finish_tile(tile) for tile in self._tiles(pixels)]
        return ImageInput(np.stack(tiles), (height, width), self.num_tokens(height, width))

    def _split_side(self) -> int:
        # HF cuts the canvas by crop_size's height even when do_center_crop is off.
        if self.crop_size is not None:
            return self.crop_size[0]
        return self.size[0] if isinstance(self.size, tuple) else self.size

    def _tiles(self, pixels: np.ndarray) -> list[np.ndarray]:
        """The whole image squashed to one tile (the model's global view, so first), then the
        canvas tiles row-major (the model views them as [rows, cols] of the grid)."""
        canvas = select_best_resolution(pixels.shape[:2], self.grid_pinpoints)
        fitted = _resize(pixels, _fit_size(pixels.shape[:2], canvas), self.resample)
        # Centered on a black canvas of the pinpoint's size: the aspect ratio is kept, and the model
        # later drops the features of the padding rows/columns (unpad_image).
        padded = _pad_centered(fitted, canvas)
        side = self._split_side()
        whole_size = self.size if isinstance(self.size, tuple) else (self.size, self.size)
        whole = _resize(pixels, whole_size, self.resample)
        return [whole, *_divide(padded, side)]

    def _finish_tile(self, tile: np.ndarray) -> np.ndarray:
        """uint8 [h, w, 3] tile -> float32 [3, H, W]: resize, center crop, rescale, normalize."""
        if self.do_resize:
            tile = _resize(tile, self._resize_target(tile.shape[:2]), self.resample)
        if self.do_center_crop:
            tile = _center_crop(tile, self.crop_size)
        x = np.transpose(tile, (2, 0, 1))
        if self.do_rescale:
            # float64 product, then float32: HF's rescale, to the last bit.
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = x.astype(np.float32, copy=False)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, np.float32)[:, None, None]
            std = np.asarray(self.image_std, np.float32)[:, None, None]
            x = (x - mean) / std
        return x

    def _resize_target(self, shape: Size) -> Size:
        if isinstance(self.size, tuple):
            return self.size
        # shortest_edge: the short side to `size`, the long side scaled and floored (torchvision's rule).
        height, width = shape
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.size * long / short)
        return (new_long, self.size) if width <= height else (self.size, new_long)


def _pad_square(pixels: np.ndarray, color: tuple[int, ...]) -> np.ndarray:
    """uint8 [H, W, 3] centered on a square of `color` (HF's pad_to_square: the short side's
    leftover pixel goes after)."""
    height, width = pixels.shape[:2]
    side = max(height, width)
    out = np.empty((side, side, pixels.shape[2]), pixels.dtype)
    out[:] = np.asarray(color, pixels.dtype)
    top, left = (side - height) // 2, (side - width) // 2
    out[top:top + height, left:left + width] = pixels
    return out


def _vision_tower(kind: str, vision: dict[str, Any] | None) -> tuple[str, int, int]:
    """(model_type, image_size, patch_size) of the vision tower, with HF's config defaults."""
    if vision is None:
        return _DEFAULTS[kind]["tower"]
    tower = vision.get("model_type", _DEFAULTS[kind]["tower"][0])
    default_image_size, default_patch_size = _TOWER_DEFAULTS.get(tower, (None, None))
    image_size = _first(vision.get("image_size"), default_image_size)
    patch_size = _first(vision.get("patch_size"), default_patch_size)
    if image_size is None or patch_size is None:
        raise ValueError(f"vision_config of a {tower!r} tower needs image_size and patch_size")
    return tower, int(image_size), int(patch_size)


def _pinpoints(pre: dict[str, Any], model_config: dict[str, Any], default: tuple[Size, ...]) -> tuple[Size, ...]:
    # The processor tiles by preprocessor_config's list, the model re-derives the grid from
    # config.json's: two different lists would misplace every feature.
    ours, theirs = pre.get("image_grid_pinpoints"), model_config.get("image_grid_pinpoints")
    if ours is not None and theirs is not None and _as_sizes(ours) != _as_sizes(theirs):
        raise ValueError("preprocessor_config.json and config.json give different image_grid_pinpoints: "
                         f"{ours} vs {theirs}")
    pinpoints = _as_sizes(_first(ours, theirs, default))
    if not pinpoints:
        raise ValueError("image_grid_pinpoints is empty")
    return pinpoints


def _as_sizes(pairs: Sequence[Sequence[int]]) -> tuple[Size, ...]:
    return tuple((int(h), int(w)) for h, w in pairs)


def _size(value: Any) -> Size | int:
    """HF's size: {"height", "width"}, {"shortest_edge"}, an int (the shortest edge: neither
    processor defaults to square) or [height, width]."""
    if isinstance(value, dict) and value.get("height") and value.get("width"):
        return int(value["height"]), int(value["width"])
    if isinstance(value, dict) and value.get("shortest_edge") and not value.get("longest_edge"):
        return int(value["shortest_edge"])
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    raise ValueError(f"size must be {{height, width}} or {{shortest_edge}}, got {value}")


def _crop_size(value: Any) -> Size | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value, value
    size = _size(value)
    if isinstance(size, int):
        raise ValueError(f"crop_size must be {{height, width}}, got {value}")
    return size


def _per_channel(value: float | Sequence[float]) -> tuple[float, ...]:
    return (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)


def _strategy(value: str) -> str:
    if value not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {value!r}")
    return value


def _max_num_patches(value: str | None) -> int:
    value = _first(value, "anyres_max_9")
    number = value.removeprefix(_ANYRES_MAX) if isinstance(value, str) and value.startswith(_ANYRES_MAX) else ""
    if not number.isdigit() or int(number) == 0:
        raise ValueError(f"vision_aspect_ratio must be 'anyres_max_N' with N >= 1, got {value!r}")
    return int(number)


def _fit_size(shape: Size, target: Size) -> Size:
    """HF's get_patch_output_size: fit inside target keeping the aspect ratio; the fitted side is
    ceil'ed (so it may differ by one from the floor the feature count uses)."""
    height, width = shape
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def _resize(pixels: np.ndarray, size: Size, resample: int) -> np.ndarray:
    """uint8 [h, w, 3] -> uint8 [height, width, 3] by Pillow, as HF's PIL backend (Pillow copies
    when the size is unchanged, so resizing a finished tile again changes nothing)."""
    height, width = size
    return np.asarray(Image.fromarray(pixels).resize((width, height), resample=Image.Resampling(resample)))


def _pad_centered(pixels: np.ndarray, target: Size) -> np.ndarray:
    """Zero-pad to target, centered; the odd pixel goes after (bottom/right)."""
    (top, dh), (left, dw) = divmod(target[0] - pixels.shape[0], 2), divmod(target[1] - pixels.shape[1], 2)
    return np.pad(pixels, ((top, top + dh), (left, left + dw), (0, 0)))


def _divide(pixels: np.ndarray, side: int) -> list[np.ndarray]:
    """Row-major side x side tiles; edge tiles are smaller when side does not divide the canvas."""
    height, width = pixels.shape[:2]
    return [pixels[i:i + side, j:j + side] for i in range(0, height, side) for j in range(0, width, side)]


def _center_crop(pixels: np.ndarray, size: Size) -> np.ndarray:
    """HF's center_crop: floor offsets; an image smaller than the crop is first zero-padded to it
    (centered, the odd pixel before)."""
    height, width = pixels.shape[:2]
    crop_h, crop_w = size
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    pad_top, pad_left = math.ceil((new_h - height) / 2), math.ceil((new_w - width) / 2)
    canvas = np.zeros((new_h, new_w, pixels.shape[2]), pixels.dtype)
    canvas[pad_top:pad_top + height, pad_left:pad_left + width] = pixels
    top, left = top + pad_top, left + pad_left
    return canvas[max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]
