"""Embeddings, scores and reranking on a real server (Hypercorn on a free port, started through
the CLI's config path): a tiny sentence-transformers BertModel (mean pooling, normalised,
Matryoshka sizes 16 and 32) through the official `openai` client, float and base64, equal to
sentence-transformers' embeddings within 1e-5; /v1/score and /v1/rerank as cosine similarities;
a one-label cross-encoder's /v1/score and /v1/rerank equal to HF's sigmoid(logit) for text pairs;
every error with its status and reason; each server refuses the other tasks' routes."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch
from server.live_server import start_server
from tiny_classifiers import make_tiny_classifier, save_word_tokenizer
from tiny_embedders import make_tiny_embedder, reference_embeddings

from jaxserve.cli import config_from_args, parse_args
from jaxserve.server.classify import build_classify_server, detect_task

MODEL = "tiny-embed"
MAX_LEN = 32


def _serve(directory, cache_dir, *extra: str):
    args = parse_args(["--model", str(directory), "--served-model-name", MODEL, "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "64", "--cache-dir", str(cache_dir), "--dtype", "float32",
                       *extra])
    config = config_from_args(args)
    app, engine = build_classify_server(config, detect_task(config.model.model, config.model.task))
    return start_server(app), engine


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-embed")
    hf = make_tiny_embedder("bert", directory, "mean", True, max_seq_length=MAX_LEN, matryoshka_dimensions=[16, 32])
    save_word_tokenizer(directory, bert=True)
    server, engine = _serve(directory, tmp_path_factory.mktemp("cache"))
    yield server, hf
    server.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-ce")
    hf = make_tiny_classifier("bert-cross-encoder", directory)
    save_word_tokenizer(directory, bert=True)
    server, engine = _serve(directory, tmp_path_factory.mktemp("cache"), "--max-model-len", str(MAX_LEN))
    yield server, hf
    server.close()
    engine.shutdown()


def _ids(text: str) -> list[int]:
    return [101, *(int(w[1:]) for w in text.split()), 102]


def _reference(hf, texts: list[str]) -> np.ndarray:
    return reference_embeddings(hf, [_ids(t) for t in texts], "mean", True).numpy()


def _post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


TEXTS = ["w5 w6", "w7 w8 w9 w10 w11", "w12"]


def test_openai_client_embeddings_float_and_base64(embedder):
    server, hf = embedder
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    ref = _reference(hf, TEXTS)
    got = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == MODEL and got.object == "list"
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), ref, atol=1e-5, rtol=0)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(_ids(t)) for t in TEXTS)
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, ref[0], atol=1e-5, rtol=0)
    by_ids = client.embeddings.create(model=MODEL, input=[_ids(t) for t in TEXTS[:2]], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in by_ids.data], ref[:2], atol=1e-5, rtol=0)


def test_matryoshka_dimensions_and_normalize(embedder):
    server, hf = embedder
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    pooled = reference_embeddings(hf, [_ids(TEXTS[1])], "mean", False)[0].numpy()
    cut = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=16).data[0].embedding
    np.testing.assert_allclose(cut, pooled[:16] / np.linalg.norm(pooled[:16]), atol=1e-5, rtol=0)
    with pytest.raises(openai.BadRequestError, match=r"dimensions: must be one of \[16, 32\]"):
        client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=20)
    raw = _post(server, "/v1/embeddings", {"input": TEXTS[1], "normalize": False}).json()
    np.testing.assert_allclose(raw["data"][0]["embedding"], pooled, atol=1e-5, rtol=0)


def test_score_and_rerank_are_cosine_similarities(embedder):
    server, hf = embedder
    ref = _reference(hf, TEXTS)
    cos = lambda a, b: float(ref[a] @ ref[b])
    r = _post(server, "/v1/score", {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert r["object"] == "list" and [d["index"] for d in r["data"]] == [0, 1]
    np.testing.assert_allclose([d["score"] for d in r["data"]], [cos(0, 1), cos(0, 2)], atol=1e-5)
    r = _post(server, "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    np.testing.assert_allclose([d["score"] for d in r["data"]], [cos(0, 1), cos(1, 2)], atol=1e-5)
    r = _post(server, "/v1/rerank", {"model": MODEL, "query": TEXTS[0], "documents": TEXTS, "top_n": 2}).json()
    want = sorted(range(3), key=lambda i: -cos(0, i))[:2]
    assert [x["index"] for x in r["results"]] == want and want[0] == 0
    assert r["results"][0]["document"] == {"text": TEXTS[0]}
    np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], [cos(0, i) for i in want], atol=1e-5)
    r = _post(server, "/v2/rerank", {"query": TEXTS[0], "documents": [{"text": t} for t in TEXTS],
                                     "return_documents": False}).json()
    assert len(r["results"]) == 3 and "document" not in r["results"][0]


@pytest.mark.parametrize("path,body,words", [
    ("/v1/embeddings", {"input": []}, "input: must not be empty"),
    ("/v1/embeddings", {"input": "  "}, "input: must not be empty or only whitespace"),
    ("/v1/embeddings", {"input": " ".join(["w5"] * 40)}, "maximum context length of 32"),
    ("/v1/embeddings", {"input": "w5", "encoding_format": "binary"}, "encoding_format"),
    ("/v1/embeddings", {"input": "w5", "model": "other"}, "other"),
    ("/v1/embeddings", {"input": "w5", "dimension": 16}, "dimension: unknown parameter"),
    ("/v1/rerank", {"query": "w5", "documents": ["w6"], "topn": 1}, "topn: unknown parameter"),
    ("/v1/score", {"text_1": ["w5", "w6"], "text_2": ["w5", "w6", "w7"]}, "2 and 3 texts"),
    ("/v1/rerank", {"query": "w5", "documents": []}, "documents: must not be empty"),
    ("/v1/rerank", {"query": "w5", "documents": ["w6"], "top_n": -1}, "top_n"),
    ("/v1/classify", {"input": "w5"}, "is an embedding model with no classification head"),
    ("/v1/completions", {"prompt": "w5"}, "is an embedding model and cannot generate text"),
])
def test_errors_then_the_next_request_succeeds(embedder, path, body, words):
    server, _ = embedder
    r = _post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert words in json.dumps(r.json()), r.json()
    assert _post(server, "/v1/embeddings", {"input": "w5"}).status_code == 200


def test_model_info_and_openapi(embedder):
    server, _ = embedder
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["embedding_dimensions"] == 64 and info["pooling"] == "mean" and info["is_generation"] is False
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"] == MAX_LEN  # max_seq_length
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/embeddings", "/v1/score", "/v1/rerank"} <= set(paths)


def _cross_reference(hf, pairs: list[tuple[str, str]]) -> np.ndarray:
    out = []
    with torch.no_grad():
        for a, b in pairs:
            ids = _ids(a) + _ids(b)[1:]
            types = [0] * len(_ids(a)) + [1] * (len(ids) - len(_ids(a)))
            out.append(hf(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0, 0].item())
    return np.array(out)


def test_cross_encoder_score_and_rerank(cross_encoder):
    server, hf = cross_encoder
    docs = ["w7 w8 w9", "w40", "w13 w14 w15 w16"]
    logits = _cross_reference(hf, [("w5 w6", d) for d in docs])
    r = _post(server, "/v1/score", {"text_1": "w5 w6", "text_2": docs}).json()
    np.testing.assert_allclose([d["score"] for d in r["data"]], 1 / (1 + np.exp(-logits)), atol=1e-5)
    assert r["usage"]["prompt_tokens"] == sum(len(_ids("w5 w6")) + len(_ids(d)) - 1 for d in docs)
    raw = _post(server, "/v1/score", {"text_1": "w5 w6", "text_2": docs[0], "activation": False}).json()
    assert raw["data"][0]["score"] == pytest.approx(logits[0], abs=1e-5)
    r = _post(server, "/v1/rerank", {"query": "w5 w6", "documents": docs}).json()
    assert [x["index"] for x in r["results"]] == list(np.argsort(-logits))
    r = _post(server, "/v1/embeddings", {"input": "w5"})
    assert r.status_code == 400 and "is a classification model, not an embedding model" in r.text
    too_long = " ".join(["w9"] * 30)
    r = _post(server, "/v1/score", {"text_1": "w5", "text_2": ["w6", too_long]})
    assert r.status_code == 400 and "text_2[1]" in r.text and "maximum context length of 32" in r.text
    r = _post(server, "/v1/score", {"text_1": "w5", "text_2": too_long, "truncate_prompt_tokens": 32})
    assert r.status_code == 200


def test_qwen3_reranker_through_hf_overrides(tmp_path):
    """`--hf-overrides` serves a causal LM as Qwen3-Reranker's model card scores: /v1/rerank's
    relevance is P(w9) against w7 at the pair's last token (the query then the document)."""
    from model.test_embed_parity import RERANKER
    from tiny_models import make_tiny_model, save_tiny_tokenizer

    hf = make_tiny_model("qwen3", tmp_path / "m")
    save_tiny_tokenizer(tmp_path / "m")
    server, engine = _serve(tmp_path / "m", tmp_path / "cache", "--max-model-len", str(MAX_LEN),
                            "--hf-overrides", json.dumps(RERANKER))
    try:
        docs = ["w30 w31", "w40", "w50 w51 w52"]  # no w1.. or w2.. words: w1 and w2 are special tokens
        r = _post(server, "/v1/rerank", {"query": "w5 w6", "documents": docs}).json()
        with torch.no_grad():
            logits = [hf(input_ids=torch.tensor([[5, 6, *(int(w[1:]) for w in d.split())]])).logits[0, -1]
                      for d in docs]
        want = [float(torch.softmax(lg[[7, 9]], -1)[1]) for lg in logits]
        assert [x["index"] for x in r["results"]] == list(np.argsort(want)[::-1])
        np.testing.assert_allclose([x["relevance_score"] for x in sorted(r["results"], key=lambda x: x["index"])],
                                   want, atol=1e-5)
    finally:
        server.close()
        engine.shutdown()
    with pytest.raises(SystemExit):
        parse_args(["--hf-overrides", "[1]"])
