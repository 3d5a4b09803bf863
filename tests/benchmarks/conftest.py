"""The serving benchmark's tests: the repository root on sys.path (so `benchmarks` is the tool's
package, not this test directory, also under a bare `pytest`), and a live jaxserve server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# The server tests' live-server helpers, imported the way their own conftest does.
SERVER_TESTS = str(Path(__file__).resolve().parents[1] / "server")
if SERVER_TESTS not in sys.path:
    sys.path.append(SERVER_TESTS)
if "benchmarks" in sys.modules and getattr(sys.modules["benchmarks"], "__file__", None) is None:
    del sys.modules["benchmarks"]  # a namespace package picked up from tests/ before the root was added


@pytest.fixture(scope="module")
def live_jaxserve(cache_dir, smollm2_tokenizer):
    """SmolLM2 on the small engine grid the server tests use, served by Hypercorn on a free port."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import create_app
    from live_server import MAX_MODEL_LEN, MODEL, small_engine, start_server

    async_engine = AsyncEngine(small_engine(cache_dir))
    app = create_app(async_engine, smollm2_tokenizer, MODEL, MAX_MODEL_LEN)
    live = start_server(app)
    yield live
    live.close()
    async_engine.shutdown()
