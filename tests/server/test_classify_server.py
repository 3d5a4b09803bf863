"""POST /v1/classify on a real server: a tiny classifier started through the CLI's config path,
served by Hypercorn on a free port. The seed examples (single input, list input) in exactly
vLLM's / SGLang's shape with HF's probabilities; every error case with its status and vLLM's error
body, each followed by a request that succeeds; the legacy SGLang /classify; generation routes
refused with a reason (and /v1/classify refused by a generation server); `python -m jaxserve`."""

from __future__ import annotations

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from jaxserve.cli import config_from_args, parse_args
from jaxserve.server.classify import build_classify_server
from server.live_server import start_server
from tiny_classifiers import SENTIMENT, hf_logits, make_tiny_classifier, save_word_tokenizer

MODEL = "tiny-sentiment"
MAX_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-cls")
    hf = make_tiny_classifier("llama-cls", directory)
    save_word_tokenizer(directory)
    return directory, hf


@pytest.fixture(scope="module")
def live(model_dir, tmp_path_factory):
    directory, _ = model_dir
    args = parse_args(["--model", str(directory), "--served-model-name", MODEL, "--max-model-len", str(MAX_LEN),
                       "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                       "--cache-dir", str(tmp_path_factory.mktemp("cache")), "--max-request-bytes", "4096"])
    app, engine = build_classify_server(config_from_args(args))
    server = start_server(app)
    yield server
    server.close()
    engine.shutdown()


def _post(live, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(live.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def _reference_probs(model_dir, texts: list[str]) -> np.ndarray:
    from transformers import AutoTokenizer

    directory, hf = model_dir
    tok = AutoTokenizer.from_pretrained(directory)
    ids = [tok.encode(t, split_special_tokens=True) for t in texts]  # as jaxserve encodes user text
    return torch.softmax(hf_logits(hf, ids, 0), dim=-1).numpy()


def _check_shape(body: dict, n: int, num_tokens: int) -> None:
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert re.fullmatch(r"classify-[0-9a-f]{32}", body["id"])
    assert body["object"] == "list" and body["model"] == MODEL
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 60
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    assert [d["index"] for d in body["data"]] == list(range(n))
    for d in body["data"]:
        assert list(d) == ["index", "label", "probs", "num_classes"]
        assert d["num_classes"] == 3 and len(d["probs"]) == 3
        assert abs(sum(d["probs"]) - 1) < 1e-6
        assert d["label"] == SENTIMENT[int(np.argmax(d["probs"]))]


def test_single_input(live, model_dir):
    r = _post(live, "/v1/classify", {"model": MODEL, "input": "w5 w17 w99 w7"})
    assert r.status_code == 200, r.text
    body = r.json()
    _check_shape(body, 1, 4)
    np.testing.assert_allclose(body["data"][0]["probs"], _reference_probs(model_dir, ["w5 w17 w99 w7"])[0],
                               atol=1e-5)


def test_list_input(live, model_dir):
    texts = ["w5 w17 w99 w7", "w200", "w9 w8 w7 w6 w5 w4 w3 w2 w1 w12 w13"]
    r = _post(live, "/v1/classify", {"model": MODEL, "input": texts, "user": "u1", "priority": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    _check_shape(body, 3, 4 + 1 + 11)
    np.testing.assert_allclose([d["probs"] for d in body["data"]], _reference_probs(model_dir, texts), atol=1e-5)


def test_token_ids_and_vllm_classify_path(live):
    by_text = _post(live, "/v1/classify", {"input": "w5 w17"}).json()["data"][0]["probs"]
    by_ids = _post(live, "/classify", {"input": [5, 17]}).json()  # vLLM's path, model optional
    _check_shape(by_ids, 1, 2)
    np.testing.assert_allclose(by_ids["data"][0]["probs"], by_text, atol=1e-6)
    batch = _post(live, "/v1/classify", {"input": [[5, 17], [5, 17, 99]], "rid": ["a", "b"]}).json()
    _check_shape(batch, 2, 5)


def test_truncation_and_raw_logits_on_request(live):
    long_ids = list(range(4, 4 + MAX_LEN + 10))
    r = _post(live, "/v1/classify", {"input": long_ids, "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8
    tail = _post(live, "/v1/classify", {"input": long_ids[-8:]}).json()["data"][0]["probs"]
    np.testing.assert_allclose(r.json()["data"][0]["probs"], tail, atol=1e-6)
    assert _post(live, "/v1/classify", {"input": long_ids, "truncate_prompt_tokens": -1}).json()["usage"][
        "prompt_tokens"] == MAX_LEN
    raw = _post(live, "/v1/classify", {"input": long_ids[-8:], "activation": False}).json()["data"][0]
    e = np.exp(raw["probs"])
    np.testing.assert_allclose(e / e.sum(), tail, atol=1e-6)
    bad = _post(live, "/v1/classify", {"input": "w5", "truncate_prompt_tokens": MAX_LEN + 1})
    assert bad.status_code == 400 and f"must be -1 or in [1, {MAX_LEN}]" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_concurrent_requests_batch_without_changing_results(live):
    texts = [" ".join(f"w{(7 * i + j) % 250 + 4}" for j in range(1 + i % 13)) for i in range(24)]
    alone = [_post(live, "/v1/classify", {"input": t}).json()["data"][0]["probs"] for t in texts[:4]]
    with ThreadPoolExecutor(24) as pool:
        replies = list(pool.map(lambda t: _post(live, "/v1/classify", {"input": t}), texts))
    assert all(r.status_code == 200 for r in replies)
    np.testing.assert_allclose([r.json()["data"][0]["probs"] for r in replies[:4]], alone, atol=1e-6)


def test_legacy_sglang_classify(live):
    one = _post(live, "/classify", {"text": "w5 w17 w99 w7"})
    assert one.status_code == 200, one.text
    body = one.json()
    assert set(body) == {"embedding", "meta_info"} and len(body["embedding"]) == 3
    assert body["meta_info"]["prompt_tokens"] == 4
    probs = _post(live, "/v1/classify", {"input": "w5 w17 w99 w7"}).json()["data"][0]["probs"]
    e = np.exp(body["embedding"])
    np.testing.assert_allclose(e / e.sum(), probs, atol=1e-6)  # raw scores; their softmax is the probs
    many = _post(live, "/classify", {"input_ids": [[5, 6], [7]], "rid": ["x", "y"]}).json()
    assert [m["meta_info"]["id"] for m in many] == ["x", "y"]
    bad = _post(live, "/classify", {"text": ""})
    assert bad.status_code == 400 and set(bad.json()) == {"error"} and "empty" in bad.json()["error"]["message"]


LONG = " ".join(["w5"] * (MAX_LEN + 6))
ERRORS = [
    ({"model": MODEL}, 400, "input: Field required"),
    ({"input": ""}, 400, "input: must not be empty"),
    ({"input": "   "}, 400, "whitespace"),
    ({"input": []}, 400, "input: must not be empty"),
    ({"input": ["w5", ""]}, 400, "input[1]: must not be empty"),
    ({"input": [[5], []]}, 400, "input[1]: must not be empty"),
    ({"input": 5}, 400, "input: expected a string, a list of strings, a list of token ids or a list of lists of "
                        "token ids, got 5"),
    ({"input": [1.5]}, 400, "input: expected a string, a list of strings, a list of token ids or a list of lists "
                            "of token ids, got [1.5]"),
    ({"input": ["w5", 7]}, 400, 'got ["w5", 7]'),
    ({"input": {"text": "w5"}}, 400, 'got {"text": "w5"}'),
    ({"input": "w5", "priority": "high"}, 400, "priority"),
    ({"input": "w5", "model": 7}, 400, "model"),
    ({"input": "w5", "activaton": False}, 400, "activaton: unknown parameter"),
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "body"),
    ({"input": "w5", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
    ({"input": LONG}, 400, f"input: the input has {MAX_LEN + 6} tokens, more than the maximum context length of "
                           f"{MAX_LEN} tokens"),
    ({"input": ["w5", LONG]}, 400, f"input[1]: the input has {MAX_LEN + 6} tokens"),
    ({"input": [5, 300]}, 400, "token id 300 is outside the vocabulary [0, 256)"),
    ({"input": [5, -1]}, 400, "token id -1 is outside the vocabulary"),
    ({"input": ["w5", "w6"], "rid": ["a"]}, 400, "rid: 1 ids for 2 inputs"),
    (b'{"input": "' + b"w5 " * 2000 + b'"}', 413, "--max-request-bytes"),
]


@pytest.mark.parametrize("body,status,words", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_errors_then_the_next_request_succeeds(live, body, status, words):
    for path in ("/v1/classify", "/classify"):
        r = _post(live, path, body)
        assert r.status_code == status, r.text
        assert list(r.json()) == ["error"], r.json()  # vLLM's ErrorResponse
        err = r.json()["error"]
        assert list(err) == ["message", "type", "param", "code"] and err["code"] == status
        assert err["type"] == {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError"}[status]
        assert words in err["message"], err
        assert _post(live, path, {"input": "w5 w6"}).status_code == 200


def test_generation_routes_say_why(live):
    r = _post(live, "/v1/completions", {"model": MODEL, "prompt": "w5", "max_tokens": 2})
    assert r.status_code == 400 and "is a classification model and cannot generate text" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"  # the OpenAI shape on OpenAI's route
    r = _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "LlamaForSequenceClassification" in r.json()["error"]["message"]
    r = _post(live, "/generate", {"text": "w5"})
    assert r.status_code == 400 and "/v1/classify" in r.json()["error"]["message"]
    r = _post(live, f"/v2/models/{MODEL}/generate", {"text_input": "w5"})
    assert r.status_code == 400 and "classification model" in r.json()["error"]
    # Three labels are no single score, and a classifier is no embedding model.
    r = _post(live, "/v1/score", {"text_1": "w5", "text_2": "w6"})
    assert r.status_code == 400 and "has 3 labels; scoring needs a one-label cross-encoder" in r.text
    r = _post(live, "/v1/embeddings", {"input": "w5"})
    assert r.status_code == 400 and "not an embedding model" in r.text


def test_models_health_metrics_and_model_info(live):
    assert httpx.get(live.url + "/health").status_code == 200
    models = httpx.get(live.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == MAX_LEN
    assert httpx.get(live.url + f"/v1/models/{MODEL}").json() == models["data"][0]
    assert httpx.get(live.url + "/v1/models/other").status_code == 404
    assert httpx.get(live.url + "/version").json()["version"]
    info = httpx.get(live.url + "/get_model_info").json()
    assert info["is_generation"] is False and info["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    _post(live, "/v1/classify", {"input": "w5"})
    text = httpx.get(live.url + "/metrics").text
    assert re.search(r"^jaxserve:prompt_tokens_total [1-9]", text, re.M)
    assert 'jaxserve:request_success_total{finished_reason="classified"}' in text
    assert "/v1/classify" in httpx.get(live.url + "/openapi.json").json()["paths"]


def test_api_keys_on_a_classification_app(live):
    """A second app on the same engine with API keys: 401 in the classify shape without one."""
    from jaxserve.server.classify import create_classify_app

    state = live.app.extensions["jaxserve"]
    app = create_classify_app(state.engine, state.tokenizer, MODEL, state.config, MAX_LEN, api_keys=("k1",))

    async def go(headers: dict) -> tuple[int, dict]:
        r = await app.test_client().post("/v1/classify", json={"input": "w5"}, headers=headers)
        return r.status_code, json.loads(await r.get_data())

    status, body = asyncio.run(go({}))
    assert status == 401 and body["error"]["type"] == "UnauthorizedError" and body["error"]["code"] == 401
    status, body = asyncio.run(go({"Authorization": "Bearer k1"}))
    assert status == 200 and body["data"][0]["num_classes"] == 3


@pytest.mark.parametrize("flags", [["--decode-buckets", "16"], ["--prefill-buckets", "64", "256"]])
def test_bucket_flags_are_refused_for_a_classifier(model_dir, flags):
    """Generation's step grid; a classifier's token buckets are its own, so the flags are refused, not ignored."""
    from jaxserve.startup import start_classify_engine

    config = config_from_args(parse_args(["--model", str(model_dir), *flags]))
    with pytest.raises(ValueError, match="--decode-buckets / --prefill-buckets: classification and embedding"):
        start_classify_engine(config)


def test_generation_only_flags_are_refused_by_a_pooling_server(model_dir, tmp_path):
    """Flags only generation reads were accepted by a classification or embedding server and did
    nothing; they are refused, named, before the model loads."""
    import subprocess
    import sys

    from jaxserve.cli import check_pooling_flags

    check_pooling_flags(config_from_args(parse_args(["--model", "/m", "--max-num-seqs", "4", "--api-key", "k"])))
    for flags, named in ((["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
                         (["--num-pages", "64", "--page-size", "32"], "--page-size, --num-pages"),
                         (["--speculative-method", "ngram", "--num-speculative-tokens", "3"],
                          "--speculative-method, --num-speculative-tokens"),
                         (["--speculative-model", "/d", "--num-speculative-tokens", "3"],
                          "--speculative-method, --speculative-model, --num-speculative-tokens"),
                         (["--reasoning-parser", "deepseek_r1"], "--reasoning-parser"),
                         (["--enable-auto-tool-choice"], "--tool-call-parser / --enable-auto-tool-choice"),
                         (["--structured-output-workers", "4", "--max-n", "2"], "--max-n, --structured-output-*"),
                         (["--decode-steps", "4", "--no-prefix-caching"], "--no-prefix-caching, --decode-steps"),
                         (["--max-image-pixels", "100"], "--limit-mm-per-prompt / --allowed-local-media-path / "
                          "--allow-remote-media / --max-image-* / --media-fetch-timeout"),
                         (["--quantization-group-size", "64"], "--quantization-group-size")):
        with pytest.raises(ValueError, match=re.escape(f"{named}: for generation models only")):
            check_pooling_flags(config_from_args(parse_args(["--model", "/m", *flags])))
    directory, _ = model_dir
    run = subprocess.run([sys.executable, "-m", "jaxserve", "--model", str(directory), "--port", "0",
                          "--cache-dir", str(tmp_path / "c"), "--kv-cache-dtype", "fp8"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "--kv-cache-dtype: for generation models only" in run.stderr, run.stderr
    assert "model:" not in run.stderr  # refused before loading


def test_a_generation_server_refuses_classify(tmp_path):
    """The generation app (a real, uncompiled engine: refusing runs no step) says why."""
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.build import EngineConfig, build_engine
    from jaxserve.server.app import create_app
    from jaxserve.tokenizer import load_tokenizer
    from jaxserve.weights import load_model
    from tiny_models import make_tiny_model, save_tiny_tokenizer

    make_tiny_model("qwen2", tmp_path)
    save_tiny_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    config = EngineConfig(cache=CacheConfig(page_size=16, num_pages=8),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16, max_prefill_seqs=1,
                                                    max_model_len=64))
    engine = AsyncEngine(build_engine(load_model(tmp_path, "float32", use_cache=False).model, tokenizer, config,
                                      compile=False))
    try:
        app = create_app(engine, tokenizer, "tiny-lm", 64)

        async def go(path: str) -> tuple[int, dict]:
            r = await app.test_client().post(path, json={"input": "w5"})
            return r.status_code, json.loads(await r.get_data())

        for path in ("/v1/classify", "/classify"):
            status, body = asyncio.run(go(path))
            assert status == 400 and list(body) == ["error"]
            said = body["error"]["message"]
            assert "Qwen2ForCausalLM) is a text-generation model with no classification head" in said
        for path in ("/v1/embeddings", "/v1/score", "/v1/rerank", "/v2/rerank"):
            status, body = asyncio.run(go(path))
            assert status == 400 and "is served for text generation; embeddings" in body["error"]["message"], body
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_python_m_jaxserve_serves_a_classifier(model_dir, tmp_path):
    """The real entry point: --task auto detects the classifier; SIGTERM exits 0."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    directory, _ = model_dir
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve", "--model", str(directory), "--cache-dir", str(tmp_path / "c"),
         "--max-model-len", "32", "--port", str(port), "--served-model-name", "tiny", "--max-num-seqs", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/classify", json={"model": "tiny", "input": ["w5 w6", "w7"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "classify step shapes" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_task_flag(model_dir, tmp_path):
    from jaxserve.models.config import UnsupportedModelError
    from jaxserve.server.classify import detect_task
    from tiny_models import make_tiny_model

    directory, _ = model_dir
    assert detect_task(str(directory), "auto") == "classify"
    assert detect_task(str(directory), "classify") == "classify"
    with pytest.raises(UnsupportedModelError, match="is a classification model with no language-model head"):
        detect_task(str(directory), "generate")
    make_tiny_model("qwen2", tmp_path)
    assert detect_task(str(tmp_path), "auto") == "generate"
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM.*has no classification head"):
        detect_task(str(tmp_path), "classify")
    assert config_from_args(parse_args(["--model", "/m", "--task", "classify"])).model.task == "classify"
    assert detect_task(str(tmp_path), "embed") == "embed"  # any causal LM embeds (last token)
    with pytest.raises(UnsupportedModelError, match="--load-format dummy: .*--task embed loads its checkpoint"):
        detect_task(str(tmp_path), "embed", "dummy")
