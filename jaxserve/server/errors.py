"""One place that maps exceptions to HTTP statuses, and one error body per protocol.

Routes raise (or let through) the engine's and pydantic's exceptions; `to_api_error` turns each
into an `ApiError` (status, message, param), and the protocol of the route decides the body.
Bad input is always a 4xx: only a bug in the server is a 500.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Callable

import pydantic
from quart import Response
from werkzeug.exceptions import HTTPException

from jaxserve.engine.engine_thread import EngineDeadError
from jaxserve.errors import InvalidRequestError
from jaxserve.tokenizer import ChatTemplateError

log = logging.getLogger("jaxserve.server")


class ApiError(Exception):
    """A refusal with its status. `kind` is OpenAI's error type; `code` its machine-readable code."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _KIND_BY_STATUS.get(status, "invalid_request_error")
        self.code = code


_KIND_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def not_supported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported yet", param, code="not_supported")


def to_api_error(exc: BaseException) -> ApiError | None:
    """The status table shared by every protocol; None for an unexpected exception (a 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError) and exc.param == "lora":
        # The model name named a LoRA adapter that was unloaded after the route checked it.
        return ApiError(404, str(exc).removeprefix("lora: "), "model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):  # includes RequestTooLongError; the message names the numbers
        return ApiError(400, str(exc), exc.param)
    if isinstance(exc, ChatTemplateError):
        return ApiError(400, f"chat template: {exc}", "messages")
    if isinstance(exc, pydantic.ValidationError):
        return _validation_error(exc)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc), code="engine_dead")
    if isinstance(exc, HTTPException) and exc.code is not None:
        if exc.code == 413:
            return ApiError(413, "the request body is larger than --max-request-bytes allows",
                            code="request_too_large")
        return ApiError(exc.code, exc.description or exc.name, code=None)
    return None


def _validation_error(exc: pydantic.ValidationError) -> ApiError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}", None)
    unknown = next((e for e in errors if e.get("type") == "unknown_field"), None)
    if unknown is not None:  # accepted_fields.KnownFields: the field under the model's place
        ctx = unknown.get("ctx") or {}
        path = ".".join([str(p) for p in unknown.get("loc", ()) if not _TYPE_TAG.match(str(p))] + [ctx["field"]])
        return ApiError(400, f"{path}: {unknown.get('msg')}", path, code=ctx.get("code"))
    loc = [str(p) for p in first.get("loc", ())]
    param = loc[0] if loc else None
    # A union field reports one error per member, each under the member's type ("prompt", "str");
    # name the field and the accepted types instead of the first member's complaint.
    path, tag = _split_loc(loc)
    if tag is not None:
        # A member that got the right shape and failed inside (a dict with a bad key) says most.
        for e in errors:
            parts = [str(p) for p in e.get("loc", ())]
            if len(parts) > len(path.split(".")) + 1 and _split_loc(parts)[0] == path:
                inner = ".".join(p for p in parts if not _TYPE_TAG.match(p))
                return ApiError(400, f"{inner}: {e.get('msg')}", param)
    tags = [t for e in errors if (t := _split_loc([str(p) for p in e.get("loc", ())]))[0] == path and t[1]]
    accepted = list(dict.fromkeys(t for _, t in tags))
    if len(accepted) > 1:
        got = repr(first.get("input"))
        return ApiError(400, f"{path}: expected one of {', '.join(accepted)}, got {got[:60]}", param)
    return ApiError(400, f"{path or 'body'}: {first.get('msg')}", param)


def _split_loc(loc: list[str]) -> tuple[str, str | None]:
    """("messages", "0", "content", "str") -> ("messages.0.content", "str")."""
    for i, part in enumerate(loc):
        if _TYPE_TAG.match(part):
            return ".".join(loc[:i]), part
    return ".".join(loc), None


# pydantic's union member names: builtin types, generics, and model classes (our fields are snake_case).
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|tuple|function-\w+)\[.*\]|[A-Z]\w*)$")


# ---- bodies, one per protocol ---------------------------------------------------------------------
def openai_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def sglang_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message}}


def triton_body(e: ApiError) -> dict[str, Any]:
    return {"error": e.message}


# vLLM's error type names (the HTTP status's phrase), which /v1/classify clients see.
_CLASSIFY_TYPES = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError",
                   413: "RequestTooLargeError", 429: "TooManyRequestsError", 500: "InternalServerError",
                   503: "ServiceUnavailableError"}


def classify_body(e: ApiError) -> dict[str, Any]:
    """vLLM's ErrorResponse on its pooling routes: the OpenAI nesting, with the status's name as
    the type and the status as the code."""
    return {"error": {"message": e.message, "type": _CLASSIFY_TYPES.get(e.status, "BadRequestError"),
                      "param": e.param, "code": e.status}}


BODIES: dict[str, Callable[[ApiError], dict[str, Any]]] = {
    "openai": openai_body,
    "sglang": sglang_body,
    "triton": triton_body,
    "classify": classify_body,
}


def protocol_of(path: str) -> str:
    if path.startswith("/v2/") and path != "/v2/rerank":  # Cohere's v2 rerank is vLLM's, not Triton's
        return "triton"
    if path in ("/generate", "/abort_request", "/get_model_info", "/health_generate", "/get_server_info",
                "/server_info", "/flush_cache"):
        return "sglang"
    if path in ("/v1/classify", "/classify"):
        return "classify"
    return "openai"


def error_response(exc: BaseException, protocol: str) -> Response:
    err = to_api_error(exc)
    if err is None:
        log.exception("unexpected error", exc_info=exc)
        err = ApiError(500, f"internal server error: {type(exc).__name__}")
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
    return Response(json.dumps(BODIES[protocol](err)), status=err.status, content_type="application/json",
                    headers=headers)


def error_event(exc: BaseException, protocol: str) -> dict[str, Any]:
    """The body of a `data: {"error": ...}` event, for a failure after a stream began."""
    err = to_api_error(exc)
    if err is None:
        log.exception("stream failed", exc_info=exc)
        err = ApiError(500, f"internal server error: {type(exc).__name__}")
    return BODIES[protocol](err)
