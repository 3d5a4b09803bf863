"""The model's recommended sampling (generation_config.json, --generation-config auto as in vLLM)
fills what a request leaves unset, on every protocol; beam search takes none of it. The app here
shares the session's engine, with defaults that make an unset request greedy (top_k 1) and stop
chat after 5 tokens."""

from __future__ import annotations

import httpx
import openai
import pytest

from jaxserve.server.app import create_app
from live_server import MAX_MODEL_LEN, MODEL, start_server

pytestmark = pytest.mark.slow

PROMPT = "Name a random animal, a color and a city:"


@pytest.fixture(scope="module")
def model_defaults_server(async_engine, smollm2_tokenizer):
    app = create_app(async_engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN,
                     sampling_defaults={"top_k": 1, "max_tokens": 5})
    live = start_server(app)
    yield live
    live.close()


def test_unset_fields_take_the_model_defaults(model_defaults_server):
    client = openai.OpenAI(base_url=model_defaults_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, seed=1)
    texts = {c.text for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=4, seed=1).choices}
    assert texts == {greedy.choices[0].text}  # top_k 1 from the model: every sample is the greedy one
    # A request that sets top_k itself samples as it asks.
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=4, seed=1, extra_body={"top_k": -1})
    assert len({c.text for c in free.choices}) > 1
    # Chat without a token limit stops at the model's max_new_tokens.
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    # A soft limit: min_tokens above it wins (as vLLM's), and it is never a reason to refuse.
    longer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                            extra_body={"ignore_eos": True, "min_tokens": 8})
    assert longer.usage.completion_tokens == 8
    # Beam search takes none of them (top_k would be refused with it).
    beams = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2,
                                      extra_body={"use_beam_search": True})
    assert len(beams.choices) == 2
    # The Responses API has no top_k field; the model's applies all the same.
    response = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=8)
    again = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=8)
    assert response.output_text == again.output_text


def test_a_model_limit_beyond_the_context_is_cut_to_it(async_engine, smollm2_tokenizer):
    """generation_config's max_new_tokens larger than the room a prompt leaves: the request runs
    to the context's end instead of being refused for a limit the client never sent."""
    app = create_app(async_engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN, sampling_defaults={"max_tokens": 10**6})
    live = start_server(app)
    try:
        prompt = "Count: " + "one two three " * 100  # most of the 512-token context
        r = httpx.post(live.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": prompt}], "temperature": 0, "ignore_eos": True}, timeout=300)
        usage = r.json()["usage"]
        assert r.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN, r.text
    finally:
        live.close()


def test_sglang_and_triton_take_them_too(model_defaults_server):
    url = model_defaults_server.url
    greedy = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0}}, timeout=120).json()["text"]
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "n": 3}}
    assert {item["text"] for item in httpx.post(url + "/generate", json=body, timeout=120).json()} == {greedy}
    # SGLang's own max_new_tokens default (128) stays: the model's limit is not SGLang's.
    long = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": {"ignore_eos": True}},
                      timeout=300).json()
    assert long["meta_info"]["completion_tokens"] == 128
    triton = httpx.post(url + f"/v2/models/{MODEL}/generate",
                        json={"text_input": PROMPT, "parameters": {"ignore_eos": True}}, timeout=120).json()
    assert triton["text_output"].startswith(PROMPT)
    completion = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                           "ignore_eos": True, "return_token_ids": True},
                            timeout=120).json()["choices"][0]
    assert triton["text_output"] == PROMPT + completion["text"]  # 5 greedy tokens: the model's max_new_tokens
