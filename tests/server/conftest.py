"""One live jaxserve server per test session: SmolLM2 on a small engine grid, real Hypercorn on a
free port, in a background thread. A second app (API keys, one concurrent request, a 2 s deadline)
shares the engine."""

from __future__ import annotations

import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.app import create_app
from live_server import API_KEY, MAX_MODEL_LEN, MODEL, small_engine, start_server


@pytest.fixture(scope="session")
def async_engine(cache_dir):
    async_engine = AsyncEngine(small_engine(cache_dir))
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="session")
def server(async_engine, smollm2_tokenizer):
    app = create_app(async_engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN, max_request_bytes=64 * 1024)
    live = start_server(app)
    yield live
    live.close()


@pytest.fixture(scope="session")
def guarded_server(async_engine, smollm2_tokenizer):
    """API key required; at most one request at a time; a 2 s deadline per request."""
    app = create_app(async_engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN,
                     api_keys=(API_KEY, "second-key"), max_concurrent_requests=1, request_timeout=2.0)
    live = start_server(app)
    yield live
    live.close()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
