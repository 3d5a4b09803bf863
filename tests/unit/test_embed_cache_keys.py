"""Prefix-cache keys of embedded spans (jax-free): an image keys its tokens by its content and by
how it is read (LLaVA-OneVision reads an image beside others as one tile), and registering pages
reads only the new pages' keys."""

from __future__ import annotations

import numpy as np
from PIL import Image

from jaxserve.engine.embeds import EmbedSpan, cache_ids
from jaxserve.engine.pages import PageAllocator
from jaxserve.engine.request import SamplingParams, Sequence
from jaxserve.multimodal.images import ImageSupport
from jaxserve.multimodal.llava_processing import LlavaImageProcessor
from jaxserve.multimodal.media import MediaPolicy

PS = 4
IMAGE_TOKEN = 1
TINY_PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]
ONEVISION_TINY = ({"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": {"height": 56, "width": 56},
                   "image_grid_pinpoints": TINY_PINPOINTS},
                  {"model_type": "llava_onevision", "image_grid_pinpoints": TINY_PINPOINTS,
                   "vision_aspect_ratio": "anyres_max_1",
                   "vision_config": {"model_type": "siglip_vision_model", "image_size": 56, "patch_size": 14}})


def _support() -> ImageSupport:
    return ImageSupport(LlavaImageProcessor.from_hf(*ONEVISION_TINY), IMAGE_TOKEN, "<image>", MediaPolicy())


def _image() -> Image.Image:
    # Not square: the single-image base tile (squashed) differs from the multi-image one (padded).
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 120, 3), dtype=np.uint8))


def test_single_and_multi_image_preparations_differ():
    """Pinned premise: OneVision reads an image alone and beside others differently (other keys,
    other pixels in the first tile, other token counts)."""
    support = _support()
    single, multi = support.prepare_image(_image(), False), support.prepare_image(_image(), True)
    assert single.key != multi.key
    assert single.num_tokens != multi.num_tokens
    assert not np.allclose(single.data.pixel_values[0], multi.data.pixel_values[0])


def test_multi_image_suffix_reaches_the_prefix_cache_keys():
    """cache_ids hashes only key[:16], the pixel hash's first hex digits: the "/multi" suffix is
    dropped, so an image's single- and multi-image spans get the same prefix-cache ids."""
    key = "0123456789abcdef" * 4
    single = EmbedSpan(2, np.zeros((12, 8), np.float32), key)
    multi = EmbedSpan(2, np.ones((8, 8), np.float32), key + "/multi")
    prompt = [7, 8] + [IMAGE_TOKEN] * 12 + [9]
    a, b = cache_ids(prompt, [single]), cache_ids(prompt[:10] + [9], [multi])
    assert a[2:10] != b[2:10]


def test_multi_image_prompt_is_not_served_the_single_image_kv():
    """End to end through the page allocator: request A (the image alone) computes its pages;
    request B (the same image as one of two: other embeddings) must find none past its text."""
    key = "fedcba9876543210" * 4
    alloc = PageAllocator(num_pages=32, page_size=PS)
    text = [7, 8, 9, 10]  # one page of text before the image
    a_prompt = text + [IMAGE_TOKEN] * 12 + [11]
    a = Sequence("a", list(a_prompt), len(a_prompt), SamplingParams(), len(a_prompt) + 1,
                 embeds=(EmbedSpan(4, np.zeros((12, 8), np.float32), key),))
    a.prompt_keys = cache_ids(a_prompt, a.embeds)
    a.pages = alloc.allocate(alloc.pages_for(len(a_prompt)))
    a.num_computed_tokens = len(a_prompt)
    alloc.register_full_pages(a)
    b_prompt = text + [IMAGE_TOKEN] * 8 + [11]
    b_spans = (EmbedSpan(4, np.ones((8, 8), np.float32), key + "/multi"),)
    _, num_cached = alloc.peek_prefix(cache_ids(b_prompt, b_spans))
    assert num_cached <= len(text)  # fails: 12, two pages of A's single-image KV served to B


def test_register_full_pages_does_not_rebuild_cache_ids_every_step():
    """register_full_pages is documented as amortized O(1) per call, but reads seq.cache_ids (a
    new list of every token) on every call, even when no page filled: O(tokens) per decode step
    for each sequence with embeddings."""
    calls = []

    class Counting(Sequence):
        @property
        def cache_ids(self):  # type: ignore[override]
            calls.append(1)
            return super().cache_ids

    alloc = PageAllocator(num_pages=32, page_size=PS)
    prompt = [5] * 9
    seq = Counting("r", list(prompt), len(prompt), SamplingParams(), 40,
                   embeds=(EmbedSpan(0, np.zeros((9, 8), np.float32), "ab" * 32),))
    seq.prompt_keys = cache_ids(prompt, seq.embeds)
    seq.pages = alloc.allocate(3)
    seq.num_computed_tokens = 9
    alloc.register_full_pages(seq)
    calls.clear()
    seq.token_ids.append(3)
    seq.num_computed_tokens = 10  # a decode step inside page 2: nothing new to register
    alloc.register_full_pages(seq)
    assert calls == []
