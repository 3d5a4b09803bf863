"""benchmarks.quantization_quality's report arithmetic (the model runs are the benchmark's)."""

from benchmarks.quantization_quality import PROMPTS, common_prefix, compare


def test_common_prefix_and_agreement():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([5], [6]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2
    report = compare([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7, 8]])
    assert report["identical"] == 1 and report["prompts"] == 2
    assert report["common_prefix"] == [4, 1] and report["mean_common_prefix"] == 2.5
    assert report["position_agreement"] == 7 / 8  # agreement after a fork still counts per position
    assert len(PROMPTS) == 20 and len(set(PROMPTS)) == 20
