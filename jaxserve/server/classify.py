"""Classification over HTTP: `POST /v1/classify` (vLLM's and SGLang's classify API, also at vLLM's
`/classify`), SGLang's legacy reward-model `/classify` (`text` / `input_ids` in, raw scores out as
`embedding`), and the app that serves a pooling model: a classifier (`--task classify`) or an
embedding model (`--task embed`, routes in embeddings.py), both with /v1/score and /v1/rerank
(scoring.py).

A pooling model cannot generate, a generative model has no pooling head, and a classifier is not
an embedding model, so each app answers the others' routes with a 400 that says why, instead of a
bare 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict
from quart import Quart, Response, jsonify, request

from jaxserve.engine.classify import AsyncClassifyEngine, ClassifyResult, RequestAbortedError
from jaxserve.engine.classify_batcher import probabilities
from jaxserve.errors import InvalidRequestError
from jaxserve.models.classifier import ClassifierConfig
from jaxserve.models.embedder import EmbedderConfig, PoolingConfig
from jaxserve.server import accepted_fields
from jaxserve.server.accepted_fields import KnownFields
from jaxserve.server.base_app import (
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    base_app,
    check_limits,
)
from jaxserve.server.cors import CorsPolicy, cors_policy
from jaxserve.server.errors import ApiError, error_response
from jaxserve.server.generation import new_id, route, truncation_length
from jaxserve.server.metrics import Metrics
from jaxserve.server.model_names import ModelNames, served_names
from jaxserve.tokenizer import Tokenizer

M = TypeVar("M", bound=BaseModel)


# Routes of the generation APIs, refused with a reason by a classification server.
GENERATION_ROUTES = (
    "/v1/completions", "/v1/chat/completions", "/v3/completions", "/v3/chat/completions", "/v1/responses", "/generate",
    "/v2/models/<name>/generate", "/v2/models/<name>/generate_stream",
    "/v2/models/<name>/versions/<version>/generate", "/v2/models/<name>/versions/<version>/generate_stream",
)


# ---- protocol ------------------------------------------------------------------------------------
class ClassifyRequest(KnownFields):
    """vLLM / SGLang classify request. Token-id inputs (vLLM accepts them) skip the tokenizer."""

    model_config = ConfigDict(strict=True)
    IGNORED = accepted_fields.CLASSIFY
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None
    rid: str | list[str] | None = None
    priority: int = 0  # lower runs first
    add_special_tokens: bool = True
    # vLLM's: keep only the last k tokens of each input (-1: the last max_model_len); off by default,
    # so nothing is truncated unless asked.
    truncate_prompt_tokens: int | None = None
    activation: bool = True  # vLLM's: false returns the raw logits instead of probs (class_activation)


class LegacyClassifyRequest(KnownFields):
    """SGLang's reward-model /classify (its EmbeddingReqInput): text or input_ids, single or batch."""

    model_config = ConfigDict(strict=True)
    IGNORED = accepted_fields.SGLANG_CLASSIFY
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    priority: int | None = None


