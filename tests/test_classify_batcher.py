"""The classification batcher (host only, milliseconds): validation that names the numbers,
priority order, packing into buckets, pooling rows and positions; then the engine thread on a
tiny model: priorities across steps, aborts, shutdown, and no step shape beyond start-up's."""

from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np
import pytest

from jaxserve.engine.classify_batcher import (
    Bucket,
    ClassifyBatcher,
    ClassifyItem,
    PackingSpec,
    classify_buckets,
    probabilities,
)
from jaxserve.errors import InvalidRequestError, RequestTooLongError

LAST = PackingSpec("last", pad_token_id=0)


def _batcher(spec: PackingSpec = LAST, max_len: int = 64, max_seqs: int = 4, sizes=None) -> ClassifyBatcher:
    return ClassifyBatcher(spec, max_len, 256, classify_buckets(max_len, max_seqs, sizes))


def test_host_side_imports_no_jax():
    import subprocess

    code = "import sys, jaxserve.engine.classify_batcher; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_buckets():
    assert classify_buckets(512, 16) == tuple(Bucket(t, min(16, t)) for t in (16, 32, 64, 128, 256, 512))
    assert classify_buckets(100, 4) == (Bucket(16, 4), Bucket(32, 4), Bucket(64, 4), Bucket(100, 4))
    assert classify_buckets(8, 32) == (Bucket(8, 8),)
    assert classify_buckets(64, 2, (24, 64)) == (Bucket(24, 2), Bucket(64, 2))
    for bad in ((32, 16), (16, 32)):
        with pytest.raises(ValueError, match="rise strictly"):
            classify_buckets(64, 2, bad)
    with pytest.raises(ValueError, match="must hold a whole input"):
        ClassifyBatcher(LAST, 128, 256, classify_buckets(64, 4))


def test_validation_names_the_numbers():
    b = _batcher()
    with pytest.raises(RequestTooLongError, match="input: the input has 65 tokens, more than the maximum context "
                                                   "length of 64 tokens"):
        b.validate([5] * 65)
    with pytest.raises(InvalidRequestError, match=r"input\[2\]: token id 256 is outside the vocabulary \[0, 256\)"):
        b.validate([5, 256], "input[2]")
    with pytest.raises(InvalidRequestError, match="no tokens"):
        b.add(ClassifyItem("a", []))
    b.add(ClassifyItem("a", [5]))
    with pytest.raises(InvalidRequestError, match="'a' is already queued"):
        b.add(ClassifyItem("a", [6]))
    assert b.num_waiting == 1


def test_priority_then_arrival_order_and_aborts():
    b = _batcher(max_seqs=2)
    for rid, prio in [("late-low", 5), ("first", 0), ("urgent", -1), ("second", 0), ("gone", -2)]:
        b.add(ClassifyItem(rid, [7, 8], prio))
    assert b.abort("gone") and not b.abort("gone") and b.num_waiting == 4
    order = []
    while (step := b.next_step()) is not None:
        order.append(step.request_ids)
    assert order == [["urgent", "first"], ["second", "late-low"]]
    assert not b.has_waiting()


def test_packing_stops_at_the_first_input_that_does_not_fit():
    b = _batcher(max_len=64, max_seqs=8)
    for rid, n in [("a", 40), ("b", 30), ("c", 4)]:
        b.add(ClassifyItem(rid, list(range(1, n + 1))))
    # "c" would fit beside "a", but passing "b" could starve long inputs; it waits its turn.
    assert b.next_step().request_ids == ["a"]
    step = b.next_step()
    assert step.request_ids == ["b", "c"] and step.bucket == Bucket(64, 8)


def test_packed_arrays_for_a_decoder():
    b = _batcher(max_len=64, max_seqs=4)
    b.add(ClassifyItem("x", [5, 6, 7]))
    b.add(ClassifyItem("y", [9, 9, 0, 0]))  # HF pools the last token that is not padding
    b.add(ClassifyItem("z", [0]))
    step = b.next_step()
    assert step.bucket == Bucket(16, 4) and step.num_tokens == [3, 4, 1]
    np.testing.assert_array_equal(step.tokens[:8], [5, 6, 7, 9, 9, 0, 0, 0])
    np.testing.assert_array_equal(step.positions[:8], [0, 1, 2, 0, 1, 2, 3, 0])
    np.testing.assert_array_equal(step.segments, [0, 0, 0, 1, 1, 1, 1, 2] + [-1] * 8)
    np.testing.assert_array_equal(step.pool_rows, [2, 4, 7, 0])
    assert all(a.dtype == np.int32 for a in (step.tokens, step.positions, step.segments, step.pool_rows))


def test_packed_arrays_for_encoders():
    bert = _batcher(PackingSpec("first", pad_token_id=0))
    bert.add(ClassifyItem("x", [101, 5, 102]))
    bert.add(ClassifyItem("y", [101, 102]))
    step = bert.next_step()
    np.testing.assert_array_equal(step.pool_rows[:2], [0, 3])
    np.testing.assert_array_equal(step.positions[:5], [0, 1, 2, 0, 1])
    roberta = PackingSpec("first", pad_token_id=1, roberta_positions=True)
    # fairseq's make_positions: from pad + 1, padding tokens at pad itself
    np.testing.assert_array_equal(roberta.positions(np.array([0, 5, 1, 6])), [2, 3, 1, 4])


def test_probabilities():
    p = probabilities(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32))
    np.testing.assert_allclose(p.sum(-1), 1.0)
    np.testing.assert_allclose(p[1], [1 / 3] * 3)
    np.testing.assert_allclose(probabilities(np.array([1000.0, 0.0])), [1.0, 0.0])  # no overflow
    assert probabilities(np.array([-2.5])).tolist() == [-2.5]  # a reward model's score, as is


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
        np.testing.assert_allclose(engine.classify([x])[0].logits, r.logits, atol=1e-5)
    from jaxserve.engine.classify_batcher import PackedStep

    odd = PackedStep(Bucket(48, 2), ["q"], [1], *(np.zeros(48, np.int32),) * 3, np.zeros(2, np.int32))
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
