"""BucketTable: default powers of two, explicit overrides, lookups."""

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.engine.buckets import BucketTable, Shape


def test_defaults_are_powers_of_two_up_to_the_maxima():
    table = BucketTable(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512))
    assert table.decode_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert table.prefill_buckets == (16, 32, 64, 128, 256, 512)
    assert table.max_decode_batch == 64 and table.max_prefill_tokens == 512


def test_a_maximum_that_is_not_a_power_of_two_is_the_last_bucket():
    table = BucketTable(SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=300))
    assert table.decode_buckets == (1, 2, 4, 8, 16, 32, 48)
    assert table.prefill_buckets == (16, 32, 64, 128, 256, 300)
    tiny = BucketTable(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8))
    assert tiny.decode_buckets == (1,) and tiny.prefill_buckets == (8,)


def test_lookups_pick_the_smallest_bucket_that_holds_n():
    table = BucketTable(SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=300))
    assert [table.decode_bucket(n) for n in (1, 2, 3, 5, 33, 48)] == [1, 2, 4, 8, 48, 48]
    assert [table.prefill_bucket(n) for n in (1, 16, 17, 257, 300)] == [16, 16, 32, 300, 300]
    with pytest.raises(ValueError, match="decode batch 49 exceeds the largest bucket 48"):
        table.decode_bucket(49)
    with pytest.raises(ValueError, match="prefill tokens 301 exceeds the largest bucket 300"):
        table.prefill_bucket(301)


def test_overrides_are_used_and_validated():
    table = BucketTable(SchedulerConfig(max_num_seqs=8, decode_buckets=(2, 8), prefill_buckets=(100, 512)))
    assert table.decode_buckets == (2, 8) and table.decode_bucket(1) == 2
    assert table.prefill_buckets == (100, 512)
    bad = [
        (dict(decode_buckets=(4, 2, 8)), "strictly increasing"),
        (dict(decode_buckets=(0, 8)), "positive integers"),
        (dict(decode_buckets=(2, 4)), "must equal max_num_seqs=8"),
        (dict(decode_buckets=()), "must not be empty"),
        (dict(prefill_buckets=(64, 256)), "must equal max_num_batched_tokens=512"),
    ]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            BucketTable(SchedulerConfig(max_num_seqs=8, **overrides))


def test_all_shapes_lists_every_bucket_once():
    table = BucketTable(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    assert table.all_shapes() == [
        Shape("prefill", 16),
        Shape("prefill", 32),
        Shape("prefill", 64),
        Shape("decode", 1),
        Shape("decode", 2),
        Shape("decode", 4),
    ]
    assert "prefill=[16, 32, 64]" in repr(table)
