"""One live jaxserve server per test session: SmolLM2 on a small engine grid, real Hypercorn on a
free port, in a background thread. A second app (API keys, one concurrent request, a 2 s deadline)
shares the engine."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.engine import Engine
from jaxserve.server.app import create_app
from jaxserve.weights import load_model
from live_server import API_KEY, MODEL, SMALL, start_server
from smollm2 import smollm2_gguf


@pytest.fixture(scope="session")
def async_engine(cache_dir, smollm2_tokenizer):
    model = load_model(smollm2_gguf(), "float32", cache_dir=cache_dir).model
    engine = Engine(model, smollm2_tokenizer, dataclasses.replace(SMALL, compilation_cache_dir=cache_dir / "xla"))
    engine.compile()
    async_engine = AsyncEngine(engine)
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="session")
def server(async_engine, smollm2_tokenizer):
    app = create_app(async_engine, smollm2_tokenizer, MODEL, SMALL.scheduler.max_model_len,
                     max_request_bytes=64 * 1024)
    live = start_server(app)
    yield live
    live.close()


@pytest.fixture(scope="session")
def guarded_server(async_engine, smollm2_tokenizer):
    """API key required; at most one request at a time; a 2 s deadline per request."""
    app = create_app(async_engine, smollm2_tokenizer, MODEL, SMALL.scheduler.max_model_len,
                     api_keys=(API_KEY, "second-key"), max_concurrent_requests=1, request_timeout=2.0)
    live = start_server(app)
    yield live
    live.close()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