# ---- state ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class ClassifyState:
    engine: AsyncClassifyEngine
    tokenizer: Tokenizer
    model_names: ModelNames  # what requests may name; the first is reported
    config: PoolingConfig
    max_model_len: int
    max_concurrent_requests: int
    request_timeout: float | None
    metrics: Metrics
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0
    draining: bool = False
    in_flight: set[str] = dataclasses.field(default_factory=set)  # engine request ids

    @property
    def model_name(self) -> str:
        return self.model_names.primary

    @property
    def task(self) -> str:
        """classify or embed."""
        return "embed" if isinstance(self.config, EmbedderConfig) else "classify"

    def abort_all(self) -> int:
        """End every in-flight input (their requests get a 503); used when shutdown times out."""
        ids = list(self.in_flight)
        for request_id in ids:
            self.engine.abort(request_id)
        return len(ids)

    async def run(self, request_ids: list[str], inputs: list[list[int]], priority: int,
                  token_types: list[list[int]] | None = None) -> list[ClassifyResult]:
        """Run every input (each is batched with whatever else is queued; token_types for text
        pairs); admission as the generation routes do it: refused at once when draining or at
        --max-concurrent-requests."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.num_in_flight >= self.max_concurrent_requests:
            raise ApiError(429, f"the server is at --max-concurrent-requests ({self.max_concurrent_requests}); "
                           "retry later", code="too_many_requests")
        self.num_in_flight += 1
        self.in_flight.update(request_ids)
        start = time.monotonic()
        types = token_types if token_types is not None else [None] * len(inputs)
        tasks = [asyncio.ensure_future(self.engine.classify(rid, ids, priority, tt))
                 for rid, ids, tt in zip(request_ids, inputs, types)]
        try:
            async with asyncio.timeout(self.request_timeout):
                results = await asyncio.gather(*tasks)
        except TimeoutError:
            raise ApiError(503, f"the request did not finish within --request-timeout ({self.request_timeout}s)",
                           code="timeout") from None
        except RequestAbortedError:
            raise ApiError(503, "the request was aborted: the server is shutting down", code="aborted") from None
        finally:
            for t in tasks:  # one failed or we were cancelled: the rest must not stay queued
                if not t.done():
                    t.cancel()
            self.num_in_flight -= 1
            self.in_flight.difference_update(request_ids)
        m = self.metrics
        m.e2e.observe(time.monotonic() - start)
        m.prompt_tokens.inc(sum(map(len, inputs)))
        m.requests.inc(1, "classified" if self.task == "classify" else "embedded")
        return list(results)


# ---- request handling ----------------------------------------------------------------------------
def _texts_or_ids(value: Any, param: str) -> tuple[list[str] | None, list[list[int]] | None]:
    """(texts, None) or (None, token-id lists); empty inputs are refused, naming which."""
    if isinstance(value, str):
        value = [value]
        names = [param]
    else:
        if not value:
            raise ApiError(400, f"{param}: must not be empty", param)
        names = [f"{param}[{i}]" for i in range(len(value))]
    if isinstance(value[0], int):
        return None, [list(value)]
    for name, item in zip(names, value):
        if (isinstance(item, str) and not item.strip()) or (isinstance(item, list) and not item):
            raise ApiError(400, f"{name}: must not be empty" + (" or only whitespace" if isinstance(item, str) else ""),
                           param)
    if isinstance(value[0], str):
        return list(value), None
    return None, [list(x) for x in value]


def encode_inputs(state: ClassifyState, value: Any, param: str, add_special_tokens: bool,
                  truncate: int | None = None, whole_prompt: bool = False) -> list[list[int]]:
    """Token ids of every input (the last `truncate` of each, if given), each checked against the
    context length and the vocabulary. whole_prompt: the text is the model's whole input, written
    by the caller (embeddings), so special-token strings in it are the tokens, as
    sentence-transformers reads them; otherwise they stay text."""
    texts, given = _texts_or_ids(value, param)
    if texts is not None:
        encode = state.tokenizer.encode_prompt if whole_prompt else state.tokenizer.encode
        ids = [encode(t, add_special_tokens=add_special_tokens) for t in texts]
    else:
        ids = given or []
    if truncate is not None:
        truncate = truncation(state, truncate)
        ids = [x[-truncate:] for x in ids]
    single = isinstance(value, str) or (bool(value) and isinstance(value[0], int))
    for i, tokens in enumerate(ids):
        check_tokens(state, tokens, param if single else f"{param}[{i}]")
    return ids


def truncation(state: ClassifyState, truncate: int) -> int:
    """vLLM's truncate_prompt_tokens: -1 means the context length."""
    return truncation_length(truncate, state.max_model_len)


def check_tokens(state: ClassifyState, tokens: list[int], name: str) -> None:
    """400 naming the input when it is empty, longer than the context or outside the vocabulary."""
    try:
        state.engine.validate(tokens, name)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), name.split("[")[0]) from None


