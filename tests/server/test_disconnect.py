"""Clients that go away: their requests end in the engine and their pages return to the pool."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from live_server import MODEL, wait_idle

pytestmark = pytest.mark.slow


async def _stream(client: httpx.AsyncClient, url: str, i: int, drop: bool, batch: bool = False) -> str | None:
    prompt = [f"Story number {i}:", f"Poem number {i}:"] if batch else f"Story number {i}:"
    body = {"model": MODEL, "prompt": prompt, "stream": True, "temperature": 0,
            "max_tokens": 300 if drop else 6, "ignore_eos": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        last = None
        async for line in r.aiter_lines():
            if not line:
                continue
            if drop:
                return None  # leave after the first chunk: the connection closes
            last = line
        return last


def test_dropped_streams_and_requests_are_aborted(server, async_engine):
    async def main() -> list:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            results = await asyncio.gather(*(_stream(client, server.url, i, drop=i % 2 == 0) for i in range(20)))
            # Streams of several prompts (several engine requests, read concurrently), dropped.
            await asyncio.gather(*(_stream(client, server.url, i, drop=True, batch=True) for i in range(2)))
            # A non-streaming request whose client gives up is aborted too.
            with pytest.raises(httpx.ReadTimeout):
                await client.post(server.url + "/v1/completions", timeout=1.5,
                                  json={"model": MODEL, "prompt": "Go on:", "max_tokens": 400, "ignore_eos": True})
            return results

    results = asyncio.run(main())
    assert all(r == "data: [DONE]" for r in results[1::2])  # the kept streams completed
    wait_idle(async_engine)
    engine = async_engine.engine
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0 and not engine.requests
    engine.check_idle_integrity()
    assert server.app.extensions["jaxserve"].num_in_flight == 0
