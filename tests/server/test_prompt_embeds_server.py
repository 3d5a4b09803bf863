"""Prompts as embeddings through the live server: vLLM's prompt_embeds (base64 of a torch.save'd
tensor, sent with the official openai client as vLLM's docs do) and SGLang's input_embeds. A
prompt sent as its own token embeddings answers exactly as the text prompt."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch

from live_server import MODEL

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def table(async_engine):
    """SmolLM2's embedding table, as the engine holds it."""
    runner = async_engine.engine.runner
    return np.asarray(runner.params["embed_tokens"].get_value(), np.float32)


def _b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_prompt_embeds_with_the_openai_client(client, server, smollm2_tokenizer, table):
    ids = smollm2_tokenizer.encode(PROMPT)
    embeds = torch.from_numpy(table[ids])
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    # vLLM's documented client call: prompt=None and the tensor in extra_body.
    out = client.completions.create(model=MODEL, prompt=None, max_tokens=12, temperature=0,
                                    extra_body={"prompt_embeds": _b64(embeds)})
    assert out.choices[0].text == text.choices[0].text
    assert out.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=MODEL, prompt=None, max_tokens=12, temperature=0,
                                      extra_body={"prompt_embeds": [_b64(embeds[None]), _b64(embeds[:3])]})
    assert batch.choices[0].text == text.choices[0].text and len(batch.choices) == 2


def test_sglang_input_embeds(server, smollm2_tokenizer, table):
    ids = smollm2_tokenizer.encode(PROMPT)
    params = {"max_new_tokens": 12, "temperature": 0}
    text = httpx.post(server.url + "/generate", json={"text": PROMPT, "sampling_params": params}, timeout=60).json()
    single = httpx.post(server.url + "/generate", json={"input_embeds": table[ids].tolist(), "sampling_params": params},
                        timeout=60).json()
    assert single["text"] == text["text"] and single["meta_info"]["prompt_tokens"] == len(ids)
    # (short prompts: the session server takes bodies of up to 64 KiB)
    parts = [ids[:2], ids[:3]]
    by_ids = httpx.post(server.url + "/generate", json={"input_ids": parts, "sampling_params": params},
                        timeout=60).json()
    batch = httpx.post(server.url + "/generate", json={"input_embeds": [table[p].tolist() for p in parts],
                                                       "sampling_params": params}, timeout=60).json()
    assert [b["text"] for b in batch] == [b["text"] for b in by_ids]


@pytest.mark.parametrize("path, body, param, phrase", [
    ("/generate", {"input_embeds": [[0.0] * 5]}, "input_embeds", "the model's 576"),
    ("/generate", {"input_embeds": [[0.0] * 576], "text": "hi"}, "text", "exactly one of"),
    ("/generate", {"input_embeds": [["x"] * 576]}, "input_embeds", "numbers"),
    ("/generate", '{"input_embeds": [[1e400' + ', 0.0' * 575 + ']]}', "input_embeds", "finite"),
    ("/v1/completions", {"model": MODEL, "prompt_embeds": "not base64!"}, "prompt_embeds", "base64"),
    ("/v1/completions", {"model": MODEL, "prompt_embeds": "AAAA", "prompt": "hi"}, "prompt_embeds", "not both"),
    ("/v1/completions", {"model": MODEL, "prompt_embeds": "AAAA", "echo": True}, "echo", "no tokens"),
])
def test_bad_embeddings_are_refused(server, path, body, param, phrase):
    raw = ({"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str)
           else {"json": body})
    r = httpx.post(server.url + path, timeout=60, **raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    # OpenAI's error body names the parameter; SGLang's is a message that starts with it.
    assert error.get("param", param) == param and error["message"].startswith(param)
    assert phrase in error["message"]


def test_wrong_width_tensor_names_the_shape(client, server):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=None, max_tokens=2,
                                  extra_body={"prompt_embeds": _b64(torch.zeros(3, 100))})
    assert "hidden size 100 does not match the model's 576" in str(e.value)
