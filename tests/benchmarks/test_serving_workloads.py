"""Workload generators: exact token lengths, seeded reproducibility, shared prefixes, JSONL files,
arrival times."""

from __future__ import annotations

import json

import numpy as np
import pytest
from toy_tokenizer import ToyTokenizer

from benchmarks.serving_workloads import (
    HFTokenizerAdapter,
    WorkloadError,
    jsonl_prompts,
    random_prompts,
    request_intervals,
    sample_lengths,
    shared_prefix_prompts,
)


@pytest.fixture
def tok():
    return ToyTokenizer()


def test_random_prompts_have_exact_lengths_and_round_trip(tok):
    prompts = random_prompts(tok, 50, input_len=40, output_len=7, seed=1)
    assert len(prompts) == 50
    for p in prompts:
        assert p.input_len == 40 and p.output_len == 7
        # The ids are the tokenizer's own encoding of the text: text and ids prompts agree.
        assert tok.encode(p.text) == p.token_ids
        assert not set(p.token_ids) & tok.special_ids


def test_the_toy_tokenizer_really_merges(tok):
    # Guards the test above: naive random ids would not round-trip with this tokenizer.
    rng = np.random.default_rng(0)
    sequences = [rng.integers(2, tok.vocab_size, 40).tolist() for _ in range(20)]
    assert sum(tok.encode(tok.decode(ids)) != ids for ids in sequences) > 10


def test_same_seed_same_prompts_other_seed_other_prompts(tok):
    a = random_prompts(tok, 10, 30, 5, range_ratio=0.5, seed=7)
    b = random_prompts(tok, 10, 30, 5, range_ratio=0.5, seed=7)
    c = random_prompts(tok, 10, 30, 5, range_ratio=0.5, seed=8)
    assert a == b
    assert [p.token_ids for p in a] != [p.token_ids for p in c]


def test_range_ratio_spreads_lengths_within_bounds(tok):
    prompts = random_prompts(tok, 200, input_len=20, output_len=10, range_ratio=0.5, seed=0)
    ins = [p.input_len for p in prompts]
    outs = [p.output_len for p in prompts]
    assert min(ins) >= 10 and max(ins) <= 30 and len(set(ins)) > 5
    assert min(outs) >= 5 and max(outs) <= 15 and len(set(outs)) > 3
    assert all(tok.encode(p.text) == p.token_ids for p in prompts)


def test_sample_lengths():
    rng = np.random.default_rng(0)
    assert sample_lengths(128, 0.0, 5, rng) == [128] * 5
    assert min(sample_lengths(1, 0.9, 50, rng)) >= 1  # never a zero-length prompt
    for bad in (-0.1, 1.0):
        with pytest.raises(WorkloadError, match="range-ratio"):
            sample_lengths(10, bad, 1, rng)


def test_shared_prefix_groups(tok):
    prompts = shared_prefix_prompts(tok, 12, prefix_len=16, num_prefixes=3, suffix_len=8, output_len=4, seed=0)
    assert all(p.input_len == 24 and p.prefix_len == 16 for p in prompts)
    assert all(tok.encode(p.text) == p.token_ids for p in prompts)
    prefix = [tuple(p.token_ids[:16]) for p in prompts]
    assert prefix[0] == prefix[3] == prefix[6] == prefix[9]
    assert len(set(prefix)) == 3
    # Suffixes are unique, so only the prefix is shared.
    assert len({tuple(p.token_ids) for p in prompts}) == 12
    assert prompts == shared_prefix_prompts(tok, 12, 16, 3, 8, 4, seed=0)


def test_shared_prefix_rejects_bad_shapes(tok):
    with pytest.raises(WorkloadError, match="groups"):
        shared_prefix_prompts(tok, 4, 16, 0, 8, 4)
    with pytest.raises(WorkloadError, match="prefix-len"):
        shared_prefix_prompts(tok, 4, 0, 2, 8, 4)


def test_jsonl_prompts_in_file_order_cycled(tok, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "thecat", "output_len": 3}\n\n{"prompt": "abc", "max_tokens": 5}\n{"prompt": "ing"}\n')
    prompts = jsonl_prompts(path, tok, num_prompts=5, output_len=9)
    assert [p.text for p in prompts] == ["thecat", "abc", "ing", "thecat", "abc"]
    assert [p.output_len for p in prompts] == [3, 5, 9, 3, 5]
    assert prompts[1].token_ids == tok.encode("abc") and prompts[1].input_len == 1


@pytest.mark.parametrize("content, message", [
    ("not json\n", "not JSON"),
    ('{"text": "x"}\n', '"prompt"'),
    ('["x"]\n', '"prompt"'),
    ('{"prompt": ""}\n', '"prompt"'),
    ('{"prompt": "x", "output_len": 0}\n', "positive integer"),
    ('{"prompt": "x", "output_len": "5"}\n', "positive integer"),
    ("\n\n", "no prompts"),
])
def test_jsonl_errors_name_the_line(tok, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=message):
        jsonl_prompts(path, tok, 1, 4)


def test_jsonl_missing_file(tok, tmp_path):
    with pytest.raises(WorkloadError, match="not a file"):
        jsonl_prompts(tmp_path / "missing.jsonl", tok, 1, 4)


def test_request_intervals():
    assert request_intervals(4, float("inf")) == [0.0] * 4
    assert request_intervals(0, 2.0) == []
    gaps = request_intervals(4000, request_rate=5.0, seed=3)
    assert gaps[0] == 0.0 and len(gaps) == 4000
    assert np.mean(gaps[1:]) == pytest.approx(0.2, rel=0.05)
    # Poisson: exponential gaps have a coefficient of variation of 1; burstiness 4 is steadier.
    assert np.std(gaps[1:]) / np.mean(gaps[1:]) == pytest.approx(1.0, rel=0.1)
    steady = request_intervals(4000, 5.0, burstiness=4.0, seed=3)
    assert np.std(steady[1:]) / np.mean(steady[1:]) == pytest.approx(0.5, rel=0.1)
    assert gaps == request_intervals(4000, 5.0, seed=3)
    for rate, burst in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(WorkloadError):
            request_intervals(3, rate, burst)


@pytest.mark.slow
def test_exact_lengths_with_the_real_smollm2_tokenizer(smollm2_tokenizer):
    tok = HFTokenizerAdapter(smollm2_tokenizer)
    assert {0, 1, 2} <= tok.special_ids
    prompts = random_prompts(tok, 30, input_len=128, output_len=16, range_ratio=0.5, seed=0)
    for p in prompts:
        # What the server does with a text prompt: encode with its own tokenizer.
        assert smollm2_tokenizer.encode(p.text) == p.token_ids
    shared = shared_prefix_prompts(tok, 8, 64, 2, 32, 8, seed=0)
    assert all(smollm2_tokenizer.encode(p.text) == p.token_ids and p.input_len == 96 for p in shared)
    assert shared[0].token_ids[:64] == shared[2].token_ids[:64]


def test_jsonl_rows_are_json_objects(tok, tmp_path):
    # A file written by json.dumps, as people produce them.
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": t}) for t in ["ab", "cd"]))
    assert [p.token_ids for p in jsonl_prompts(path, tok, 2, 4)] == [tok.encode("ab"), tok.encode("cd")]
