"""`POST /v1/score` (`text_1`, `text_2`) and `POST /v1/rerank` (Jina / Cohere shape: `query`,
`documents`, `top_n`, `return_documents`), as vLLM serves them, also at `/score`, `/rerank` and
Cohere's `/v2/rerank`.

Two ways to score a pair, by what the server runs:
- a cross-encoder (a classifier with one label, e.g. BertForSequenceClassification trained as a
  sentence-transformers CrossEncoder): the pair is one input, tokenized as HF's
  `tokenizer(text_1, text_2)` (token types 0 then 1), and the score is its logit through the
  checkpoint's CrossEncoder activation (sigmoid unless config.json names Identity);
  `activation: false` returns the raw logit;
- an embedding model: each text is embedded once and the score is the cosine similarity.
A classifier with several labels has no single score: refused with 400 naming why.

Pairing, as vLLM defines it: `text_1` a string (or a one-item list) is scored against every
`text_2`; two lists of the same length are scored item by item; other lengths are refused.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pydantic
from pydantic import BaseModel, ConfigDict
from quart import Quart, Response, jsonify, request

from jaxserve.engine.classify_batcher import cosine
from jaxserve.models.classifier import ClassifierConfig
from jaxserve.server import accepted_fields
from jaxserve.server.accepted_fields import KnownFields
from jaxserve.server.errors import ApiError
from jaxserve.server.generation import new_id, route

if TYPE_CHECKING:
    from jaxserve.server.classify import ClassifyState


class ScoreRequest(KnownFields):
    model_config = ConfigDict(strict=True)
    IGNORED = accepted_fields.SCORE
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    activation: bool = True  # cross-encoders: false returns the raw logit
    user: str | None = None
    priority: int = 0


class RerankDocument(BaseModel):
    # A document object's other keys are the caller's (Cohere's carry any); only text is ranked.
    model_config = ConfigDict(strict=True, extra="ignore")
    text: str


class RerankRequest(KnownFields):
    model_config = ConfigDict(strict=True)
    IGNORED = accepted_fields.SCORE
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int = pydantic.Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    activation: bool = True
    user: str | None = None
    priority: int = 0


ROUTES = (("/v1/score", ScoreRequest), ("/score", ScoreRequest), ("/v1/rerank", RerankRequest),
          ("/rerank", RerankRequest), ("/v2/rerank", RerankRequest))


Pair = tuple[str, str]


def pairs(text_1: str | list[str], text_2: str | list[str]) -> tuple[list[Pair], list[Pair]]:
    """(first, second) of every score, by vLLM's pairing rules, and the request's names of the two
    texts (for errors); empty texts are refused."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    named = {}
    for param, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise ApiError(400, f"{param}: must not be empty", param)
        named[param] = [param if len(texts) == 1 else f"{param}[{i}]" for i in range(len(texts))]
        for t, where in zip(texts, named[param]):
            if not t.strip():
                raise ApiError(400, f"{where}: must not be empty or only whitespace", param)
    if len(first) == 1:
        first, named["text_1"] = first * len(second), named["text_1"] * len(second)
    if len(first) != len(second):
        raise ApiError(400, f"text_1 and text_2: {len(first)} and {len(second)} texts; give one text_1 for any "
                       "number of text_2, or lists of the same length", "text_2")
    return list(zip(first, second)), list(zip(named["text_1"], named["text_2"]))


def _activate(logit: float, cfg: ClassifierConfig, activation: bool) -> float:
    if activation and cfg.score_activation == "sigmoid":
        return float(1.0 / (1.0 + np.exp(-np.float64(logit))))
    return float(logit)


