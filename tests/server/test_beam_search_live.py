"""Beam search through a real server (SmolLM2, real port, the official openai client): OVMS's
best_of on /v3 and vLLM's use_beam_search on /v1 give the same beams, as many as n asks, best
first, each with its own logprobs; SGLang and Triton take the same fields; what cannot be
honoured (streaming, sampling knobs) is refused by name. Parity with Hugging Face's beam search
is tests/engine/test_beam_search.py's."""

from __future__ import annotations

import httpx
import pytest
from live_server import MODEL

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours are"


def test_ovms_best_of_and_vllm_use_beam_search_agree(server, client):
    v3 = httpx.post(server.url + "/v3/completions", timeout=120,
                    json={"model": MODEL, "prompt": PROMPT, "best_of": 3, "n": 2, "max_tokens": 12}).json()
    v1 = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=12, logprobs=1,
                                   extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 1.0})
    assert [c["text"] for c in v3["choices"]] == [c.text for c in v1.choices]
    assert v1.choices[0].text != v1.choices[1].text  # two different beams
    assert [c.index for c in v1.choices] == [0, 1]
    assert v1.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in v1.choices)
    # Best first: length-normalised cumulative logprob, HF's score with length_penalty 1.
    scores = [sum(c.logprobs.token_logprobs) / len(c.logprobs.tokens) for c in v1.choices]
    assert scores[0] >= scores[1]
    # /v3 with use_beam_search: false keeps best_of's sampling meaning (vLLM's), whatever OVMS's rule.
    sampled = httpx.post(server.url + "/v3/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "best_of": 3, "n": 2, "max_tokens": 12, "use_beam_search": False,
        "temperature": 1.5, "seed": 5})
    assert sampled.status_code == 200, sampled.text  # (temperature 1.5 would be refused by beam search)


def test_chat_sglang_and_triton_take_beam_search(server, client):
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=16,
                                          extra_body={"use_beam_search": True, "best_of": 2, "early_stopping": True})
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
    sglang = httpx.post(server.url + "/generate", timeout=120, json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 12, "n": 2, "use_beam_search": True}}).json()
    v1 = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=12,
                                   extra_body={"use_beam_search": True})
    assert [item["text"] for item in sglang] == [c.text for c in v1.choices]
    triton = httpx.post(server.url + f"/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": PROMPT, "parameters": {"max_tokens": 12, "use_beam_search": True, "best_of": 3,
                                             "exclude_input_in_output": True}}).json()
    best = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                     extra_body={"use_beam_search": True, "best_of": 3})
    assert triton["text_output"] == best.choices[0].text


@pytest.mark.parametrize("path,body,param", [
    ("/v3/completions", {"prompt": PROMPT, "best_of": 2, "stream": True}, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "use_beam_search": True,
                              "stream": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "top_p": 0.5}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "stop": ["."]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "best_of": 64}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "early_stopping": "sometimes", "use_beam_search": True}, "early_stopping"),
    ("/v1/completions", {"prompt": PROMPT, "length_penalty": 0.5}, "length_penalty"),
])
def test_refused_by_name(server, path, body, param):
    reply = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
