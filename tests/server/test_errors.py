"""Bad input gets its status and its protocol's error shape (never a 422 or 500), and the server
keeps serving; API keys; --max-concurrent-requests; --request-timeout; body size."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from live_server import API_KEY, MODEL

pytestmark = pytest.mark.slow

OK_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
CHAT = [{"role": "user", "content": "Hi"}]

# (route, body, status, param, words the message must contain)
BAD = [
    ("/v1/completions", b"{not json", 400, None, "JSON"),
    ("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 1}', 400, None, "JSON"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens", "[1,"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**6}, 400, "max_tokens", "context limit of 512"),
    ("/v1/completions", {"prompt": "Hi", "n": 1000}, 400, "n", "[1, 128]"),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature", "[0.0, 100.0]"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": {"type": "object", "not": {}}}, 400, "guided_json",
     "unsupported or invalid JSON schema"),
    ("/v1/completions", {"prompt": "Hi", "stream": True, "n": 1, "best_of": 2}, 400, "best_of", "streaming"),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "role"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_objects"}}, 400, "response_format",
     "must be 'text', 'json_object', 'json_schema' or 'structural_tag'"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "20"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only with stream: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages[0].content[0].text", "needs its text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0]", "takes no images"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{% if %}"}, 400, "messages", "chat template"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 600}, 400, "max_tokens", "512"),
    ("/v1/chat/completions", {"messages": CHAT, "reasoning_max_tokens": 100}, 400, "reasoning_max_tokens",
     "--reasoning-parser"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt", "exactly one"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "vocabulary"),
    # Prompt-lookup decoding's fields need a server started with it (the engine's refusal).
    ("/v1/chat/completions", {"messages": CHAT, "num_assistant_tokens": 3}, 400, "num_assistant_tokens",
     "--speculative-method ngram"),
    ("/v1/completions", {"prompt": "Hi", "max_ngram_size": 2}, 400, "max_ngram_size", "--speculative-method ngram"),
    # Beam search scores by the model's own log-probabilities: sampling knobs are refused, not ignored.
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "best_of": 2, "temperature": 0.7}, 400,
     "temperature", "log-probabilities"),
    ("/v1/completions", {"prompt": "Hi", "length_penalty": 1.5}, 400, "length_penalty", "beam search"),
    ("/v3/completions", {"prompt": "Hi", "best_of": 2, "stream": True}, 400, "best_of", "stream"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_openai_errors(server, path, body, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert httpx.post(server.url + "/v1/completions", json=OK_COMPLETION, timeout=60).status_code == 200


def test_body_too_large_and_unknown_routes(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 100_000}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(server.url + "/v1/audio/transcriptions", json={}, timeout=60)
    assert r.status_code == 404 and "error" in r.json()
    # A route of another task is no unknown route: the generation server says why it refuses.
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task"
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    assert httpx.post(server.url + "/v1/completions", json=OK_COMPLETION, timeout=60).status_code == 200


INFERENCE_ROUTES = [
    ("POST", "/v1/completions", OK_COMPLETION),
    ("POST", "/v3/completions", OK_COMPLETION),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    ("POST", "/v3/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("POST", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/abort_request", {"rid": "x"}),
    ("POST", f"/v2/models/{MODEL}/generate", {"text_input": "Hi", "parameters": {"max_tokens": 1}}),
    ("POST", f"/v2/models/{MODEL}/generate_stream", {"text_input": "Hi", "parameters": {"max_tokens": 1}}),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/get_model_info", None),
    ("GET", "/health_generate", None),
    ("GET", "/v2/health/ready", None),
    ("GET", f"/v2/models/{MODEL}", None),
]


def test_api_key_on_every_route(guarded_server):
    url = guarded_server.url
    assert httpx.get(url + "/health").status_code == 200  # public
    for method, path, body in INFERENCE_ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            if path.startswith("/v2/"):
                assert isinstance(err, str)
            elif path in ("/generate", "/abort_request", "/get_model_info", "/health_generate"):
                assert "API key" in err["message"]
            else:
                assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
        r = httpx.request(method, url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert r.status_code == 200, (path, r.text)
    r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer second-key"})  # any configured key
    assert r.status_code == 200


def test_concurrency_limit_and_request_timeout(guarded_server):
    url, auth = guarded_server.url, {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=60) as held:
        lines = held.iter_lines()
        next(line for line in lines if line)
        r = httpx.post(url + "/v1/completions", json=OK_COMPLETION, headers=auth, timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
        events = [json.loads(line[6:]) for line in lines if line and line != "data: [DONE]"]
    assert events[-1]["choices"][0]["finish_reason"] == "timeout"  # the 2 s deadline, not max_tokens
    assert time.monotonic() - start < 30
    assert httpx.post(url + "/v1/completions", json=OK_COMPLETION, headers=auth, timeout=60).status_code == 200