def request_ids(rid: str | list[str] | None, count: int, prefix: str) -> list[str]:
    """Engine ids: the client's rid(s) when given (one per input), else fresh ones."""
    if rid is None:
        base = new_id(prefix)
        return [f"{base}-{i}" for i in range(count)]
    rids = [rid] if isinstance(rid, str) else list(rid)
    if isinstance(rid, str) and count > 1:
        rids = [f"{rid}-{i}" for i in range(count)]
    if len(rids) != count:
        raise ApiError(400, f"rid: {len(rids)} ids for {count} inputs", "rid")
    if len(set(rids)) != count or any(not r for r in rids):
        raise ApiError(400, "rid: ids must be non-empty and distinct", "rid")
    return rids


def classification(state: ClassifyState, index: int, result: ClassifyResult, activation: bool = True) -> dict[str, Any]:
    probs = probabilities(result.output, state.config.class_activation) if activation else result.output
    labels = state.config.labels
    return {"index": index, "label": labels[int(result.output.argmax())], "probs": [float(p) for p in probs],
            "num_classes": len(labels)}


def parse(model: type[M], body: bytes, field: str, accepted: str) -> M:
    """The body as `model`. A wrongly typed `field` (a union of shapes) is named with the shapes it
    accepts, rather than with whichever member's complaint pydantic reports first."""
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = first.get("loc") or ()
        if loc and loc[0] == field and first.get("type") != "missing":
            got = json.dumps(json.loads(body).get(field))
            raise ApiError(400, f"{field}: expected {accepted}, got {got[:60]}", field) from None
        raise


INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


async def classify(state: ClassifyState) -> Response:
    """Classify a string or a list of strings (or token ids): labels and class probabilities."""
    require_task(state, "classify", "/v1/classify")
    body = await request.get_data(cache=False)
    return await _classify(state, parse(ClassifyRequest, body, "input", INPUT_SHAPES))


