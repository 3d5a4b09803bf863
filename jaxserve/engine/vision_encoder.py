"""The vision encoding step of a vision-language model, one jitted program per input-size bucket,
compiled at start-up:
- LLaVA (`LlavaEncoder`): an image's tiles through the vision tower and projector (buckets of
  tiles), then packed on the host into one embedding per placeholder token
  (jaxserve.models.vision.pack_image_features: the packing depends on each image's size, so it is
  not a fixed-shape program);
- Qwen2.5-VL (`QwenVLEncoder`): an image's patch rows through its window-attention encoder
  (buckets of patches; the host computes the windows and segments), and the prompt's M-RoPE
  positions (jaxserve.multimodal.qwen2_vl_processing.mrope_positions).

An image's embeddings are kept by its hash (`EncoderCache`): a prompt that repeats an image, or a
request whose image another just sent, skips the tower; whether its prefix is also served from
the KV cache is the prefix cache's business (jaxserve.engine.embeds.cache_ids).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.engine.buckets import powers_of_two, smallest_at_least
from jaxserve.engine.embeds import ImageItem
from jaxserve.models.qwen2_vl_vision import Qwen2VisionTransformer, VisionLayout, vision_layout
from jaxserve.models.vision import VisionModel, pack_image_features
from jaxserve.multimodal.qwen2_vl_processing import mrope_positions

log = logging.getLogger("jaxserve.engine")

MAX_TILE_BUCKET = 8  # tiles per program call: a 37-tile OneVision image runs as 5 calls
ENCODER_CACHE_BYTES = 512 * 2**20


class EncoderCache:
    """Embeddings by image key, least recently used dropped first past `max_bytes`."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.hits = 0

    def get(self, key: str) -> np.ndarray | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return value

    def put(self, key: str, value: np.ndarray) -> None:
        if key in self._entries or value.nbytes > self.max_bytes:
            return
        self._entries[key] = value
        self.num_bytes += value.nbytes
        while self.num_bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.nbytes


class BucketedEncoder:
    """What both encoders share: the vision model's parameters, one compiled program per input-size
    bucket (the model's forward, `_forward`, on the abstract inputs `_abstract` gives for a
    bucket), and the embeddings cache around `_compute`."""

    unit = "rows"  # what a bucket counts, for the log

    def __init__(self, model: nnx.Module, image_token_id: int, buckets: tuple[int, ...], cache_bytes: int):
        self.cfg = model.cfg
        self.image_token_id = image_token_id
        self.graphdef, self.params = nnx.split(model)
        self.buckets = buckets
        self.cache = EncoderCache(cache_bytes)
        self._jitted = jax.jit(lambda params, *inputs: self._forward(nnx.merge(self.graphdef, params), *inputs))
        self._programs: dict[int, Any] = {}

    def _forward(self, model: Any, *inputs: Any) -> jax.Array:
        raise NotImplementedError

    def _abstract(self, bucket: int) -> tuple[Any, ...]:
        raise NotImplementedError

    def _compute(self, item: ImageItem) -> np.ndarray:
        raise NotImplementedError

    def compile(self) -> dict[int, float]:
        """Compile every bucket now; seconds per bucket."""
        seconds = {}
        for bucket in self.buckets:
            start = time.perf_counter()
            self._programs[bucket] = self._jitted.lower(self.params, *self._abstract(bucket)).compile()
            seconds[bucket] = time.perf_counter() - start
        log.info("compiled the vision encoder for %s %s in %.1fs", list(self.buckets), self.unit,
                 sum(seconds.values()))
        return seconds

    def encode(self, item: ImageItem) -> np.ndarray:
        """The image's embeddings [item.num_tokens, text_hidden] (from the cache when it has them)."""
        cached = self.cache.get(item.key)
        if cached is not None:
            return cached
        embeds = self._compute(item)
        self.cache.put(item.key, embeds)
        return embeds

    def _bucket(self, num_rows: int) -> int:
        return smallest_at_least(self.buckets, num_rows, f"an image's {self.unit}")

    def _run(self, rows: np.ndarray, bucket: int, *inputs: Any) -> np.ndarray:
        """`rows` zero-padded to `bucket` through its program (the padding's outputs included)."""
        padded = np.zeros((bucket, *rows.shape[1:]), np.float32)
        padded[:len(rows)] = rows
        return np.asarray(self._programs[bucket](self.params, padded, *inputs))

    def rope_positions(self, prompt_ids: list[int], images: list[ImageItem]) -> tuple[np.ndarray | None, int]:
        return None, 0  # the language model rotates by the token's index


