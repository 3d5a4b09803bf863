"""Running the real server in tests: Hypercorn on a free port in a background thread, and the
small engine grid the server tests share."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import httpx

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.engine import EngineConfig
from jaxserve.server.app import serve_async

MODEL = "smollm2"
API_KEY = "sk-test-key"
SMALL = EngineConfig(
    cache=CacheConfig(page_size=16, num_pages=160),
    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_seqs=2, max_model_len=512),
)


@dataclasses.dataclass
class LiveServer:
    url: str
    app: object
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(app) -> LiveServer:
    port = _free_port()
    ready: dict = {}

    def run() -> None:
        async def main() -> None:
            ready["loop"], ready["stop"] = asyncio.get_running_loop(), asyncio.Event()
            await serve_async(app, "127.0.0.1", port, 2.0, ready["stop"].wait)

        asyncio.run(main())

    thread = threading.Thread(target=run, name=f"jaxserve-http-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not come up")
        time.sleep(0.1)
    return LiveServer(url, app, thread, ready["loop"], ready["stop"])


def wait_idle(async_engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Wait until no request is left in the engine (its thread then only waits for commands)."""
    deadline = time.monotonic() + timeout
    while async_engine.num_requests or async_engine.engine.has_unfinished() or async_engine.engine.requests:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {async_engine.num_requests} streams, "
                                 f"{len(async_engine.engine.requests)} requests")
        time.sleep(0.05)
    time.sleep(0.6)  # let the engine thread drain pending abort commands
