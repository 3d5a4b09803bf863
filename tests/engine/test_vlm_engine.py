"""Vision-language models through the engine (LLaVA-OneVision and Qwen2.5-VL): greedy tokens equal
HF's `generate` for prompts with one image, two images and none, with images split across prefill
chunks and pages and under preemption (a resumed Qwen row recomputes its prompt's M-RoPE positions
and its outputs' index + delta); a repeated image is served from the prefix cache (and the encoder
cache), while a different image behind the same placeholder ids is not."""

from __future__ import annotations

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.core import run_to_completion
from jaxserve.engine.request import SamplingParams
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
    expand_prompt,
    hf_greedy,
    make_tiny_llava,
    make_tiny_qwen_vl,
    random_image,
)

pytestmark = pytest.mark.slow

QWEN_IMAGE = [QWEN_VISION_START, QWEN_IMAGE_TOKEN, QWEN_VISION_END]
FAMILIES = {  # family: (checkpoint maker, cache pages, prompts: name -> (ids around placeholders, image sizes))
    # LLaVA images take 40-odd tokens, prefilled 16 at a time; 30 usable pages of 4 tokens.
    "llava": (make_tiny_llava, 31, 16, {
        "one": ([124, 5, IMAGE_TOKEN, 7, 9, 125], [(48, 150)]),
        "two": ([124, IMAGE_TOKEN, 3, IMAGE_TOKEN, 8, 125], [(100, 100), (130, 50)]),
        "text": ([124, 5, 6, 7, 8, 9, 10, 125], []),
    }),
    # Qwen images take 8 to 16 tokens, prefilled 8 at a time; 18 usable pages.
    "qwen": (make_tiny_qwen_vl, 19, 8, {
        "one": ([120, 5, *QWEN_IMAGE, 7, 9, 121], [(60, 110)]),
        "two": ([120, *QWEN_IMAGE, 3, *QWEN_IMAGE, 8, 121], [(80, 80), (100, 40)]),
        "text": ([120, 5, 6, 7, 8, 9, 10, 121], []),
    }),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request, tmp_path_factory):
    family = request.param
    make, num_pages, chunk, prompts = FAMILIES[family]
    directory = tmp_path_factory.mktemp(family)
    hf = make(directory)
    loaded = load_model(directory, "float32", use_cache=False)
    encoder = vision_encoder(loaded)
    encoder.compile()
    support = image_support(directory, loaded.source.config, load_tokenizer(directory).hf, MediaPolicy())
    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=num_pages),
                          scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=chunk, max_prefill_seqs=2,
                                                    max_model_len=160))
    return family, hf, build_engine(loaded.model, None, config, encoder=encoder), support, prompts


def _inputs(support, prompts, name: str, seed: int = 0):
    prompt, sizes = prompts[name]
    images = [random_image(h, w, seed=seed + i) for i, (h, w) in enumerate(sizes)]
    ids, items = expand_prompt(support, prompt, images)
    return ids, items, images


def test_greedy_equals_hf_with_chunked_images_and_preemption(setup):
    family, hf, engine, support, prompts = setup
    requests = {name: _inputs(support, prompts, name) for name in prompts}
    for rid, (ids, items, _) in requests.items():
        engine.add_request(rid, ids, GREEDY, images=items)
    before = engine.num_preemptions
    results = run_to_completion(engine, list(requests))
    engine.check_idle_integrity()
    assert engine.num_preemptions > before
    for rid, (ids, _, images) in requests.items():
        assert results[rid].outputs[0].token_ids == hf_greedy(hf, family, ids, images, 12), rid


def test_repeated_image_hits_the_prefix_cache(setup):
    _, _, engine, support, prompts = setup
    engine.scheduler.allocator.reset_prefix_cache()
    ids, items, _ = _inputs(support, prompts, "one", seed=5)
    engine.add_request("first", ids, GREEDY, images=items)
    first = run_to_completion(engine, ["first"])["first"]
    hits = engine.encoder.cache.hits
    again, again_items, _ = _inputs(support, prompts, "one", seed=5)
    engine.add_request("again", again, GREEDY, images=again_items)
    second = run_to_completion(engine, ["again"])["again"]
    assert second.num_cached_tokens >= len(ids) - 4 and engine.encoder.cache.hits == hits + 1
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # Same placeholder ids, another image: nothing past the text before it may be served.
    other, other_items, _ = _inputs(support, prompts, "one", seed=6)
    assert other == ids
    engine.add_request("other", other, GREEDY, images=other_items)
    third = run_to_completion(engine, ["other"])["other"]
    assert third.num_cached_tokens <= other_items[0].offset
    engine.check_idle_integrity()
