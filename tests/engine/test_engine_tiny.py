"""Every architecture through the engine: greedy output over the paged cache (chunked prefill,
preemption, prefix hits, sliding windows longer than a page) equals the no-cache reference."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine, compile_engine
from jaxserve.engine.core import run_to_completion
from jaxserve.engine.request import SamplingParams
from jaxserve.models.reference import greedy_reference
from jaxserve.tokenizer import load_tokenizer
from jaxserve.weights import load_model
from tiny_models import TINY_CONFIGS, make_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18, 40, 41, 42, 43, 44, 45, 46], [1, 42], [1, 9, 8, 7, 6, 5, 4]]
# One decode bucket: every architecture compiles its steps here, and which bucket pads a batch
# changes no token; the one-token bucket has its own test below.
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=14),  # 13 usable pages of 4 tokens: forces preemption
    scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_seqs=2, max_model_len=48,
                              decode_buckets=(2,)),
)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_engine_greedy_equals_reference(name, tmp_path):
    make_tiny_model(name, tmp_path)
    save_tiny_tokenizer(tmp_path)
    model = load_model(tmp_path, "float32", use_cache=False).model
    engine = build_engine(model, load_tokenizer(tmp_path), CONFIG)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = greedy_reference(model, PROMPTS, 20)
    for round_ in range(2):  # the second round hits the prefix cache
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"{round_}-{i}", p, params)
        results = run_to_completion(engine, [f"{round_}-{i}" for i in range(len(PROMPTS))])
        assert [results[f"{round_}-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
        engine.check_idle_integrity()
    assert engine.num_preemptions > 0
    if name != "phi3-longrope":  # its recomputes past the switch evict this small cache (test_phi3.py)
        assert results["1-0"].num_cached_tokens > 0


def test_padded_one_token_steps_equal_reference(tmp_path):
    """On the CPU a bfloat16 step never multiplies a single row (XLA:CPU's one-row bfloat16
    product is ~10x slower): one-token steps carry a padding token. Forced on here in float32,
    where exactness can be checked, the padding must change nothing: not the tokens, not the
    cache (the padding token is never written)."""
    make_tiny_model("llama3", tmp_path)
    save_tiny_tokenizer(tmp_path)
    model = load_model(tmp_path, "float32", use_cache=False).model
    one_token = dataclasses.replace(CONFIG, scheduler=dataclasses.replace(CONFIG.scheduler, decode_buckets=(1, 2)))
    engine = build_engine(model, load_tokenizer(tmp_path), one_token, compile=False)
    engine.runner.min_rows = 2  # what a bfloat16 model on the CPU gets
    compile_engine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("alone", PROMPTS[0], params)  # one sequence: decode runs in the one-token bucket
    results = run_to_completion(engine, ["alone"])
    assert results["alone"].outputs[0].token_ids == greedy_reference(model, PROMPTS[:1], 20)[0]
    engine.check_idle_integrity()
