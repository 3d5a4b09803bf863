"""Qwen2.5-VL served end to end (production start-up, the official openai client, image_url parts
through Qwen's chat template): greedy answers equal HF transformers' generate on the same tokens
and pixels, usage reports the image tokens, and a repeated image is served from the prefix cache."""

from __future__ import annotations

import openai
import pytest

from jaxserve.config import CacheConfig, Config, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig
from live_server import serve
from tiny_vlm import QWEN_IMAGE_TOKEN, data_url, hf_greedy, make_tiny_qwen_vl, random_image

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen-vl"


@pytest.fixture(scope="module")
def served(tmp_path_factory, cache_dir):
    directory = tmp_path_factory.mktemp("qwen_vl")
    hf = make_tiny_qwen_vl(directory)
    config = Config(
        model=ModelConfig(model=str(directory), served_model_name=MODEL, dtype="float32", max_model_len=256,
                          cache_dir=cache_dir),
        parallel=ParallelConfig(), server=ServerConfig(), cache=CacheConfig(page_size=4, num_pages=120),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_seqs=2),
        compilation_cache_dir=cache_dir / "xla")
    live, async_engine = serve(config, MODEL)
    yield hf, openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    live.close()
    async_engine.shutdown()


def test_chat_with_images_equals_hf(served):
    hf, client = served
    images = [random_image(60, 110, seed=1), random_image(100, 40, seed=2)]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(im)}}
                                             for im in images] + [{"type": "text", "text": "w5 w7"}]}]

    def chat():
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True})

    out = chat()
    ids = out.prompt_token_ids
    want = hf_greedy(hf, "qwen", ids, images, 8)
    assert out.choices[0].token_ids == want
    assert out.usage.prompt_tokens_details.image_tokens == ids.count(QWEN_IMAGE_TOKEN) >= 8
    again = chat()
    assert again.choices[0].token_ids == want and again.usage.prompt_tokens_details.cached_tokens > 8


def test_mm_processor_kwargs_bound_a_requests_images(served):
    """vLLM's mm_processor_kwargs: a request's max_pixels shrinks its images (fewer image tokens),
    the answer still HF's with the same bounds; /tokenize counts the same; over the server's
    max_pixels is a 400 naming it."""
    import httpx

    hf, client = served
    image = random_image(100, 100, seed=3)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "w5"}]}]

    def chat(kwargs):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True,
                                                          "mm_processor_kwargs": kwargs})

    small = chat({"max_pixels": 56 * 56})
    assert small.prompt_token_ids.count(QWEN_IMAGE_TOKEN) == 4  # 56x56: 2x2 merged patches
    assert small.choices[0].token_ids == hf_greedy(hf, "qwen", small.prompt_token_ids, [image], 6,
                                                   max_pixels=56 * 56)
    full = chat(None)
    assert full.prompt_token_ids.count(QWEN_IMAGE_TOKEN) > 4
    assert full.choices[0].token_ids == hf_greedy(hf, "qwen", full.prompt_token_ids, [image], 6)
    base = str(client.base_url).removesuffix("/v1/")
    tokens = httpx.post(base + "/tokenize", json={"messages": messages, "mm_processor_kwargs": {
        "max_pixels": 56 * 56}}).json()["tokens"]
    assert tokens == small.prompt_token_ids
    with pytest.raises(openai.BadRequestError) as e:
        chat({"max_pixels": 10**6})
    assert e.value.body["param"] == "mm_processor_kwargs" and "max_pixels: at most 12544" in e.value.body["message"]
