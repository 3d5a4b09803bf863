"""The seed documents' model names and prompt shapes, on live servers sharing the session's engine:
FastDeploy's "default" / "null" and token-id `messages`, OVMS's "llama3", Triton's "mymodel",
SGLang's chat-markup `text`, and FastDeploy's seed bound."""

from __future__ import annotations

import httpx
import pytest
from live_server import MAX_MODEL_LEN, MODEL, start_server

from jaxserve.server.app import create_app
from jaxserve.server.model_names import ModelNames

pytestmark = pytest.mark.slow

GREEDY = {"max_tokens": 6, "temperature": 0}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def aliased(async_engine, smollm2_tokenizer):
    """--served-model-name smollm2 llama3 mymodel"""
    live = start_server(create_app(async_engine, smollm2_tokenizer, ModelNames((MODEL, "llama3", "mymodel")),
                                   MAX_MODEL_LEN))
    yield live
    live.close()


@pytest.fixture(scope="module")
def any_name(async_engine, smollm2_tokenizer):
    """--accept-any-model-name"""
    live = start_server(create_app(async_engine, smollm2_tokenizer, ModelNames((MODEL,), accept_any=True),
                                   MAX_MODEL_LEN))
    yield live
    live.close()


def test_generic_names_and_an_omitted_model_are_the_served_model(server):
    texts = set()
    for model in ("default", "null", None, MODEL):
        body = {"prompt": "The capital of France is", **GREEDY, **({"model": model} if model else {})}
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1
    r = _post(server, "/v1/completions", {"prompt": "Hi", "model": "llama3", **GREEDY})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_several_served_names(aliased, smollm2_tokenizer):
    models = httpx.get(aliased.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, "llama3", "mymodel"]
    # OVMS's example: /v3/chat/completions with model "llama3"; the response reports the first name.
    r = _post(aliased, "/v3/chat/completions", {"model": "llama3", "max_tokens": 6, "temperature": 0,
                                                "messages": [{"role": "user", "content": "What is OpenVINO?"}]})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    # Triton's example URL names "mymodel".
    r = _post(aliased, "/v2/models/mymodel/generate", {"text_input": "What is Triton?",
                                                       "parameters": {"max_tokens": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["model_name"] == MODEL
    assert _post(aliased, "/v2/models/other/generate", {"text_input": "x"}).status_code == 404


def test_accept_any_model_name(any_name):
    r = _post(any_name, "/v1/completions", {"prompt": "Hi", "model": "gpt-4", **GREEDY})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    assert _post(any_name, "/v2/models/whatever/generate", {"text_input": "Hi"}).status_code == 200


def test_fastdeploy_token_id_messages(server, smollm2_tokenizer):
    """FastDeploy's chat takes the prompt as token ids in `messages`: the same tokens as
    prompt_token_ids, and as the rendered conversation they spell."""
    ids = smollm2_tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    base = {"model": "default", "max_tokens": 8, "temperature": 0}
    by_messages = _post(server, "/v1/chat/completions", {**base, "messages": ids})
    by_chat = _post(server, "/v1/chat/completions",
                    {**base, "messages": [{"role": "user", "content": "What is 2 + 2?"}]})
    assert by_messages.status_code == 200, by_messages.text
    assert by_messages.json()["choices"][0]["message"]["content"] == by_chat.json()["choices"][0]["message"]["content"]
    assert by_messages.json()["usage"]["prompt_tokens"] == len(ids)
    r = _post(server, "/v1/chat/completions", {**base, "messages": ids, "prompt_token_ids": ids})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_fastdeploy_seed_bound(server):
    ok = _post(server, "/v1/completions", {"prompt": "Hi", "seed": 922337203685477580, "max_tokens": 2})
    assert ok.status_code == 200
    r = _post(server, "/v1/completions", {"prompt": "Hi", "seed": 922337203685477581, "max_tokens": 2})
    assert r.status_code == 400 and "seed" in r.text and "922337203685477580" in r.text


def test_sglang_chat_markup_text_is_parsed_as_hf_does(server, smollm2_tokenizer):
    """SGLang's multimodal example writes the chat markup into `text` itself (its image_data left
    out: images are another issue). The prompt reaches the model as HF tokenizes it, special tokens
    included, so the reply equals the one for the same conversation sent through chat."""
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nDescribe a sunset in a very short sentence.<|im_end|>\n<|im_start|>assistant\n")
    r = _post(server, "/generate", {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["prompt_tokens"] == len(smollm2_tokenizer.hf(text)["input_ids"])
    by_ids = _post(server, "/generate", {"input_ids": smollm2_tokenizer.hf(text)["input_ids"],
                                         "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
    assert r.json()["output_ids"] == by_ids.json()["output_ids"]
    chat = _post(server, "/v1/chat/completions", {"max_tokens": 16, "temperature": 0, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Describe a sunset in a very short sentence."}]})
    assert chat.json()["choices"][0]["message"]["content"] == r.json()["text"]