async def _classify(state: ClassifyState, req: ClassifyRequest) -> Response:
    state.model_names.check(req.model)
    inputs = encode_inputs(state, req.input, "input", req.add_special_tokens, req.truncate_prompt_tokens)
    rids = request_ids(req.rid, len(inputs), "classify")
    results = await state.run(rids, inputs, req.priority)
    num_tokens = sum(r.num_tokens for r in results)
    return jsonify({
        "id": new_id("classify"), "object": "list", "created": int(time.time()), "model": state.model_name,
        "data": [classification(state, i, r, req.activation) for i, r in enumerate(results)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    })


async def classify_either(state: ClassifyState) -> Response:
    """vLLM's /classify (a body with `input`), or SGLang's legacy reward-model /classify (`text` or
    `input_ids`; raw scores returned as `embedding`, one object per input)."""
    require_task(state, "classify", "/classify")
    body = await request.get_data(cache=False)
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if not (isinstance(parsed, dict) and "input" not in parsed and ("text" in parsed or "input_ids" in parsed)):
        return await _classify(state, parse(ClassifyRequest, body, "input", INPUT_SHAPES))
    try:
        return await _legacy_classify(state, LegacyClassifyRequest.model_validate_json(body))
    except Exception as e:  # SGLang's clients read its own error shape on this form
        return error_response(e, "sglang")


async def _legacy_classify(state: ClassifyState, req: LegacyClassifyRequest) -> Response:
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", "text")
    param = "text" if req.text is not None else "input_ids"
    value = req.text if req.text is not None else req.input_ids
    inputs = encode_inputs(state, value, param, True)
    rids = request_ids(req.rid, len(inputs), "classify")
    start = time.monotonic()
    results = await state.run(rids, inputs, req.priority or 0)
    latency = time.monotonic() - start
    out = [{"embedding": [float(x) for x in r.output],
            "meta_info": {"id": rid, "prompt_tokens": r.num_tokens, "e2e_latency": latency}}
           for rid, r in zip(rids, results)]
    single = isinstance(value, str) or (bool(value) and isinstance(value[0], int))
    return jsonify(out[0] if single else out)


async def models(state: ClassifyState) -> Response:
    """The served model, once per name it is served under."""
    return jsonify(state.model_names.cards(state.created, state.max_model_len))


async def model(state: ClassifyState, name: str) -> Response:
    """One served model's card (OpenAI's models.retrieve); 404 for a name this server does not serve."""
    return jsonify(state.model_names.card(name, state.created, state.max_model_len))


async def get_model_info(state: ClassifyState) -> Response:
    """SGLang's model info: not a generation model."""
    info = {"model_path": state.model_name, "tokenizer_path": state.model_name, "is_generation": False,
            "max_model_len": state.max_model_len, "architecture": state.config.architecture}
    if isinstance(state.config, ClassifierConfig):
        info.update(num_labels=state.config.num_labels, id2label=dict(enumerate(state.config.labels)))
    else:
        info.update(embedding_dimensions=state.config.dimensions, pooling=state.config.pooling,
                    normalize=state.config.normalize)
    return jsonify(info)


def require_task(state: ClassifyState, task: str, route_name: str) -> None:
    """400 when the served model cannot answer `route_name` (a classifier asked for embeddings, or
    an embedding model for classes)."""
    if state.task == task:
        return
    if state.task == "embed":
        raise ApiError(400, f"model `{state.model_name}` ({state.config.architecture}) is an embedding model with "
                       f"no classification head; {route_name} needs a classifier served with --task classify. It "
                       "serves POST /v1/embeddings, /v1/score and /v1/rerank", code="wrong_task")
    raise ApiError(400, f"model `{state.model_name}` ({state.config.architecture}) is a classification model, "
                   f"not an embedding model; {route_name} needs one served with --task embed. It serves POST "
                   "/v1/classify" + (", /v1/score and /v1/rerank" if state.config.num_labels == 1 else ""),
                   code="wrong_task")


async def refuse_generation(state: ClassifyState, **_: Any) -> Response:
    """Refused: this server serves a classification or embedding model."""
    kind = "an embedding" if state.task == "embed" else "a classification"
    routes = "POST /v1/embeddings" if state.task == "embed" else "POST /v1/classify"
    raise ApiError(400, f"model `{state.model_name}` ({state.config.architecture}) is {kind} model "
                   f"and cannot generate text; use {routes}, or serve a causal language model "
                   "(--task generate) for completions", code="wrong_task")


# ---- apps ----------------------------------------------------------------------------------------
def create_classify_app(
    engine: AsyncClassifyEngine,
    tokenizer: Tokenizer,
    served_model_name: str | ModelNames,
    config: PoolingConfig,
    max_model_len: int,
    api_keys: tuple[str, ...] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    request_timeout: float | None = None,
    cors: CorsPolicy | None = CorsPolicy(),
    request_id_headers: bool = False,
) -> Quart:
    """The app of a classification or embedding model: /v1/classify and /classify, or
    /v1/embeddings; /v1/score and /v1/rerank; /v1/models, /health, /metrics, /openapi.json,
    SGLang's /get_model_info; generation routes (and the other task's) answer 400."""
    from jaxserve.server import embeddings, scoring

    check_limits(max_request_bytes, max_concurrent_requests, request_timeout)
    names = ModelNames.of(served_model_name)
    metrics = Metrics(names.primary)
    metrics.gauge("num_requests_waiting", "Inputs waiting for a step.", lambda: engine.num_waiting)
    metrics.gauge("num_requests_running", "Inputs queued or in a step.", lambda: engine.num_requests)
    state = ClassifyState(engine=engine, tokenizer=tokenizer, model_names=names, config=config,
                          max_model_len=max_model_len, max_concurrent_requests=max_concurrent_requests,
                          request_timeout=request_timeout, metrics=metrics)
    app = base_app(state, api_keys, max_request_bytes, healthy=lambda: not state.draining and engine.error is None,
                   cors=cors, request_id_headers=request_id_headers)
    route(app, state, "/v1/classify", classify, "POST", ClassifyRequest)
    route(app, state, "/classify", classify_either, "POST", ClassifyRequest)
    embeddings.register(app, state)
    scoring.register(app, state)
    route(app, state, "/v1/models", models, "GET")
    route(app, state, "/v1/models/<path:name>", model, "GET")
    route(app, state, "/get_model_info", get_model_info, "GET")
    for rule in GENERATION_ROUTES:
        route(app, state, rule, refuse_generation, "POST")
    return app


def register_refusals(app: Quart, state: Any) -> None:
    """On a generation server, the classification, embedding and scoring routes answer 400 with
    the reason."""
    from jaxserve.server import embeddings, scoring

    async def refuse(state: Any) -> Response:
        """Refused: this server serves a generation model."""
        arch = state.engine.info.architecture
        raise ApiError(400, f"model `{state.model_name}` ({arch}) is a text-generation model with no "
                       "classification head; /v1/classify needs a sequence-classification or reward model "
                       "(e.g. Qwen2ForSequenceClassification, BertForSequenceClassification) served with "
                       "--task classify (or auto)", code="wrong_task")

    async def refuse_pooling(state: Any) -> Response:
        """Refused: this server serves a generation model."""
        arch = state.engine.info.architecture
        raise ApiError(400, f"model `{state.model_name}` ({arch}) is served for text generation; embeddings, "
                       "scores and reranking need an embedding model (--task embed, e.g. BertModel with a "
                       "sentence-transformers config, or a causal LM such as Qwen3-Embedding) or a one-label "
                       "cross-encoder (--task classify)", code="wrong_task")

    route(app, state, "/v1/classify", refuse, "POST", ClassifyRequest)
    route(app, state, "/classify", refuse, "POST", ClassifyRequest)
    for rule, model in (*embeddings.ROUTES, *scoring.ROUTES):
        route(app, state, rule, refuse_pooling, "POST", model)


# ---- start-up ------------------------------------------------------------------------------------
def detect_task(model: str, requested: str, load_format: str = "auto",
                hf_overrides: dict[str, Any] | None = None) -> str:
    """--task auto|generate|classify|embed for `model`: a checkpoint's config.json (and its
    sentence-transformers files) decides auto; GGUF files hold causal LMs only. Raises
    UnsupportedModelError when the asked task is impossible."""
    from jaxserve.models.tasks import resolve_task
    from jaxserve.models.config import UnsupportedModelError
    from jaxserve.weights.source import resolve

    source = resolve(model, weights=load_format != "dummy", overrides=hf_overrides)
    if source.kind != "hf":  # no need to parse the GGUF header (seconds): it is a causal LM
        if requested in ("classify", "embed"):
            raise UnsupportedModelError(f"--task {requested}: {source.path.name} is a GGUF file, which jaxserve "
                                        "serves for generation only; classification and embedding models load from "
                                        "a Hugging Face directory")
        return "generate"
    task = resolve_task(requested, source.config, source.path)
    if task != "generate" and load_format == "dummy":
        raise UnsupportedModelError(f"--load-format dummy: random weights are for generation models; --task {task} "
                                    "loads its checkpoint")
    return task


def build_classify_server(config: Any, task: str = "classify") -> tuple[Quart, AsyncClassifyEngine]:
    """Load and compile the classifier (or, task "embed", the embedding model) named by `config`
    (a jaxserve Config) and build its app."""
    import logging

    from jaxserve.startup import start_classify_engine

    engine, tokenizer, loaded, timings = start_classify_engine(config, task)
    logging.getLogger("jaxserve").info(
        "ready in %.1fs (load %.1fs, compile %.1fs for %d %s step shapes)", timings["total"], timings["load"],
        timings["compile"], len(engine.compile_seconds), task)
    async_engine = AsyncClassifyEngine(engine)
    srv = config.server
    app = create_classify_app(async_engine, tokenizer, served_names(config), loaded.config,
                              engine.config.max_model_len, api_keys=srv.api_keys,
                              max_request_bytes=srv.max_request_bytes,
                              max_concurrent_requests=srv.max_concurrent_requests,
                              request_timeout=srv.request_timeout, cors=cors_policy(srv),
                              request_id_headers=srv.request_id_headers)
    return app, async_engine
