"""Triton's generate extension: POST /v2/models/{name}[/versions/{v}]/generate and
generate_stream. Parameters may sit in "parameters" (vLLM backend) or at the top level
(TensorRT-LLM ensemble). Both are free-form in Triton's spec; here a name that is neither read nor
listed in accepted_fields.TRITON (accepted and ignored) is refused, naming it."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict
from quart import Quart, Response, jsonify, request

from jaxserve.engine.request import SamplingParams
from jaxserve.server import accepted_fields, sampling, sse
from jaxserve.server.errors import ApiError, error_event
from jaxserve.server.generation import EngineStream, ServerState, attach_grammar, bad_words_ids, new_id, route
from jaxserve.structured import spec as guide
from jaxserve.structured.spec import GuideSpec

VERSION = "1"

_GUIDES = {"regex", "json_schema", "guided_regex", "guided_json", "guided_choice", "guided_grammar",
           "guided_whitespace_pattern"}
_ACCEPTED = {f.name for f in sampling.TRITON} | _GUIDES | set(accepted_fields.TRITON) | {
    "stop", "stop_words", "bad_words", "exclude_input_in_output", "end_id"}
# Known and not accepted: refused with their reason (sampling.refuse_unhonoured), not as unknown.
_KNOWN = _ACCEPTED | set(sampling.UNHONOURED)
_TOP_LEVEL = {"id", "text_input", "parameters"}


class GenerateRequest(BaseModel):
    """The documented shape (for /openapi.json); bodies are checked by `_parse`, which also takes
    TensorRT-LLM's top-level parameters."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    text_input: str
    parameters: dict[str, Any] = {}


def _check_model(state: ServerState, name: str, version: str | None) -> str | None:
    """The LoRA adapter `name` selects (a model of its own here, as Triton serves each LoRA of its
    vLLM backend), None for the served model; 404 for other names and versions."""
    lora = state.model_names.lora(name)
    if version is not None and version != VERSION:
        raise ApiError(404, f"unknown version '{version}' of model '{name}'; available: {VERSION}", "version")
    return lora


def _words(value: Any, name: str) -> list[str]:
    # TensorRT-LLM sends "" for none and a comma-free string or a list for some.
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [v for v in value if v]
    raise ApiError(400, f"{name}: expected a string or a list of strings", name)


