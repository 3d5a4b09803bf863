"""The classification batcher (host only, milliseconds): validation that names the numbers,
priority order, packing into buckets, pooling rows and positions. The engine thread on a tiny
model: tests/engine/test_classify_engine.py."""

from __future__ import annotations

import sys

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
    assert all(a.dtype == np.int32 for a in (step.tokens, step.positions, step.segments, step.pool_rows,
                                             step.token_types))


def test_packed_arrays_for_encoders():
    bert = _batcher(PackingSpec("first", pad_token_id=0))
    bert.add(ClassifyItem("x", [101, 5, 102]))
    bert.add(ClassifyItem("y", [101, 102, 7, 102], token_types=[0, 0, 1, 1]))  # a text pair
    step = bert.next_step()
    np.testing.assert_array_equal(step.pool_rows[:2], [0, 3])
    np.testing.assert_array_equal(step.positions[:7], [0, 1, 2, 0, 1, 2, 3])
    np.testing.assert_array_equal(step.token_types, [0, 0, 0, 0, 0, 1, 1] + [0] * 9)
    with pytest.raises(ValueError, match="2 token types for 3 tokens"):
        bert.add(ClassifyItem("z", [101, 5, 102], token_types=[0, 0]))
    roberta = PackingSpec("first", pad_token_id=1, roberta_positions=True)
    # fairseq's make_positions: from pad + 1, padding tokens at pad itself
    np.testing.assert_array_equal(roberta.positions(np.array([0, 5, 1, 6])), [2, 3, 1, 4])


def test_probabilities():
    p = probabilities(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32))
    np.testing.assert_allclose(p.sum(-1), 1.0)
    np.testing.assert_allclose(p[1], [1 / 3] * 3)
    np.testing.assert_allclose(probabilities(np.array([1000.0, 0.0])), [1.0, 0.0])  # no overflow
    assert probabilities(np.array([-2.5]), "identity").tolist() == [-2.5]  # a reward model's score, as is
    np.testing.assert_allclose(probabilities(np.array([0.0, 2.0, -40.0, 800.0, -800.0]), "sigmoid"),
                               [0.5, 1 / (1 + np.exp(-2.0)), 4.248354255291589e-18, 1.0, 0.0],
                               rtol=1e-12, atol=0)  # each label alone; no overflow, no early underflow
    with pytest.raises(ValueError, match="activation must be softmax, sigmoid or identity, got 'tanh'"):
        probabilities(np.array([1.0]), "tanh")


def test_finish_embedding_cuts_then_normalises():
    from jaxserve.engine.classify_batcher import cosine, finish_embedding

    v = np.array([3.0, 4.0, 12.0], np.float32)
    np.testing.assert_allclose(finish_embedding(v, True), v / 13.0, rtol=1e-6)
    np.testing.assert_allclose(finish_embedding(v, True, 2), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(finish_embedding(v, False, 2), [3.0, 4.0])
    np.testing.assert_array_equal(finish_embedding(np.zeros(3), True), np.zeros(3))  # no division by zero
    assert cosine(v, 2 * v) == pytest.approx(1.0) and cosine(np.array([1.0, 0]), np.array([0, 1.0])) == 0.0
