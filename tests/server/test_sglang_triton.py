"""SGLang's /generate and /abort_request, Triton's generate and generate_stream, over plain HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

from live_server import MODEL
from sse_client import post_stream

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


# ---- SGLang ---------------------------------------------------------------------------------------
def test_generate_single(server):
    r = _post(server, "/generate", {"text": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200
    out = r.json()
    assert out["text"].startswith(" Paris.") and len(out["output_ids"]) == 8
    meta = out["meta_info"]
    assert meta["id"] and meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert isinstance(meta["cached_tokens"], int)


def test_generate_docs_example_defaults_and_stop(server):
    # SGLang's README example: {"text": ..., "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
    r = _post(server, "/generate", {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 32,
                                                                         "stop": "answer"}}).json()
    assert r["text"] == " Paris.\n\nThe "
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "answer"}


def test_generate_batch_input_ids_and_per_prompt_params(server, smollm2_tokenizer):
    ids = [smollm2_tokenizer.encode(PROMPT), smollm2_tokenizer.encode("1, 2, 3,")]
    r = _post(server, "/generate", {"input_ids": ids, "rid": ["b-0", "b-1"],
                                    "sampling_params": [GREEDY, {"max_new_tokens": 3, "temperature": 0}]}).json()
    assert isinstance(r, list) and len(r) == 2
    assert r[0]["text"].startswith(" Paris.") and r[1]["meta_info"]["completion_tokens"] == 3
    assert [x["meta_info"]["id"] for x in r] == ["b-0", "b-1"]


def test_generate_n2_and_logprobs(server):
    r = _post(server, "/generate", {"text": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                                    "return_text_in_logprobs": True,
                                    "sampling_params": {"n": 2, "max_new_tokens": 4, "temperature": 1.0,
                                                        "ignore_eos": True}}).json()
    assert isinstance(r, list) and len(r) == 2
    for item in r:
        lps = item["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in lps] == item["output_ids"]
        assert all(e[0] <= 0 and isinstance(e[2], str) for e in lps)
        assert all(len(top) == 2 for top in item["meta_info"]["output_top_logprobs"])


def test_generate_stream_cumulative(server):
    whole = _post(server, "/generate", {"text": PROMPT, "sampling_params": GREEDY}).json()
    events = post_stream(server.url + "/generate", {"text": PROMPT, "sampling_params": GREEDY, "stream": True})
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == whole["text"] and events[-2]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request(server):
    body = {"text": "Once upon a time", "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[len("data: "):])["meta_info"]["finish_reason"] is None
        assert _post(server, "/abort_request", {"rid": "abort-me"}).status_code == 200
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][len("data: "):])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 400


def test_abort_request_ends_one_sample_by_its_rid(server):
    """n samples are each their own request in SGLang, named rid_0, rid_1, ...: aborting rid_1
    ends that one and the other runs to its limit."""
    body = {"text": "Once upon a time", "rid": "pair", "stream": True,
            "sampling_params": {"n": 2, "max_new_tokens": 300, "ignore_eos": True, "temperature": 0}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line)[len("data: "):])
        assert first["meta_info"]["id"] in ("pair_0", "pair_1") and first["meta_info"]["finish_reason"] is None
        assert _post(server, "/abort_request", {"rid": "pair_1"}).status_code == 200
        events = [json.loads(line[len("data: "):]) for line in lines if line and line != "data: [DONE]"]
    last = {e["index"]: e["meta_info"] for e in events}
    assert last[1]["id"] == "pair_1" and last[1]["finish_reason"]["type"] == "abort"
    assert last[1]["completion_tokens"] < 300
    assert last[0]["finish_reason"]["type"] == "length" and last[0]["completion_tokens"] == 300
    # A rid that names nothing (no such request, no such sample) is a no-op, as in SGLang; one
    # whose "index" int() cannot read ("²" is a digit to str.isdigit) leaves the engine running.
    for rid in ("pair_7", "pair_²", "pair_" + "9" * 5000):
        assert _post(server, "/abort_request", {"rid": rid}).status_code == 200
    assert _post(server, "/generate", {"text": PROMPT, "sampling_params": GREEDY}).status_code == 200


def test_generate_refuses_images_and_unknown_params(server):
    r = _post(server, "/generate", {"text": PROMPT, "image_data": "http://x/y.png"})
    assert r.status_code == 400 and "image_data" in r.json()["error"]["message"]
    r = _post(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokenz": 3}})
    assert r.status_code == 400 and "max_new_tokenz" in r.json()["error"]["message"]
    r = _post(server, "/generate", {"text": PROMPT, "sampling_params": {"structural_tag": "{}"}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("sampling_params.structural_tag: trigg")
    # An empty list gives no parameters to the one prompt: refused, not taken as the defaults.
    r = _post(server, "/generate", {"text": PROMPT, "sampling_params": []})
    assert r.status_code == 400 and "sampling_params: a list needs one entry per prompt (1), got 0" in r.text


# ---- Triton ---------------------------------------------------------------------------------------
def test_triton_generate(server):
    path = f"/v2/models/{MODEL}/generate"
    r = _post(server, path, {"id": "42", "text_input": PROMPT, "parameters": {"max_tokens": 8, "temperature": 0}})
    assert r.status_code == 200
    out = r.json()
    assert (out["id"], out["model_name"], out["model_version"]) == ("42", MODEL, "1")
    assert out["text_output"].startswith(PROMPT + " Paris.")
    # TensorRT-LLM's documented example: parameters at the top level, "" for no words.
    trt = _post(server, f"/v2/models/{MODEL}/versions/1/generate",
                {"text_input": PROMPT, "max_tokens": 8, "bad_words": "", "stop_words": "", "temperature": 0,
                 "parameters": {"exclude_input_in_output": True}}).json()
    assert trt["text_output"] == out["text_output"][len(PROMPT):] and "id" not in trt


def test_triton_generate_stream(server):
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 8, "temperature": 0}}
    whole = _post(server, f"/v2/models/{MODEL}/generate", body).json()["text_output"]
    events = post_stream(server.url + f"/v2/models/{MODEL}/generate_stream", body)
    assert "[DONE]" not in events and len(events) > 1
    assert "".join(e["text_output"] for e in events) == whole
    assert all("sequence_index" not in e for e in events)
    # Two samples: their increments interleave, each event names its sample, and each sample's
    # text (prompt first) is the one the whole response gives.
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2}}
    whole = _post(server, f"/v2/models/{MODEL}/generate", body).json()["text_output"]
    events = post_stream(server.url + f"/v2/models/{MODEL}/generate_stream", body)
    assert len(whole) == 2 and {e["sequence_index"] for e in events} == {0, 1}
    assert ["".join(e["text_output"] for e in events if e["sequence_index"] == i) for i in (0, 1)] == whole


def test_model_info_and_readiness_routes(server):
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["is_generation"] and info["model_path"] == MODEL
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    meta = httpx.get(server.url + f"/v2/models/{MODEL}").json()
    assert meta["name"] == MODEL and meta["versions"] == ["1"]
    assert httpx.get(server.url + f"/v2/models/{MODEL}/versions/1/ready").status_code == 200
    r = httpx.get(server.url + "/v2/models/other/ready")
    assert r.status_code == 404 and isinstance(r.json()["error"], str)


def test_triton_errors(server):
    r = _post(server, "/v2/models/nope/generate", {"text_input": PROMPT})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = _post(server, f"/v2/models/{MODEL}/versions/7/generate", {"text_input": PROMPT})
    assert r.status_code == 404
    r = _post(server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": {"beam_width": 2}})
    assert r.status_code == 400 and "beam_width" in r.json()["error"]
    r = _post(server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": {"max_tokens": "8"}})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]
    r = _post(server, f"/v2/models/{MODEL}/generate_stream", {"text_input": PROMPT, "parameters": {"max_tokens": 9999}})
    assert r.status_code == 400 and "512" in r.json()["error"]


def test_generate_input_logprobs_from_logprob_start_len(server, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("The capital of France is")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True}
    meta = _post(server, "/generate", body).json()["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == ids and inputs[0][0] is None
    assert all(e[0] <= 0 for e in inputs[1:]) and inputs[1][2] == smollm2_tokenizer.decode([ids[1]])
    assert meta["input_top_logprobs"][0] is None and all(len(t) == 2 for t in meta["input_top_logprobs"][1:])
    # As SGLang: the first listed input logprob is always null, from logprob_start_len on too.
    later = _post(server, "/generate", {**body, "logprob_start_len": 2}).json()["meta_info"]
    assert [e[1] for e in later["input_token_logprobs"]] == ids[2:] and later["input_token_logprobs"][0][0] is None
    assert [e[0] for e in later["input_token_logprobs"][1:]] == pytest.approx([e[0] for e in inputs[3:]], abs=1e-5)
    assert later["input_top_logprobs"][0] is None and len(later["input_top_logprobs"][1]) == 2
    # The default (-1) lists the last prompt token, with its null.
    default = _post(server, "/generate", {k: v for k, v in body.items() if k != "logprob_start_len"}).json()
    assert default["meta_info"]["input_token_logprobs"] == [[None, ids[-1], smollm2_tokenizer.decode([ids[-1]])]]
    r = _post(server, "/generate", {**body, "logprob_start_len": len(ids)})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("logprob_start_len:"), r.text


def test_generate_errors_name_sglang_fields_and_samples_have_their_own_ids(server):
    for value, words in ((-1, "[1, "), (100000, "max_new_tokens is 100000")):
        r = _post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": value}})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and message.startswith("sampling_params.max_new_tokens:"), message
        assert words in message and "max_tokens" not in message, message
    r = _post(server, "/generate", {"text": "hi", "sampling_params": {"sampling_seed": 2**70}})
    assert r.json()["error"]["message"].startswith("sampling_params.sampling_seed:"), r.text
    items = _post(server, "/generate", {"text": "Hello", "rid": "abc",
                                        "sampling_params": {"max_new_tokens": 2, "n": 2}}).json()
    assert [item["meta_info"]["id"] for item in items] == ["abc_0", "abc_1"]