def _request_params(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("parameters", {})
    if not isinstance(params, dict):
        raise ApiError(400, "parameters: expected an object", "parameters")
    merged = {k: v for k, v in body.items() if k not in _TOP_LEVEL}
    merged.update(params)
    unknown = sorted(set(merged) - _KNOWN)
    if unknown:
        raise ApiError(400, f"unknown parameter(s) {unknown}; accepted: {sorted(_ACCEPTED)}", unknown[0])
    return merged


def _check_end_id(state: ServerState, end_id: Any) -> None:
    """TensorRT-LLM's end token: its examples send the model's own EOS id, which ends generation
    here anyway; another id would change where the output ends, so it is refused."""
    eos_ids = state.engine.info.eos_ids
    if end_id is not None and (isinstance(end_id, bool) or end_id not in eos_ids):
        raise ApiError(400, f"end_id: only the model's end-of-sequence id(s) {list(eos_ids)} can end generation "
                       f"here, got {end_id!r}; use stop_words for other ends", "end_id")


def _sampling(state: ServerState, params: dict[str, Any]) -> SamplingParams:
    sampling.refuse_unhonoured(params.get)
    stop = _words(params.get("stop"), "stop") + _words(params.get("stop_words"), "stop_words")
    bad = _words(params.get("bad_words"), "bad_words")
    return sampling.build(sampling.TRITON, params.get, state.sampling_defaults, stop=stop,
                          bad_words_ids=bad_words_ids(state.tokenizer, bad) if bad else None)


def guide_spec(params: dict[str, Any]) -> GuideSpec | None:
    """SGLang's regex / json_schema and vLLM's guided_* names, as Triton parameters."""
    makers = {"regex": guide.regex, "guided_regex": guide.regex, "json_schema": guide.json_schema,
              "guided_json": guide.json_schema, "guided_choice": guide.choice, "guided_grammar": guide.grammar}
    spec = guide.only_one([make(params[k], k) for k, make in makers.items() if params.get(k) is not None])
    return guide.with_whitespace(spec, params.get("guided_whitespace_pattern"), "guided_whitespace_pattern")


async def _parse(state: ServerState, name: str, version: str | None) -> tuple[dict[str, Any], SamplingParams, dict]:
    lora = _check_model(state, name, version)
    try:
        body = json.loads(await request.get_data(cache=False))
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    text = body.get("text_input")
    if not isinstance(text, str) or not text:
        raise ApiError(400, "text_input: a non-empty string is required", "text_input")
    if "id" in body and not isinstance(body["id"], str):
        raise ApiError(400, "id: expected a string", "id")
    params = _request_params(body)
    for flag in ("stream", "exclude_input_in_output"):
        if flag in params and not isinstance(params[flag], bool):
            raise ApiError(400, f"{flag}: expected a boolean", flag)
    _check_end_id(state, params.get("end_id"))
    sampling = _sampling(state, params)
    sampling.lora = lora
    await attach_grammar(state, sampling, guide_spec(params))
    return body, sampling, params


def _response(state: ServerState, name: str, body: dict[str, Any], text: str) -> dict[str, Any]:
    out = {"model_name": state.model_names.reported(name), "model_version": VERSION, "text_output": text}
    return ({"id": body["id"]} | out) if "id" in body else out


async def generate(state: ServerState, name: str, version: str | None = None) -> Response:
    """Triton generate extension: {"id", "text_input", "parameters"} -> {"text_output", ...}."""
    body, params, raw = await _parse(state, name, version)
    prompt = body["text_input"]
    async with state.admit() as flight:
        await flight.submit(new_id("triton"), state.tokenizer.encode_prompt(prompt), params)
        (res,) = await flight.collect()
    # The vLLM backend returns the prompt followed by the completion unless told otherwise.
    prefix = "" if raw.get("exclude_input_in_output", False) else prompt
    texts = [prefix + o.text for o in res.outputs]
    return jsonify(_response(state, name, body, texts[0] if len(texts) == 1 else texts))


async def generate_stream(state: ServerState, name: str, version: str | None = None) -> Response:
    """Triton generate extension, one SSE event per increment (no [DONE])."""
    body, params, raw = await _parse(state, name, version)
    sampling.refuse_streamed_beams(params, True)
    prompt = body["text_input"]
    prefix = "" if raw.get("exclude_input_in_output", False) else prompt

    async def events(stream: EngineStream) -> AsyncIterator[bytes]:
        # n > 1: the samples' increments interleave, so each event names its sample as
        # TensorRT-LLM's backend does (`sequence_index`), and each sample's text starts with the prompt.
        started: set[int] = set()
        try:
            async for delta in stream:
                for o in delta.outputs:
                    text = ("" if o.index in started else prefix) + o.text
                    started.add(o.index)
                    event = _response(state, name, body, text)
                    yield sse.event(event | {"sequence_index": o.index} if params.n > 1 else event)
        except Exception as e:  # Triton has no [DONE]: the error event ends the stream
            yield sse.event(error_event(e, "triton"))

    async with state.admit() as flight:
        stream = await flight.submit(new_id("triton"), state.tokenizer.encode_prompt(prompt), params)
        return sse.sse_response(flight.respond(events(stream)))


async def server_ready(state: ServerState) -> Response:
    """KServe v2 readiness (Triton clients check it before generating)."""
    return Response("", status=503 if state.draining or state.engine.error is not None else 200)


async def model_metadata(state: ServerState, name: str, version: str | None = None) -> Response:
    """KServe v2 model metadata: the generate extension's inputs and outputs."""
    _check_model(state, name, version)
    return jsonify({"name": state.model_names.reported(name), "versions": [VERSION], "platform": "jaxserve",
                    "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
                    "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]})


async def model_ready(state: ServerState, name: str, version: str | None = None) -> Response:
    """KServe v2 model readiness."""
    _check_model(state, name, version)
    return await server_ready(state)


def register(app: Quart, state: ServerState) -> None:
    route(app, state, "/v2/health/ready", server_ready, "GET")
    route(app, state, "/v2/health/live", server_ready, "GET")
    for suffix in ("", "/versions/<version>"):
        route(app, state, f"/v2/models/<name>{suffix}", model_metadata, "GET")
        route(app, state, f"/v2/models/<name>{suffix}/ready", model_ready, "GET")
        route(app, state, f"/v2/models/<name>{suffix}/generate", generate, "POST", GenerateRequest)
        route(app, state, f"/v2/models/<name>{suffix}/generate_stream", generate_stream, "POST", GenerateRequest)