async def cross_encoder_scores(state: ClassifyState, pair_list: list[Pair], names: list[Pair],
                               truncate: int | None, activation: bool, priority: int) -> tuple[list[float], int]:
    """One input per pair through the one-label classifier (an input too long is named by its
    second text); returns (scores, prompt tokens)."""
    from jaxserve.server.classify import check_tokens, request_ids, truncation

    cfg = state.config
    assert isinstance(cfg, ClassifierConfig)
    if cfg.num_labels != 1:
        raise ApiError(400, f"model `{state.model_name}` ({cfg.architecture}) has {cfg.num_labels} labels; scoring "
                       "needs a one-label cross-encoder (or an embedding model); use /v1/classify for class "
                       "probabilities", code="wrong_task")
    max_length = None if truncate is None else truncation(state, truncate)
    inputs, types = [], []
    for (a, b), (_, name) in zip(pair_list, names):
        ids, tt = state.tokenizer.encode_pair(a, b, max_length)
        check_tokens(state, ids, name)
        inputs.append(ids)
        types.append(tt)
    results = await state.run(request_ids(None, len(inputs), "score"), inputs, priority, types)
    return [_activate(r.output[0], cfg, activation) for r in results], sum(r.num_tokens for r in results)


async def embedding_scores(state: ClassifyState, pair_list: list[Pair], names: list[Pair],
                           truncate: int | None, priority: int) -> tuple[list[float], int]:
    """Cosine similarity of each pair's pooled vectors (normalising first would not change it);
    every distinct text is embedded once, and an input too long is named where it first appears."""
    from jaxserve.server.classify import check_tokens, request_ids, truncation

    names_of: dict[str, str] = {}
    for pair, pair_names in zip(pair_list, names):
        for text, name in zip(pair, pair_names):
            names_of.setdefault(text, name)
    texts = list(names_of)
    limit = None if truncate is None else truncation(state, truncate)
    inputs = []
    for t in texts:
        ids = state.tokenizer.encode_prompt(t)
        if limit is not None:
            ids = ids[-limit:]
        check_tokens(state, ids, names_of[t])
        inputs.append(ids)
    results = await state.run(request_ids(None, len(inputs), "score"), inputs, priority)
    vectors = {t: r.output for t, r in zip(texts, results)}
    return [cosine(vectors[a], vectors[b]) for a, b in pair_list], sum(r.num_tokens for r in results)


async def _scores(state: ClassifyState, pair_list: list[Pair], names: list[Pair],
                  truncate: int | None, activation: bool, priority: int) -> tuple[list[float], int]:
    if state.task == "embed":
        return await embedding_scores(state, pair_list, names, truncate, priority)
    return await cross_encoder_scores(state, pair_list, names, truncate, activation, priority)


async def score(state: ClassifyState) -> Response:
    """Score text pairs: a cross-encoder's relevance, or an embedding model's cosine similarity."""
    from jaxserve.server.classify import parse

    req = parse(ScoreRequest, await request.get_data(cache=False), "text_2", "a string or a list of strings")
    state.model_names.check(req.model)
    pair_list, names = pairs(req.text_1, req.text_2)
    scores, num_tokens = await _scores(state, pair_list, names, req.truncate_prompt_tokens, req.activation,
                                       req.priority)
    return jsonify({
        "id": new_id("score"), "object": "list", "created": int(time.time()), "model": state.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    })


async def rerank(state: ClassifyState) -> Response:
    """Rank documents by relevance to a query, best first (the first `top_n`, if given)."""
    from jaxserve.server.classify import parse

    req = parse(RerankRequest, await request.get_data(cache=False), "documents",
                "a list of strings or of {\"text\": ...} objects")
    state.model_names.check(req.model)
    if not req.query.strip():
        raise ApiError(400, "query: must not be empty or only whitespace", "query")
    if not req.documents:
        raise ApiError(400, "documents: must not be empty", "documents")
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    for i, d in enumerate(docs):
        if not d.strip():
            raise ApiError(400, f"documents[{i}]: must not be empty or only whitespace", "documents")
    scores, num_tokens = await _scores(state, [(req.query, d) for d in docs],
                                       [("query", f"documents[{i}]") for i in range(len(docs))],
                                       req.truncate_prompt_tokens, req.activation, req.priority)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[: req.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return jsonify({"id": new_id("rerank"), "model": state.model_name, "usage": {"total_tokens": num_tokens},
                    "results": results})


def register(app: Quart, state: ClassifyState) -> None:
    for rule, model in ROUTES:
        route(app, state, rule, score if model is ScoreRequest else rerank, "POST", model)
