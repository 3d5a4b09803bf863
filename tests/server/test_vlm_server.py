"""A vision-language model served end to end: started by the production start-up (vision encoder,
image processor, media policy), asked through the official openai client with image_url parts and
through SGLang's documented /generate request (the prompt's own `<image>`, image_data a file name
under --allowed-local-media-path). Greedy answers equal HF transformers' generate on the same
tokens and pixels; a repeated image is served from the prefix cache; bad images are refused with
400s naming the parameter."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
from PIL import Image

from jaxserve.config import CacheConfig, Config, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig
from jaxserve.multimodal.media import MediaPolicy
from live_server import serve
from tiny_vlm import IMAGE_TOKEN, data_url, hf_greedy, make_tiny_llava, random_image

pytestmark = pytest.mark.slow

MODEL = "tiny-llava"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, cache_dir):
    directory = tmp_path_factory.mktemp("llava")
    hf = make_tiny_llava(directory)
    media = tmp_path_factory.mktemp("media")
    random_image(48, 150, seed=3).save(media / "example_image.png")
    config = Config(
        model=ModelConfig(model=str(directory), served_model_name=MODEL, dtype="float32", max_model_len=256,
                          cache_dir=cache_dir),
        parallel=ParallelConfig(), server=ServerConfig(),
        cache=CacheConfig(page_size=4, num_pages=200),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2),
        media=MediaPolicy(allowed_local_media_path=media, max_images=2, max_image_pixels=300 * 300),
        compilation_cache_dir=cache_dir / "xla",
    )
    live, async_engine = serve(config, MODEL)
    yield hf, live, media
    live.close()
    async_engine.shutdown()


def _chat(client, images: list, text: str = "w5 w7") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=[{"role": "user", "content": [*parts, {"type": "text",
                                                                                                    "text": text}]}],
        extra_body={"return_token_ids": True, "ignore_eos": True})


def test_openai_client_with_images_equals_hf(vlm):
    hf, live, _ = vlm
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for images in ([random_image(48, 150, seed=1)], [random_image(100, 100, seed=2), random_image(130, 50, seed=4)]):
        out = _chat(client, images)
        ids = out.prompt_token_ids
        assert out.choices[0].token_ids == hf_greedy(hf, "llava", ids, images, 8)
        expected = ids.count(IMAGE_TOKEN)
        assert out.usage.prompt_tokens_details.image_tokens == expected > 16 * len(images)
    again = _chat(client, images)  # the same two images: their pages come from the prefix cache
    assert again.usage.prompt_tokens_details.cached_tokens > 16
    assert again.choices[0].token_ids == out.choices[0].token_ids


def test_sglang_documented_request(vlm):
    hf, live, media = vlm
    # SGLang's docs: the chat markup and <image> in `text`, image_data a file name.
    body = {"text": "user <image> w5 w7 assistant", "image_data": str(media / "example_image.png"),
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(live.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    image = Image.open(media / "example_image.png").convert("RGB")
    data = r.json()
    ids = httpx.post(live.url + "/tokenize", json={"prompt": "user <image> w5 w7 assistant"}, timeout=60).json()
    # The placeholder became the image's tokens; HF generates the same from those tokens and pixels.
    num_image = data["meta_info"]["prompt_tokens"] - len(ids["tokens"]) + 1
    assert num_image > 16 and ids["tokens"].count(IMAGE_TOKEN) == 1
    at = ids["tokens"].index(IMAGE_TOKEN)
    expanded = ids["tokens"][:at] + [IMAGE_TOKEN] * num_image + ids["tokens"][at + 1:]
    assert data["output_ids"] == hf_greedy(hf, "llava", expanded, [image], 6)
    batch = httpx.post(live.url + "/generate", json={
        "text": ["user <image> w5 assistant", "user w9 assistant"],
        "image_data": [data_url(image), None],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, timeout=120)
    assert batch.status_code == 200 and len(batch.json()) == 2


@pytest.mark.parametrize("body, param, phrase", [
    ({"text": "user <image> w5", "image_data": "http://127.0.0.1:9/x.png"}, "image_data", "--allow-remote-media"),
    ({"text": "user <image> w5", "image_data": "/etc/passwd"}, "image_data", "outside --allowed-local-media-path"),
    ({"text": "user w5", "image_data": "QUJD"}, "image_data", "placeholder"),
    ({"text": "user <image> <image> <image> w5", "image_data": ["a", "b", "c"]}, "image_data", "limit of 2"),
    ({"text": "user <image> w5", "image_data": base64.b64encode(b"not an image").decode()}, "image_data", ""),
])
def test_bad_images_are_refused(vlm, body, param, phrase):
    _, live, _ = vlm
    r = httpx.post(live.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(param) and phrase in message


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "user <image> w5", "max_tokens": 2}),
    (f"/v2/models/{MODEL}/generate", {"text_input": "user <image> w5", "parameters": {"max_tokens": 2}}),
])
def test_a_placeholder_without_its_image_is_refused(vlm, path, body):
    """Routes that take no images (completions, Triton) still cannot smuggle a placeholder in: it
    would be read as the placeholder's own embedding."""
    _, live, _ = vlm
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code == 400 and "image placeholder" in r.text, r.text


def test_oversized_image_in_chat_is_refused(vlm):
    _, live, _ = vlm
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [random_image(400, 400, seed=0)])
    assert "--max-image-pixels" in str(e.value) and "messages[0].content[0].image_url" in str(e.value)
    assert _chat(client, [random_image(40, 40, seed=0)]).choices[0].finish_reason == "length"
