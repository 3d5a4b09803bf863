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

from jaxserve.engine.buckets import powers_of_two
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


class LlavaEncoder:
    def __init__(self, model: VisionModel, max_tile_bucket: int = MAX_TILE_BUCKET,
                 cache_bytes: int = ENCODER_CACHE_BYTES):
        self.cfg = model.cfg
        self.image_token_id = model.cfg.image_token_index
        self.graphdef, self.params = nnx.split(model)
        self.newline = np.asarray(model.image_newline.get_value())
        self.buckets = powers_of_two(1, max_tile_bucket)
        self.cache = EncoderCache(cache_bytes)
        self._jitted = jax.jit(self._encode)
        self._programs: dict[int, Any] = {}

    def _encode(self, params: nnx.State, pixels: jax.Array) -> jax.Array:
        return nnx.merge(self.graphdef, params).encode_tiles(pixels)

    def compile(self) -> dict[int, float]:
        """Compile every tile bucket now; seconds per bucket."""
        side = self.cfg.image_size
        seconds = {}
        for tiles in self.buckets:
            start = time.perf_counter()
            spec = jax.ShapeDtypeStruct((tiles, 3, side, side), jnp.float32)
            self._programs[tiles] = self._jitted.lower(self.params, spec).compile()
            seconds[tiles] = time.perf_counter() - start
        log.info("compiled the vision encoder for %s tiles in %.1fs", list(self.buckets), sum(seconds.values()))
        return seconds

    def encode(self, item: ImageItem) -> np.ndarray:
        """The image's embeddings [item.num_tokens, text_hidden] (from the cache when it has them)."""
        cached = self.cache.get(item.key)
        if cached is not None:
            return cached
        pixels = np.asarray(item.data.pixel_values, np.float32)  # [tiles, 3, side, side]
        parts = []
        largest = self.buckets[-1]
        for start in range(0, len(pixels), largest):
            chunk = pixels[start:start + largest]
            bucket = next(b for b in self.buckets if b >= len(chunk))
            padded = np.zeros((bucket, *chunk.shape[1:]), np.float32)
            padded[:len(chunk)] = chunk
            program = self._programs.get(bucket)
            if program is None:
                raise RuntimeError(f"the vision encoder was not compiled for {bucket} tiles")
            parts.append(np.asarray(program(self.params, padded))[:len(chunk)])
        embeds = pack_image_features(np.concatenate(parts), item.data.image_size, self.newline, self.cfg)
        self.cache.put(item.key, embeds)
        return embeds

    def rope_positions(self, prompt_ids: list[int], images: list[ImageItem]) -> tuple[np.ndarray | None, int]:
        return None, 0  # LLaVA's language models rotate by the token's index


MIN_PATCH_BUCKET = 64


class QwenVLEncoder:
    def __init__(self, model: Qwen2VisionTransformer, image_token_id: int, max_patches: int,
                 cache_bytes: int = ENCODER_CACHE_BYTES):
        """max_patches: the most patch rows one image can have (the image processor's max_pixels)."""
        self.cfg = model.cfg
        self.image_token_id = image_token_id
        self.graphdef, self.params = nnx.split(model)
        unit = self.cfg.merge_unit
        largest = -(-max_patches // unit) * unit
        self.buckets = powers_of_two(min(MIN_PATCH_BUCKET, largest), largest)
        self.cache = EncoderCache(cache_bytes)
        self._jitted = jax.jit(self._encode)
        self._programs: dict[int, Any] = {}

    def _encode(self, params: nnx.State, pixels: jax.Array, layout: VisionLayout) -> jax.Array:
        return nnx.merge(self.graphdef, params).encode(pixels, layout)

    def compile(self) -> dict[int, float]:
        """Compile every patch bucket now; seconds per bucket."""
        seconds = {}
        unit, i32 = self.cfg.merge_unit, jnp.int32
        for patches in self.buckets:
            start = time.perf_counter()
            layout = VisionLayout(
                window_index=jax.ShapeDtypeStruct((patches // unit,), i32),
                reverse_index=jax.ShapeDtypeStruct((patches // unit,), i32),
                window_segments=jax.ShapeDtypeStruct((patches,), i32),
                full_segments=jax.ShapeDtypeStruct((patches,), i32),
                rope_positions=jax.ShapeDtypeStruct((patches, 2), i32))
            pixels = jax.ShapeDtypeStruct((patches, self.cfg.patch_dim), jnp.float32)
            self._programs[patches] = self._jitted.lower(self.params, pixels, layout).compile()
            seconds[patches] = time.perf_counter() - start
        log.info("compiled the vision encoder for %s patches in %.1fs", list(self.buckets), sum(seconds.values()))
        return seconds

    def encode(self, item: ImageItem) -> np.ndarray:
        """The image's embeddings [item.num_tokens, text_hidden] (from the cache when it has them)."""
        cached = self.cache.get(item.key)
        if cached is not None:
            return cached
        pixels = np.asarray(item.data.pixel_values, np.float32)  # [patches, patch_dim]
        bucket = next((b for b in self.buckets if b >= len(pixels)), None)
        if bucket is None:
            raise ValueError(f"an image of {len(pixels)} patches is over the largest bucket {self.buckets[-1]}")
        padded = np.zeros((bucket, pixels.shape[1]), np.float32)
        padded[:len(pixels)] = pixels
        layout = vision_layout(self.cfg, [tuple(item.data.grid_thw)], bucket)
        # A copy: a slice would keep the whole padded bucket alive in the cache.
        embeds = np.asarray(self._programs[bucket](self.params, padded, layout))[:item.num_tokens].copy()
        self.cache.put(item.key, embeds)
        return embeds

    def rope_positions(self, prompt_ids: list[int], images: list[ImageItem]) -> tuple[np.ndarray, int]:
        grids = [tuple(item.data.grid_thw) for item in images]
        return mrope_positions(prompt_ids, grids, self.image_token_id, self.cfg.spatial_merge_size)
