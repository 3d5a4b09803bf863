"""Qwen2-VL / Qwen2.5-VL image inputs on the host: an image becomes the flat patch rows the vision
encoder reads, and a prompt's tokens get the three-axis (temporal, height, width) M-RoPE positions
the language model rotates by. NumPy and Pillow only, so the server can prepare a request without
touching the device.

Both ports are HF-exact (transformers 5.17): `Qwen2VLImageProcessor.preprocess` matches
Qwen2VLImageProcessorPil's pixel_values and image_grid_thw bit for bit, and `mrope_positions`
matches Qwen2_5_VLModel.get_rope_index.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["ImageInput", "Qwen2VLImageProcessor", "mrope_frequency_axes", "mrope_positions", "smart_resize"]

# OpenAI CLIP's statistics: Qwen2-VL's defaults when preprocessor_config.json names none.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200

Grid = tuple[int, int, int]  # (t, h, w) in patches


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """One image as the vision encoder reads it."""

    pixel_values: np.ndarray  # float32 [t * h * w, channels * temporal_patch * patch * patch]
    grid_thw: Grid  # patches along time, height, width (t = 1 for a still image)
    num_tokens: int  # placeholder tokens in the prompt = encoder outputs: t * h * w // merge_size**2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """HF's smart_resize: the (height, width) nearest the image's, each a multiple of `factor`, with
    min_pixels <= area <= max_pixels (up to a factor's rounding), the aspect ratio kept as well as
    those allow. Raises ValueError for an aspect ratio above 200, as HF does."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio must be at most {MAX_ASPECT_RATIO}, got {max(height, width) / min(height, width)}"
            f" ({width}x{height})")
    # Python's round (half to even) as HF's; changing it moves some sizes by a whole factor.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


