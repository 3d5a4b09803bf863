"""Speculative decoding with a draft model end to end (SmolLM2 float32 drafting for itself, on the
CPU): greedy and seeded outputs equal plain decoding's token for token, under chunking,
preemption, prefix-cache hits, n > 1 and beside rows that do not speculate; and since the draft is
the model itself, nearly every greedy draft is accepted, which holds only if the draft's own KV
cache follows the target's exactly through all of that. OVMS's per-request num_assistant_tokens
and assistant_confidence_threshold are honoured, and refused where they do not apply. A tiny model
drafting for another of the same vocabulary (few accepted) changes nothing either."""

from __future__ import annotations

import dataclasses

import pytest
from engine_requests import run_requests
from tiny_models import make_tiny_model

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.core import check_speculation
from jaxserve.engine.request import SamplingParams
from jaxserve.errors import InvalidRequestError
from jaxserve.weights import load_model

pytestmark = pytest.mark.slow

# 11 usable pages of 16 tokens: the four requests below cannot all fit, so some are preempted.
# One decode bucket (also a verify step, for both models: a compile of 5-12 s apiece on two cores)
# and one prefill bucket: which bucket pads a batch changes no token. The cache and the buckets are
# test_engine.py's (its decode bucket of 4), so the plain steps are read back from the compilation
# cache.
SMALL = EngineConfig(
    cache=CacheConfig(page_size=16, num_pages=12),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=240,
                              speculative_method="draft", num_speculative_tokens=4, decode_buckets=(4,),
                              prefill_buckets=(32,)),
    check_integrity=True,
)


@pytest.fixture(scope="module")
def engine(model, smollm2_tokenizer):
    return build_engine(model, smollm2_tokenizer, SMALL, draft=model)


def _plain(params: list[SamplingParams]) -> list[SamplingParams]:
    """The same requests decoded without drafts (num_assistant_tokens 0: plain decode steps)."""
    return [dataclasses.replace(p, num_assistant_tokens=0) for p in params]




def test_outputs_equal_plain_decoding_and_drafts_are_accepted(engine, smollm2_tokenizer):
    tok = smollm2_tokenizer
    fib = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n")
    prompts = [tok.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]), fib,
               tok.encode("The three laws of robotics are"), tok.encode("Once upon a time, in a small village,"),
               fib]  # again: its first page comes from the prefix cache
    # 60 tokens each: four rows of 70-90 tokens overflow the 176-token cache several times over.
    params = [SamplingParams(temperature=0.0, max_tokens=60), SamplingParams(temperature=0.0, max_tokens=60),
              SamplingParams(temperature=0.8, seed=3, max_tokens=60, n=2),
              SamplingParams(temperature=0.0, max_tokens=60, repetition_penalty=1.3),  # does not speculate
              SamplingParams(temperature=0.0, max_tokens=40)]
    before = engine.num_preemptions
    ours = run_requests(engine, prompts, params, "spec")
    theirs = run_requests(engine, prompts, _plain(params), "plain")
    for a, b in zip(ours, theirs):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
    assert engine.num_preemptions > before  # the small cache made it recompute
    assert ours[4].num_cached_tokens > 0
    greedy = [ours[i] for i in (0, 1, 4)]
    drafted = sum(o.num_draft_tokens for o in greedy)
    # A stale draft cache would draft from the wrong K/V and miss; only the numerics of a decode
    # loop against a ragged verify step may part the two on a near tie.
    assert drafted > 0 and sum(o.num_accepted_draft_tokens for o in greedy) / drafted > 0.95
    assert ours[2].num_accepted_draft_tokens > 0  # sampled rows draft the same draws
    assert ours[3].num_draft_tokens == 0


def test_per_request_fields(engine, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("The capital of France is")
    base = SamplingParams(temperature=0.0, max_tokens=30)
    (want,) = run_requests(engine, [prompt], _plain([base]), "p")
    (two,) = run_requests(engine, [prompt], [dataclasses.replace(base, num_assistant_tokens=2)], "two")
    (off,) = run_requests(engine, [prompt], [dataclasses.replace(base, num_assistant_tokens=0)], "off")
    (sure,) = run_requests(engine, [prompt], [dataclasses.replace(base, assistant_confidence_threshold=0.999)], "sure")
    (any_,) = run_requests(engine, [prompt], [dataclasses.replace(base, assistant_confidence_threshold=0.0)], "any")
    for out in (two, off, sure, any_):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert off.num_draft_tokens == 0
    assert 0 < two.num_draft_tokens <= 2 * 30
    # A threshold near 1 drafts only what the draft model is all but sure of; 0 drafts everything.
    assert sure.num_draft_tokens < any_.num_draft_tokens
    bad = [(dict(num_assistant_tokens=2, assistant_confidence_threshold=0.5), "assistant_confidence_threshold"),
           (dict(assistant_confidence_threshold=1.5), "assistant_confidence_threshold"),
           (dict(num_assistant_tokens=5), "num_assistant_tokens"), (dict(max_ngram_size=2), "max_ngram_size")]
    for extra, name in bad:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", prompt, dataclasses.replace(base, **extra))
        assert e.value.param == name
    for method in (None, "ngram"):  # a server without a draft model
        info = dataclasses.replace(engine.info, speculative_method=method)
        with pytest.raises(InvalidRequestError) as e:
            check_speculation(dataclasses.replace(base, assistant_confidence_threshold=0.5), info)
        assert e.value.param == "assistant_confidence_threshold"


def test_a_poor_draft_model_changes_nothing(tmp_path, model):
    make_tiny_model("llama3", tmp_path / "target")
    make_tiny_model("qwen2", tmp_path / "draft")
    target = load_model(tmp_path / "target", "float32", use_cache=False).model
    drafter = load_model(tmp_path / "draft", "float32", use_cache=False).model
    config = dataclasses.replace(SMALL, cache=CacheConfig(page_size=8, num_pages=40))
    engine = build_engine(target, None, config, eos_ids=[2], draft=drafter)
    prompts = [[1, 17, 99, 3, 250, 42], [1, 5, 5, 5, 5, 5, 77], [1, 200]]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40)]
    ours, theirs = run_requests(engine, prompts, params, "t"), run_requests(engine, prompts, _plain(params), "u")
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert sum(o.num_draft_tokens for o in ours) > 0
    with pytest.raises(ValueError, match="vocabulary"):
        build_engine(target, None, config, draft=model, compile=False)  # SmolLM2: 49152 tokens