class LlavaEncoder(BucketedEncoder):
    unit = "tiles"

    def __init__(self, model: VisionModel, max_tile_bucket: int = MAX_TILE_BUCKET,
                 cache_bytes: int = ENCODER_CACHE_BYTES):
        super().__init__(model, model.cfg.image_token_index, powers_of_two(1, max_tile_bucket), cache_bytes)
        self.newline = np.asarray(model.image_newline.get_value())

    def _forward(self, model: VisionModel, pixels: jax.Array) -> jax.Array:
        return model.encode_tiles(pixels)

    def _abstract(self, bucket: int) -> tuple[Any, ...]:
        side = self.cfg.image_size
        return (jax.ShapeDtypeStruct((bucket, 3, side, side), jnp.float32),)

    def _compute(self, item: ImageItem) -> np.ndarray:
        pixels = np.asarray(item.data.pixel_values, np.float32)  # [tiles, 3, side, side]
        largest = self.buckets[-1]
        parts = []
        for start in range(0, len(pixels), largest):
            chunk = pixels[start:start + largest]
            parts.append(self._run(chunk, self._bucket(len(chunk)))[:len(chunk)])
        return pack_image_features(np.concatenate(parts), item.data.image_size, self.newline, self.cfg)


MIN_PATCH_BUCKET = 64


class QwenVLEncoder(BucketedEncoder):
    unit = "patches"

    def __init__(self, model: Qwen2VisionTransformer, image_token_id: int, max_patches: int,
                 cache_bytes: int = ENCODER_CACHE_BYTES):
        """max_patches: the most patch rows one image can have (the image processor's max_pixels)."""
        unit = model.cfg.merge_unit
        largest = -(-max_patches // unit) * unit
        super().__init__(model, image_token_id, powers_of_two(min(MIN_PATCH_BUCKET, largest), largest), cache_bytes)

    def _forward(self, model: Qwen2VisionTransformer, pixels: jax.Array, layout: VisionLayout) -> jax.Array:
        return model.encode(pixels, layout)

    def _abstract(self, bucket: int) -> tuple[Any, ...]:
        unit, i32 = self.cfg.merge_unit, jnp.int32
        layout = VisionLayout(
            window_index=jax.ShapeDtypeStruct((bucket // unit,), i32),
            reverse_index=jax.ShapeDtypeStruct((bucket // unit,), i32),
            window_segments=jax.ShapeDtypeStruct((bucket,), i32),
            full_segments=jax.ShapeDtypeStruct((bucket,), i32),
            rope_positions=jax.ShapeDtypeStruct((bucket, 2), i32))
        return jax.ShapeDtypeStruct((bucket, self.cfg.patch_dim), jnp.float32), layout

    def _compute(self, item: ImageItem) -> np.ndarray:
        pixels = np.asarray(item.data.pixel_values, np.float32)  # [patches, patch_dim]
        bucket = self._bucket(len(pixels))
        layout = vision_layout(self.cfg, [tuple(item.data.grid_thw)], bucket)
        # A copy: a slice would keep the whole padded bucket alive in the cache.
        return self._run(pixels, bucket, layout)[:item.num_tokens].copy()

    def rope_positions(self, prompt_ids: list[int], images: list[ImageItem]) -> tuple[np.ndarray, int]:
        grids = [tuple(item.data.grid_thw) for item in images]
        return mrope_positions(prompt_ids, grids, self.image_token_id, self.cfg.spatial_merge_size)
