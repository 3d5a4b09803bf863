"""Vision-language models end to end against HF transformers (float32): the checkpoint loaded as
the server loads it (language model through load_model, vision side through its loader), the
prompt's images through our image processor and placeholder expansion, the vision encoding step,
and the language model with the image embeddings spliced in (and, for Qwen2.5-VL, M-RoPE
positions): logits within 1e-4 of HF's LlavaOnevisionForConditionalGeneration /
LlavaNextForConditionalGeneration / Qwen2_5_VLForConditionalGeneration for prompts with one image,
two images of different sizes (LLaVA-OneVision's multi-image mode) and none."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.multimodal.images import image_support
from jaxserve.multimodal.media import MediaPolicy
from jaxserve.startup import vision_encoder
from jaxserve.tokenizer import load_tokenizer
from jaxserve.weights import load_model
from tiny_vlm import (
    IMAGE_TOKEN,
    QWEN_IMAGE_TOKEN,
    QWEN_VISION_END,
    QWEN_VISION_START,
    data_url,
    expand_prompt,
    hf_image_kwargs,
    make_tiny_llava,
    make_tiny_llava_next,
    make_tiny_qwen_vl,
    random_image,
)

IMAGES = {"wide": (48, 150), "square": (100, 100), "tall": (130, 50)}
FAMILIES = {  # family: (checkpoint maker, an image's placeholder ids, image token, (user, assistant) ids)
    "llava": (make_tiny_llava, [IMAGE_TOKEN], IMAGE_TOKEN, (124, 125)),
    "next": (make_tiny_llava_next, [IMAGE_TOKEN], IMAGE_TOKEN, (124, 125)),
    "qwen": (make_tiny_qwen_vl, [QWEN_VISION_START, QWEN_IMAGE_TOKEN, QWEN_VISION_END], QWEN_IMAGE_TOKEN, (120, 121)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    hf = FAMILIES[family][0](directory)
    loaded = load_model(directory, "float32", use_cache=False)
    encoder = vision_encoder(loaded)
    encoder.compile()
    support = image_support(directory, loaded.source.config, load_tokenizer(directory).hf, MediaPolicy())
    return family, hf, loaded, encoder, support


def _prompt(family: str, num_images: int) -> list[int]:
    _, image, _, (user, assistant) = FAMILIES[family]
    prompt = [user, 5, *(image if num_images else []), 7, 9]
    if num_images > 1:
        prompt += [11, *image, 13]
    return prompt + [assistant, 17]


def _ours(loaded, encoder, support, prompt: list[int], images: list) -> tuple[list[int], np.ndarray]:
    ids, items = expand_prompt(support, prompt, images)
    values = np.zeros((len(ids), loaded.config.hidden_size), np.float32)
    mask = np.zeros(len(ids), bool)
    for item in items:
        values[item.offset:item.offset + item.num_tokens] = encoder.encode(item)
        mask[item.offset:item.offset + item.num_tokens] = True
    rope, _ = encoder.rope_positions(ids, items)
    logits = loaded.model(jnp.asarray([ids]), jnp.arange(len(ids))[None], jnp.asarray([len(ids)]),
                          (jnp.asarray(values[None]), jnp.asarray(mask[None])),
                          None if rope is None else jnp.asarray(rope.T[None]))
    return ids, np.asarray(logits[0])


@pytest.mark.parametrize("names", [[], ["wide"], ["tall"], ["square", "wide"]])
def test_logits_match_hf(checkpoint, names):
    family, hf, loaded, encoder, support = checkpoint
    images = [random_image(*IMAGES[n], seed=i) for i, n in enumerate(names)]
    ids, ours = _ours(loaded, encoder, support, _prompt(family, len(images)), images)
    assert ids.count(FAMILIES[family][2]) >= 4 * len(images)  # expanded
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), **hf_image_kwargs(family, ids, images)).logits[0].numpy()
    np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)


def test_onevision_single_and_multi_image_modes_are_cached_apart(checkpoint):
    """The same image encodes differently alone (anyres grid) and beside another (one tile)."""
    family, _, _, encoder, support = checkpoint
    if family != "llava":
        pytest.skip("only LLaVA-OneVision reads an image differently beside others")
    image = data_url(random_image(*IMAGES["wide"], seed=0))
    alone = asyncio.run(support.prepare_all([(image, "image")]))[0]
    paired = asyncio.run(support.prepare_all([(image, "image"), (image, "image")]))[0]
    assert alone.key != paired.key and alone.num_tokens > paired.num_tokens == encoder.cfg.tokens_per_tile + 1
