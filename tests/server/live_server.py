"""Running the real server in tests: Hypercorn on a free port in a background thread, and the
small engine grid the server tests share, built by the production start-up (jaxserve.startup)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from typing import Any

import httpx

from pathlib import Path

from jaxserve.config import CacheConfig, Config, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.core import Engine
from jaxserve.server.app import create_app, serve_async
from jaxserve.startup import image_input, start_engine
from smollm2 import smollm2_gguf

MODEL = "smollm2"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 512


def small_engine(cache_dir: Path, speculative_model: str | None = None, lora_modules: tuple = (),
                 enable_lora: bool = False, max_loras: int | None = None, max_cpu_loras: int | None = None,
                 **scheduler: Any) -> Engine:
    """SmolLM2 in float32 on a small grid, started exactly as `python -m jaxserve` starts a server
    (a mesh of one device, the CPU kernels where they build, the compilation cache)."""
    config = Config(
        # Prompt embeddings on (tests/server/test_prompt_embeds_server.py), except beside a draft model.
        model=ModelConfig(model=str(smollm2_gguf()), served_model_name=MODEL, dtype="float32",
                          max_model_len=MAX_MODEL_LEN, cache_dir=cache_dir, speculative_model=speculative_model,
                          enable_prompt_embeds=speculative_model is None, lora_modules=lora_modules,
                          enable_lora=enable_lora, max_loras=max_loras, max_cpu_loras=max_cpu_loras),
        parallel=ParallelConfig(), server=ServerConfig(),
        cache=CacheConfig(page_size=16, num_pages=160),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_seqs=2, **scheduler),
        compilation_cache_dir=cache_dir / "xla",
    )
    return start_engine(config)[0]


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
    while async_engine.num_requests or async_engine.engine.has_unfinished() or async_engine.stats.request_ids:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy: {async_engine.num_requests} streams, "
                                 f"{len(async_engine.stats.request_ids)} requests")
        time.sleep(0.05)
    time.sleep(0.6)  # let the engine thread drain pending abort commands


def serve(config: Config, name: str) -> tuple[LiveServer, AsyncEngine]:
    """The server `python -m jaxserve` would start for `config` (images included), on a free port."""
    engine = start_engine(config)[0]
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, engine.tokenizer, name, engine.info.max_model_len,
                     images=image_input(config, engine))
    return start_server(app), async_engine
