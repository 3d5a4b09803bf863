"""/openapi.json, and graceful shutdown: a stop drains in-flight work for --shutdown-timeout, then
aborts what is left; the engine ends idle and consistent."""

from __future__ import annotations

import threading

import httpx
import pytest

from live_server import MAX_MODEL_LEN, MODEL, start_server, wait_idle
from jaxserve.server.app import create_app

pytestmark = pytest.mark.slow


def test_openapi_lists_every_route(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    paths = spec["paths"]
    for path in ("/v1/completions", "/v3/chat/completions", "/v1/models", "/generate", "/abort_request", "/health",
                 "/metrics", "/tokenize", "/detokenize", "/v2/models/{name}/generate",
                 "/v2/models/{name}/versions/{version}/generate_stream"):
        assert path in paths, path
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in body["properties"]


def test_graceful_shutdown(async_engine, smollm2_tokenizer):
    app = create_app(async_engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN)
    live = start_server(app)  # shutdown_timeout 2 s
    results: dict[str, list[str]] = {}
    started = threading.Barrier(3)

    def stream(name: str, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}
        lines: list[str] = []
        try:
            with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 1:
                            started.wait()
        except httpx.HTTPError:
            pass  # the server cut the long stream
        results[name] = lines

    threads = [threading.Thread(target=stream, args=a) for a in (("short", 6), ("long", 400))]
    for t in threads:
        t.start()
    started.wait()
    live.close()  # like SIGTERM: stop accepting, drain for up to 2 s, abort the rest
    for t in threads:
        t.join(30)
    assert app.extensions["jaxserve"].draining
    assert results["short"][-1] == "data: [DONE]"
    # The long one was aborted at the deadline, and still ended its stream properly.
    assert results["long"][-1] == "data: [DONE]" and len(results["long"]) < 100
    assert '"finish_reason":"abort"' in results["long"][-2]
    wait_idle(async_engine)
    async_engine.engine.check_idle_integrity()
    with pytest.raises(httpx.ConnectError):
        httpx.get(live.url + "/health")
