"""Prompt-lookup speculative decoding end to end on SmolLM2 (float32, CPU): greedy outputs equal
those of plain decoding token for token under chunking, preemption and prefix hits; every ending
(EOS, stop ids, stop strings, length) and the rows that do not speculate (penalties, grammars)
give what the engine without speculation gives; seeded samples are plain decoding's very draws,
whatever the batch; drafts are accepted on copy-heavy prompts; per-request parameters are
honoured or refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_requests import run_requests

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.request import SamplingParams
from jaxserve.errors import InvalidRequestError

pytestmark = pytest.mark.slow

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt and "
             "wind. Every evening the keeper climbed the spiral stairs, trimmed the wick, and watched the beam sweep "
             "across the dark water until the fishing boats were safely home.")
LONG = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. The story should "
    "mention the sea, the weather, a seagull called Pip, and end with a surprising twist about the sender "
    "of the message, who turns out to be"
)
# A small cache (11 usable pages of 16 tokens): the first test's four sequences cannot all fit, so
# some are preempted and recomputed. test_engine.py's cache and its larger decode bucket, whose
# prefill and decode steps these are (read back from the compilation cache); one decode bucket,
# since each is also a verify step to compile, and which bucket pads a batch changes no token.
SMALL = EngineConfig(
    cache=CacheConfig(page_size=16, num_pages=12),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=240,
                              decode_buckets=(4,), prefill_buckets=(32,),
                              speculative_method="ngram", num_speculative_tokens=4, max_ngram_size=3),
    check_integrity=True,
)


@pytest.fixture(scope="module")
def engine(model, smollm2_tokenizer):
    return build_engine(model, smollm2_tokenizer, SMALL)


@pytest.fixture(scope="module")
def plain(model, smollm2_tokenizer):
    return build_engine(model, smollm2_tokenizer, dataclasses.replace(
        SMALL, scheduler=dataclasses.replace(SMALL.scheduler, speculative_method=None)))




def _copy_prompt(tokenizer, text: str = PARAGRAPH) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": f"Repeat the following paragraph exactly:\n\n{text}"}])


def test_greedy_equals_plain_decoding_under_preemption_and_drafts_are_accepted(engine, plain, smollm2_tokenizer):
    # The plain engine's greedy outputs equal the no-cache reference (test_engine).
    short = "The lighthouse keeper climbed the stairs. The lighthouse keeper climbed"
    prompts = [smollm2_tokenizer.encode(p) for p in
               (short, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", LONG, "def fibonacci(n):\n")]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = [r.outputs[0].token_ids for r in run_requests(plain, prompts, params, "reference")]
    before = engine.num_preemptions
    first = run_requests(engine, prompts, params, "greedy")
    assert [r.outputs[0].token_ids for r in first] == expected
    assert engine.num_preemptions > before  # the small page budget forced recompute
    second = run_requests(engine, prompts, params, "again")  # prefix-cache hits, drafts again
    assert [r.outputs[0].token_ids for r in second] == expected
    assert engine.num_accepted_draft_tokens > 0
    for r in first + second:
        assert 0 <= r.num_accepted_draft_tokens <= r.num_draft_tokens
    counting = first[1]  # "11, 12, ..." repeats ", " and digits: drafts are proposed and kept
    assert counting.num_draft_tokens > 0 and counting.num_accepted_draft_tokens > 0


def test_copying_is_mostly_accepted_and_takes_fewer_steps(engine, plain, smollm2_tokenizer):
    prompt = _copy_prompt(smollm2_tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=80)
    steps = {}
    outs = {}
    for name, eng in (("spec", engine), ("plain", plain)):
        before = eng.num_steps
        outs[name] = run_requests(eng, [prompt], params, f"copy-{name}")[0]
        steps[name] = eng.num_steps - before
    assert outs["spec"].outputs[0].token_ids == outs["plain"].outputs[0].token_ids
    assert outs["spec"].outputs[0].text.startswith("The old lighthouse stood at the edge of the cliff")
    r = outs["spec"]
    assert r.num_accepted_draft_tokens >= 0.8 * r.num_draft_tokens
    assert steps["spec"] * 2 < steps["plain"]


def test_every_ending_and_non_speculating_rows_equal_the_plain_engine(engine, plain, smollm2_tokenizer):
    copy = _copy_prompt(smollm2_tokenizer)
    chat = smollm2_tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    work = [
        (copy, SamplingParams(temperature=0.0, max_tokens=60, stop=["spiral stairs"])),  # stop string mid-draft
        (copy, SamplingParams(temperature=0.0, max_tokens=7)),  # length inside a verify step
        (copy, SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[28])),  # a stop id (",")
        (chat, SamplingParams(temperature=0.0, max_tokens=60, logprobs=2)),  # EOS, logprobs
        (copy, SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3)),  # penalised: no drafts
        (copy, SamplingParams(temperature=0.0, max_tokens=30, num_assistant_tokens=0)),  # turned off
        (copy, SamplingParams(temperature=0.0, max_tokens=30, num_assistant_tokens=1, max_ngram_size=1)),
        (copy, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25, stop_token_ids=[2])),
    ]
    got = {}
    for name, eng in (("spec", engine), ("plain", plain)):
        params = [w[1] if eng is engine else dataclasses.replace(w[1], num_assistant_tokens=None, max_ngram_size=None)
                  for w in work]
        got[name] = run_requests(eng, [w[0] for w in work], params, f"mix-{name}")
    for i, (s, p) in enumerate(zip(got["spec"], got["plain"])):
        a, b = s.outputs[0], p.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                          b.stop_reason), i
        if b.logprobs is not None:
            np.testing.assert_allclose([x.logprob for x in a.logprobs], [x.logprob for x in b.logprobs], atol=1e-4)
            assert [[t for t, _ in x.top] for x in a.logprobs] == [[t for t, _ in x.top] for x in b.logprobs]
    spec = got["spec"]
    assert spec[0].outputs[0].stop_reason == "spiral stairs" and spec[0].num_accepted_draft_tokens > 0
    assert len(spec[1].outputs[0].token_ids) == 7
    assert spec[4].num_draft_tokens == 0 and spec[5].num_draft_tokens == 0
    assert 0 < spec[6].num_draft_tokens <= 30  # one draft token per step at most


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine, smollm2_tokenizer):
    prompt = _copy_prompt(smollm2_tokenizer)
    seeded = SamplingParams(temperature=0.8, max_tokens=30, seed=1234, ignore_eos=True)
    alone = run_requests(engine, [prompt], seeded, "s1")[0]
    crowd = run_requests(engine, [prompt, smollm2_tokenizer.encode("Once upon a time")], seeded, "s2")[0]
    assert alone.outputs[0].token_ids == crowd.outputs[0].token_ids
    assert alone.num_accepted_draft_tokens > 0  # a low temperature copy still keeps drafts


def test_per_request_parameters_are_checked(engine, plain, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("Hello")
    for name, params in (("num_assistant_tokens", SamplingParams(num_assistant_tokens=2)),
                         ("max_ngram_size", SamplingParams(max_ngram_size=2))):
        with pytest.raises(InvalidRequestError, match="--speculative-method ngram") as e:
            plain.add_request("off", prompt, params)
        assert e.value.param == name
    with pytest.raises(InvalidRequestError, match=r"\[0, 4\]") as e:
        engine.add_request("big", prompt, SamplingParams(num_assistant_tokens=5))
    assert e.value.param == "num_assistant_tokens"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("zero", prompt, SamplingParams(max_ngram_size=0))
    assert e.value.param == "max_ngram_size"
    assert not engine.has_unfinished() and not plain.has_unfinished()


def test_seeded_samples_are_the_draws_of_plain_decoding(engine, plain, smollm2_tokenizer):
    """A verify step samples every position with the seed and step number a decode step would use,
    so seeded sampling gives the very tokens plain decoding gives (and thus its distribution),
    whatever the drafts; the drafts kept are those the model drew anyway."""
    prompt = _copy_prompt(smollm2_tokenizer)
    work = [SamplingParams(temperature=t, top_p=p, max_tokens=24, n=2, seed=100 + i, ignore_eos=True)
            for i, (t, p) in enumerate([(0.7, 1.0), (1.0, 1.0), (1.0, 0.9), (0.4, 1.0)])]
    got = {name: run_requests(eng, [prompt] * len(work), work, f"draws-{name}") for name, eng in
           (("spec", engine), ("plain", plain))}
    for s, p in zip(got["spec"], got["plain"]):
        assert [o.token_ids for o in s.outputs] == [o.token_ids for o in p.outputs]
    assert sum(r.num_accepted_draft_tokens for r in got["spec"]) > 20
