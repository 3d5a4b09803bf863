"""Prompt-lookup decoding, and a draft model, through a real server (SmolLM2, real port, the official openai client):
a server started with --speculative-method ngram answers exactly what the plain server answers
(greedy), whole and streamed, and reports its drafts in OpenAI usage, SGLang meta_info and
/metrics; OVMS's per-request fields work on /v3 and are range-checked."""

from __future__ import annotations

import httpx
import pytest
from live_server import MAX_MODEL_LEN, MODEL, small_engine, start_server
from smollm2 import smollm2_gguf

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.app import create_app

pytestmark = pytest.mark.slow

PARAGRAPH = ("Every evening the keeper climbed the spiral stairs, trimmed the wick, and watched the beam sweep "
             "across the dark water until the fishing boats were safely home.")
COPY = [{"role": "user", "content": f"Repeat the following sentence exactly:\n\n{PARAGRAPH}"}]


@pytest.fixture(scope="module")
def spec_server(cache_dir, smollm2_tokenizer):
    # One verify bucket: its prefill and decode programs are the plain server's (read back from the
    # compilation cache), and which bucket pads a batch changes no token.
    engine = AsyncEngine(small_engine(cache_dir, speculative_method="ngram", num_speculative_tokens=4,
                                      decode_buckets=(8,), prefill_buckets=(64,)))
    live = start_server(create_app(engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN))
    yield live
    live.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def spec_client(spec_server):
    import openai

    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_equals_the_plain_server_and_reports_its_drafts(spec_client, client):
    plain = client.chat.completions.create(model=MODEL, messages=COPY, temperature=0, max_tokens=60)
    spec = spec_client.chat.completions.create(model=MODEL, messages=COPY, temperature=0, max_tokens=60)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert "climbed the spiral stairs, trimmed the wick" in spec.choices[0].message.content
    details = spec.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    assert details.accepted_prediction_tokens < spec.usage.completion_tokens
    stream = spec_client.chat.completions.create(model=MODEL, messages=COPY, temperature=0, max_tokens=60,
                                                 stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == details.accepted_prediction_tokens


def test_ovms_fields_on_v3_sglang_meta_info_and_metrics(spec_server):
    body = {"model": MODEL, "messages": COPY, "temperature": 0, "max_tokens": 40}
    off = httpx.post(spec_server.url + "/v3/chat/completions", json=body | {"num_assistant_tokens": 0}, timeout=120)
    small = httpx.post(spec_server.url + "/v3/chat/completions",
                       json=body | {"num_assistant_tokens": 2, "max_ngram_size": 2}, timeout=120)
    assert off.status_code == small.status_code == 200
    assert off.json()["choices"][0]["message"]["content"] == small.json()["choices"][0]["message"]["content"]
    assert off.json()["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    kept = small.json()["usage"]["completion_tokens_details"]
    assert kept["accepted_prediction_tokens"] > 0
    assert kept["accepted_prediction_tokens"] + kept["rejected_prediction_tokens"] <= 2 * 40  # two a step at most
    too_many = httpx.post(spec_server.url + "/v3/chat/completions", json=body | {"num_assistant_tokens": 5}, timeout=60)
    assert too_many.status_code == 400 and "num_assistant_tokens" in too_many.text and "[0, 4]" in too_many.text
    generate = httpx.post(spec_server.url + "/generate", json={
        "text": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "sampling_params": {"temperature": 0, "max_new_tokens": 30}},
        timeout=120)
    meta = generate.json()["meta_info"]
    assert meta["spec_accept_token_num"] > 0 and 0 < meta["spec_accept_rate"] <= 1
    metrics = httpx.get(spec_server.url + "/metrics").text
    accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("jaxserve:spec_decode_num_accepted_tokens_total"))
    assert accepted >= meta["spec_accept_token_num"] + kept["accepted_prediction_tokens"]


@pytest.fixture(scope="module")
def draft_server(cache_dir, smollm2_tokenizer):
    # Started as `--speculative-model PATH` starts it (startup.start_engine loads the draft): the
    # same GGUF drafts for itself, so every draft is accepted.
    # One bucket of each kind: the draft model doubles every compile, and which bucket pads a
    # batch changes no token.
    engine = AsyncEngine(small_engine(cache_dir, speculative_model=str(smollm2_gguf()), speculative_method="draft",
                                      num_speculative_tokens=3, decode_buckets=(8,), prefill_buckets=(64,)))
    live = start_server(create_app(engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN))
    yield live
    live.close()
    engine.shutdown()


def test_a_draft_model_server_answers_as_the_plain_one(draft_server, client):
    import openai

    drafted = openai.OpenAI(base_url=draft_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name three rivers."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    spec = drafted.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    details = spec.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 20}
    sure = httpx.post(draft_server.url + "/v3/chat/completions", json=body | {"assistant_confidence_threshold": 0.5},
                      timeout=120)
    assert sure.status_code == 200, sure.text
    assert sure.json()["choices"][0]["message"]["content"] == plain.choices[0].message.content[:len(
        sure.json()["choices"][0]["message"]["content"])]
    for fields, param in (({"max_ngram_size": 2}, "max_ngram_size"),
                          ({"num_assistant_tokens": 2, "assistant_confidence_threshold": 0.5},
                           "assistant_confidence_threshold")):
        reply = httpx.post(draft_server.url + "/v3/chat/completions", json=body | fields, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