@dataclasses.dataclass(frozen=True)
class Qwen2VLImageProcessor:
    """Qwen2VLImageProcessor(Pil): resize to a multiple of patch_size * merge_size (bicubic, by
    Pillow), rescale, normalize, and flatten into patch rows, a still image repeated over the
    temporal patch."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    # The most patches one image may have: the vision encoder's compiled capacity, which a
    # request's own max_pixels (with_kwargs) may lower but never raise. None: max_pixels' patches.
    patch_limit: int | None = None

    @classmethod
    def from_hf(cls, preprocessor_config: dict[str, Any], model_config: dict[str, Any]) -> Qwen2VLImageProcessor:
        """From a checkpoint's preprocessor_config.json and config.json. min_pixels / max_pixels win
        over size's shortest_edge / longest_edge, as in HF. The patch geometry must agree with the
        vision encoder's (a mismatch would give the prompt the wrong number of image tokens), so a
        disagreement raises ValueError naming both values."""
        pre = preprocessor_config
        vision = model_config.get("vision_config") or {}
        size = pre.get("size") or {}
        geometry = {}
        for name, model_name in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                                 ("merge_size", "spatial_merge_size")):
            ours, theirs = pre.get(name), vision.get(model_name)
            if ours is not None and theirs is not None and int(ours) != int(theirs):
                raise ValueError(f"preprocessor_config.json has {name}={ours} but the model's vision_config has "
                                 f"{model_name}={theirs}")
            value = _first(ours, theirs)
            if value is not None:
                geometry[name] = int(value)
        flags = {k: bool(pre[k]) for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
                 if pre.get(k) is not None}
        processor = cls(
            **geometry,
            **flags,
            min_pixels=int(_first(pre.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"),
                                  MIN_PIXELS)),
            max_pixels=int(_first(pre.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"),
                                  MAX_PIXELS)),
            image_mean=tuple(float(v) for v in _first(pre.get("image_mean"), CLIP_MEAN)),
            image_std=tuple(float(v) for v in _first(pre.get("image_std"), CLIP_STD)),
            rescale_factor=float(_first(pre.get("rescale_factor"), 1 / 255)),
            resample=int(_first(pre.get("resample"), Image.Resampling.BICUBIC)),
        )
        if processor.min_pixels > processor.max_pixels:
            raise ValueError(f"min_pixels {processor.min_pixels} exceeds max_pixels {processor.max_pixels}")
        return processor

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def max_patches(self) -> int:
        """The most patches an image may have: what the vision encoder is compiled for."""
        return self.patch_limit if self.patch_limit is not None else self.max_pixels // self.patch_size**2

    def with_kwargs(self, kwargs: dict[str, Any], param: str, capped: bool = True) -> Qwen2VLImageProcessor:
        """This processor with vLLM's mm_processor_kwargs for Qwen2-VL applied: min_pixels and
        max_pixels (what an image is resized into). `capped`: a request's max_pixels may not exceed
        the server's (its vision encoder is compiled for that many patches); the server's own
        --mm-processor-kwargs sets it. ValueError naming `param` and the key when one is wrong."""
        unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels"})
        if unknown:
            raise ValueError(f"{param}: unknown key(s) {unknown}; Qwen2-VL's image processor takes min_pixels and "
                             "max_pixels")
        for key, value in kwargs.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < self.factor**2:
                raise ValueError(f"{param}.{key}: expected an integer of at least {self.factor**2} (one "
                                 f"{self.factor}x{self.factor} merged patch), got {value!r}")
        out = dataclasses.replace(self, **kwargs, patch_limit=self.max_patches if capped else None)
        if capped and out.max_pixels > self.max_pixels:
            raise ValueError(f"{param}.max_pixels: at most {self.max_pixels}, the server's (its vision encoder is "
                             f"compiled for images that size; --mm-processor-kwargs raises it), got {out.max_pixels}")
        if out.min_pixels > out.max_pixels:
            raise ValueError(f"{param}: min_pixels {out.min_pixels} exceeds max_pixels {out.max_pixels}")
        return out

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to."""
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def num_tokens(self, height: int, width: int) -> int:
        """Image tokens for an image of this size, without reading its pixels."""
        h, w = self.resized_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def preprocess(self, image: Image.Image | np.ndarray, multi_image: bool = False) -> ImageInput:
        """A PIL image (or a uint8 [height, width, channels] array) -> ImageInput. (An image reads
        the same alone or beside others: multi_image changes nothing.)"""
        if isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        if self.do_convert_rgb and image.mode != "RGB":
            # As HF: Pillow's convert, which drops alpha without compositing onto a background.
            image = image.convert("RGB")
        height, width = image.height, image.width
        if self.do_resize:
            h, w = self.resized_size(height, width)
            patches = (h // self.patch_size) * (w // self.patch_size)
            if patches > self.max_patches:
                # smart_resize rounds a scaled-up image's sides up: with min_pixels near max_pixels
                # its area may pass both.
                raise ValueError(f"a {width}x{height} image resizes to {w}x{h}, {patches} patches, over the "
                                 f"{self.max_patches} the vision encoder takes (min_pixels {self.min_pixels} scales "
                                 "it up that far; lower min_pixels)")
            # HF resizes even to the same size; Pillow then copies, so nothing differs.
            image = image.resize((w, h), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image)
        pixels = pixels[None] if pixels.ndim == 2 else np.transpose(pixels, (2, 0, 1))  # [C, H, W]
        if self.do_rescale:
            # float64 product, then float32: HF's rescale, to the last bit.
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            pixels = pixels.astype(np.float32) if not np.issubdtype(pixels.dtype, np.floating) else pixels
            mean = np.asarray(self.image_mean, pixels.dtype)[:, None, None]
            std = np.asarray(self.image_std, pixels.dtype)[:, None, None]
            pixels = (pixels - mean) / std
        return self._patchify(pixels)

    def _patchify(self, pixels: np.ndarray) -> ImageInput:
        """[C, H, W] -> rows of C x temporal x patch x patch values, merge_size x merge_size patch
        blocks contiguous (the encoder's merger reads each block as one token)."""
        pixels = np.asarray(pixels, dtype=np.float32)
        c, height, width = pixels.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if height % (p * m) or width % (p * m):
            raise ValueError(f"a {width}x{height} image is not a whole number of {p * m}-pixel blocks "
                             "(do_resize is off?)")
        gh, gw = height // p, width // p
        patches = pixels.reshape(c, gh // m, m, p, gw // m, m, p)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
        # A still image fills every temporal slot of its patch with the same frame.
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
        rows = np.ascontiguousarray(patches).reshape(gh * gw, c * tp * p * p)
        return ImageInput(rows, (1, gh, gw), gh * gw // m**2)


def mrope_positions(
    input_ids: Sequence[int],
    images: Sequence[Grid],
    image_token_id: int,
    spatial_merge_size: int,
    *,
    videos: Sequence[Grid] = (),
    video_token_id: int | None = None,
    second_per_grid_ts: Sequence[float] | None = None,
    tokens_per_second: int | None = None,
) -> tuple[np.ndarray, int]:
    """HF's Qwen2_5_VLModel.get_rope_index for one prompt: M-RoPE positions int32 [3, len]
    (temporal, height, width) and the delta decode continues from: the token at index i >= len
    (every generated token, and any later text) has position i + delta on all three axes.

    Text tokens count up on all three axes together. An image's tokens (its t*h*w / merge**2
    consecutive placeholders, in the encoder's output order: row-major over the merged grid) sit
    at start + (frame, row, column), and the text after it resumes at start + max(rows, columns).
    A video's frames step by tokens_per_second * int(second_per_grid_ts) on the temporal axis.
    Images are taken in order, each owning its own run of placeholders (HF instead groups runs of
    placeholders, which merges two images that touch; Qwen's template always puts
    <|vision_end|><|vision_start|> between them, where both agree). Raises ValueError when the
    placeholders and the grids disagree."""
    ids = np.asarray(input_ids, dtype=np.int64)
    n = len(ids)
    if videos and (video_token_id is None or tokens_per_second is None):
        raise ValueError("videos need video_token_id and tokens_per_second")
    intervals = list(second_per_grid_ts) if second_per_grid_ts is not None else [1] * len(videos)
    if len(intervals) != len(videos):
        raise ValueError(f"{len(intervals)} second_per_grid_ts for {len(videos)} videos")
    queues = {image_token_id: list(images), **({video_token_id: list(videos)} if videos else {})}
    taken = {key: 0 for key in queues}
    pieces: list[np.ndarray] = []
    pos, i, text_start = 0, 0, 0
    while i <= n:
        token = int(ids[i]) if i < n else None
        if token is not None and token not in queues:
            i += 1
            continue
        if i > text_start:  # the text before this image (or the prompt's end)
            length = i - text_start
            pieces.append(np.broadcast_to(np.arange(pos, pos + length), (3, length)))
            pos += length
        if token is None:
            break
        k = taken[token]
        if k == len(queues[token]):
            raise ValueError(f"the prompt has more {'image' if token == image_token_id else 'video'} placeholders "
                             f"than the {len(queues[token])} grids given")
        t, h, w = (int(v) for v in queues[token][k])
        taken[token] = k + 1
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        count = t * gh * gw
        if not np.all(ids[i:i + count] == token):
            raise ValueError(f"{'image' if token == image_token_id else 'video'} {k} of grid {(t, h, w)} needs "
                             f"{count} consecutive placeholder tokens at index {i}")
        interval = 1 if token == image_token_id else tokens_per_second * int(intervals[k])
        tt, hh, ww = np.meshgrid(np.arange(t) * interval, np.arange(gh), np.arange(gw), indexing="ij")
        pieces.append(np.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w) // spatial_merge_size
        i += count
        text_start = i
    for token, queue in queues.items():
        if taken[token] != len(queue):
            raise ValueError(f"{len(queue)} grids given for {taken[token]} "
                             f"{'images' if token == image_token_id else 'videos'} in the prompt")
    positions = np.concatenate(pieces, axis=1).astype(np.int32) if pieces else np.zeros((3, 0), np.int32)
    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta


def mrope_frequency_axes(mrope_section: Sequence[int]) -> np.ndarray:
    """Which position axis (0 temporal, 1 height, 2 width) rotates each of the language model's
    head_dim // 2 rotary frequencies: HF splits the frequencies into consecutive sections of
    mrope_section's sizes (Qwen2.5-VL: [16, 24, 24] for head_dim 128) and section j takes axis
    j % 3. The cos/sin halves are then duplicated as in ordinary rotate-half RoPE, so frequency f
    and f + head_dim // 2 share an axis."""
    return np.concatenate([np.full(size, j % 3, np.int32) for j, size in enumerate(mrope_section)])
