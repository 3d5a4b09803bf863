"""The classification engine thread on a tiny model: priorities across steps, aborts, shutdown,
and no step shape beyond start-up's."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from jaxserve.engine.classify_batcher import Bucket
from jaxserve.errors import InvalidRequestError


# ---- the engine thread on a tiny model -----------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from jaxserve.engine.classify import ClassifyConfig, ClassifyEngine
    from jaxserve.weights.classifier_loader import load_classifier
    from tiny_classifiers import make_tiny_classifier

    directory = tmp_path_factory.mktemp("qwen2-cls")
    make_tiny_classifier("qwen2-cls", directory)
    loaded = load_classifier(directory, "float32", use_cache=False)
    engine = ClassifyEngine(loaded.model, loaded.config, ClassifyConfig(max_model_len=32, max_num_seqs=2,
                                                                        token_buckets=(16, 32)))
    engine.compile()
    return engine


def test_every_step_runs_a_shape_compiled_at_start_up(engine):
    inputs = [[(i * 7 + j) % 250 + 2 for j in range(n)] for i, n in enumerate((1, 2, 15, 16, 17, 31, 32, 5, 9))]
    results = engine.classify(inputs)
    assert [r.num_tokens for r in results] == list(map(len, inputs))
    assert set(engine.runner.compiled_buckets) == set(engine.buckets)
    # Each input alone gives the same logits as packed with others.
    for x, r in zip(inputs[:3], results):
        np.testing.assert_allclose(engine.classify([x])[0].output, r.output, atol=1e-5)
    from jaxserve.engine.classify_batcher import PackedStep

    odd = PackedStep(Bucket(48, 2), ["q"], [1], *(np.zeros(48, np.int32),) * 3, np.zeros(2, np.int32),
                     np.zeros(48, np.int32))
    with pytest.raises(RuntimeError, match="was not compiled at start-up"):
        engine.runner.dispatch(odd)


def test_async_engine_priorities_aborts_and_shutdown(engine):
    from jaxserve.engine.async_engine import EngineDeadError
    from jaxserve.engine.classify import AsyncClassifyEngine, RequestAbortedError

    # The first step waits at a gate, so everything submitted meanwhile is queued together.
    gate = threading.Event()
    real_dispatch = engine.dispatch
    engine.dispatch = lambda: gate.wait(30) and real_dispatch()
    async_engine = AsyncClassifyEngine(engine)
    done: list[str] = []

    async def one(rid: str, priority: int) -> str:
        await async_engine.classify(rid, [5, 6, 7], priority)
        done.append(rid)
        return rid

    async def main() -> None:
        blocker = asyncio.ensure_future(async_engine.classify("blocker", [4] * 32))
        await asyncio.sleep(0.05)
        tasks = [asyncio.ensure_future(one(f"p{p}-{i}", p)) for i, p in enumerate([3, 1, 2, 0, 1])]
        gone = asyncio.ensure_future(one("cancelled", -5))
        await asyncio.sleep(0.05)
        gone.cancel()  # the client went away while its input waited
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        await asyncio.gather(*tasks)
        with pytest.raises(asyncio.CancelledError):
            await gone
        with pytest.raises(InvalidRequestError, match="more than the maximum context length of 32"):
            await async_engine.classify("long", [5] * 33)
        # An abort that reaches a waiting input fails it (what a shutdown timeout does).
        gate.clear()
        waiting = asyncio.ensure_future(async_engine.classify("aborted", [5], 0))
        await asyncio.sleep(0.05)
        async_engine.abort("aborted")
        await asyncio.sleep(0.05)
        gate.set()
        with pytest.raises(RequestAbortedError):
            await waiting

    try:
        asyncio.run(main())
    finally:
        gate.set()
        del engine.dispatch
    assert "cancelled" not in done
    priorities = [int(rid[1]) for rid in done]
    assert priorities == sorted(priorities)  # lower values first (two per step, in order)
    assert async_engine.num_requests == 0 and not engine.has_unfinished()
    async_engine.shutdown()

    async def after() -> None:
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(async_engine.classify("late", [5]), 5)

    asyncio.run(after())
