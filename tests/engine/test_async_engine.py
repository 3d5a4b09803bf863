"""AsyncEngine: the engine thread serves concurrent async streams; validation errors surface at
submit; closing a stream aborts its request and frees its pages."""

from __future__ import annotations

import asyncio
import time

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.core import Engine
from jaxserve.engine.request import SamplingParams
from jaxserve.errors import InvalidRequestError, RequestTooLongError
from jaxserve.models.reference import greedy_reference
from jaxserve.tokenizer import load_tokenizer
from jaxserve.weights import load_model
from tiny_models import make_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-async")
    make_tiny_model("qwen3", d)
    save_tiny_tokenizer(d)
    model = load_model(d, "float32", use_cache=False).model
    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=64),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64))
    engine = build_engine(model, load_tokenizer(d), config)
    async_engine = AsyncEngine(engine)
    yield model, async_engine
    async_engine.shutdown()


def _wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_concurrent_streams_equal_reference(setup):
    model, async_engine = setup
    prompts = [[1, 5, 9, 13], [1, 2, 3], [1, 200, 100, 50, 25, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in await async_engine.submit(f"r{i}", prompt, params):
            tokens += out.outputs[0].token_ids if out.outputs else []
        return tokens

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(run()) == greedy_reference(model, prompts, 12)
    _wait_idle(async_engine.engine)
    async_engine.engine.check_idle_integrity()


def test_errors_raise_at_submit_and_closing_a_stream_aborts(setup):
    _, async_engine = setup

    async def run() -> None:
        with pytest.raises(RequestTooLongError):
            await async_engine.submit("long", [1, 2, 3], SamplingParams(max_tokens=500))
        with pytest.raises(InvalidRequestError, match="temperature"):
            await async_engine.submit("bad", [1, 2, 3], SamplingParams(temperature=-1.0))
        stream = await async_engine.submit("drop", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        async for _ in stream:
            break  # the client goes away after the first delta
        await stream.aclose()

    asyncio.run(run())
    _wait_idle(async_engine.engine)
    assert not async_engine.engine.has_unfinished()
    async_engine.engine.check_idle_integrity()


def test_shutdown_ends_open_streams_and_refuses_later_requests(setup):
    """Shutting the thread down ends a stream still running, and a request submitted afterwards is
    refused at once with EngineDeadError (it used to wait forever on a thread that was gone). Runs
    last in this module: it stops the shared engine thread."""
    _, async_engine = setup
    params = SamplingParams(max_tokens=60, ignore_eos=True)

    async def run() -> None:
        stream = await async_engine.submit("open", [1, 2, 3], params)
        first = await stream.__anext__()
        assert first.outputs and not first.finished
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        rest = [out async for out in stream]  # ends (the thread aborted it), without finishing
        assert len(first.outputs[0].token_ids) + sum(len(o.outputs[0].token_ids) for o in rest if o.outputs) < 60
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(async_engine.submit("late", [1, 2, 3], params), timeout=5)

    asyncio.run(run())
    assert not async_engine.engine.has_unfinished()
    async_engine.engine.check_idle_integrity()
