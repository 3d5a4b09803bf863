"""What every jaxserve app has, whatever it serves: request limits, no response timeout, API-key
auth, errors in each protocol's shape, /health, /openapi.json and /metrics."""

from __future__ import annotations

import uuid
from typing import Any, Callable

from quart import Quart, Response, jsonify, request

from jaxserve import __version__
from jaxserve.server.auth import check_bearer
from jaxserve.server.cors import CorsPolicy, is_preflight
from jaxserve.server.errors import error_response, protocol_of
from jaxserve.server.openapi import openapi_spec

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024


def check_limits(max_request_bytes: int, max_concurrent_requests: int, request_timeout: float | None) -> None:
    if max_request_bytes < 1 or max_concurrent_requests < 1:
        raise ValueError(f"max_request_bytes ({max_request_bytes}) and max_concurrent_requests "
                         f"({max_concurrent_requests}) must be >= 1")
    if request_timeout is not None and request_timeout <= 0:
        raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")


def base_app(state: Any, api_keys: tuple[str, ...], max_request_bytes: int, healthy: Callable[[], bool],
             cors: CorsPolicy | None = CorsPolicy(), request_id_headers: bool = False) -> Quart:
    """A Quart app holding `state` (read by serve_async and the loading gate to drain; its
    `metrics` answer /metrics); `healthy()` decides /health. Callers add their API routes.
    `cors`: cross-origin requests allowed (None: no CORS headers; default: any origin, as vLLM's
    and SGLang's); `request_id_headers`: every response carries X-Request-Id (the request's own,
    or a fresh one), vLLM's --enable-request-id-headers."""
    app = Quart("jaxserve")
    app.config["MAX_CONTENT_LENGTH"] = max_request_bytes  # larger bodies -> 413
    # Quart cuts bodies and responses at 60 s by default; a long generation must not be cut.
    app.config["BODY_TIMEOUT"] = None
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    app.json.sort_keys = False  # keep the servers' field order ("id" first), as clients' logs show it
    app.extensions["jaxserve"] = state
    if any(not k for k in api_keys):
        # An empty key equals the token of a request that sends no Authorization at all.
        raise ValueError("an API key must not be empty: it would let every request in")
    keys = tuple(k.encode() for k in api_keys)

    @app.before_request
    async def answer_preflight() -> Response | None:
        # Before authentication: a browser's preflight carries no credentials.
        if cors is not None and is_preflight(request.method, request.headers):
            status, headers, body = cors.preflight(request.headers)
            return Response(body, status=status, headers=headers, content_type="text/plain")
        return None

    @app.before_request
    async def authenticate() -> None:
        check_bearer(request.path, request.headers.get("Authorization"), keys)

    @app.after_request
    async def cross_origin_and_request_id(response: Response) -> Response:
        if cors is not None and not is_preflight(request.method, request.headers):
            for name, value in cors.response_headers(request.headers.get("Origin")).items():
                if name == "Vary" and response.headers.get("Vary"):
                    value = f"{response.headers['Vary']}, {value}"
                response.headers[name] = value
        if request_id_headers:
            response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return response

    @app.errorhandler(Exception)
    async def on_error(exc: Exception) -> Response:
        return error_response(exc, protocol_of(request.path))

    @app.get("/health")
    async def health() -> Response:
        """200 when serving; 503 while draining or after an engine failure."""
        return Response("", status=200 if healthy() else 503)

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        """This document."""
        return jsonify(openapi_spec(app))

    @app.get("/version")
    async def version() -> Response:
        """The server's version (vLLM's route)."""
        return jsonify({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (text exposition format)."""
        return Response(state.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    return app
