"""Beam search in the engine's batches against Hugging Face transformers' own
`generate(num_beams=..., num_return_sequences=..., length_penalty=..., early_stopping=...)`:
the same beams, token for token, with their scores, on SmolLM2 (float32) and on tiny random-init
models (whose beams often end on EOS); under preemption (a small cache), beside other requests
(whose outputs do not change), and with min_tokens and stop ids. Parameters beam search cannot
honour are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_requests import run_requests
from tiny_models import make_tiny_model

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.request import SamplingParams
from jaxserve.errors import InvalidRequestError, RequestTooLongError
from jaxserve.weights import load_model

pytestmark = pytest.mark.slow

# One bucket of each kind, not every power of two: each is a compile of the 30-layer model (5-12 s
# on two cores), and which bucket pads a batch changes no token (tests/engine/test_engine.py).
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=16, num_pages=96),
    scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_seqs=4, max_model_len=256,
                              decode_buckets=(8,), prefill_buckets=(64,)),
    check_integrity=True,
)
# 21 usable pages of 8 tokens: one 4-beam search of 42 tokens fits (21 pages without sharing),
# two beside two other requests do not.
SMALL = dataclasses.replace(CONFIG, cache=CacheConfig(page_size=8, num_pages=22),
                            scheduler=dataclasses.replace(CONFIG.scheduler, max_num_seqs=12, decode_buckets=(12,),
                                                          prefill_buckets=(64,)))

# (beams, returned, length_penalty, early_stopping, max_tokens)
SETTINGS = [(4, 2, 1.0, False, 20), (3, 3, 0.5, True, 12), (5, 1, 2.0, "never", 16), (2, 2, -1.0, False, 10)]


@pytest.fixture(scope="module")
def engine(model, smollm2_tokenizer):
    return build_engine(model, smollm2_tokenizer, CONFIG)


def _beams(width: int, n: int, length_penalty: float, early_stopping: bool | str, max_tokens: int,
           **kw) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=width, n=n, max_tokens=max_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping, **kw)




def _hf_beams(hf, prompt: list[int], eos: list[int], width: int, n: int, length_penalty: float,
              early_stopping: bool | str, max_tokens: int, min_tokens: int = 0) -> tuple[list[list[int]], list[float]]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      num_beams=width, num_return_sequences=n, max_new_tokens=max_tokens,
                      min_new_tokens=min_tokens or None, length_penalty=length_penalty, early_stopping=early_stopping,
                      do_sample=False, eos_token_id=eos, pad_token_id=eos[0], return_dict_in_generate=True,
                      output_scores=True)
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)  # padding follows a beam's end id
        beams.append(row if end is None else row[: end + 1])
    return beams, out.sequences_scores.tolist()


def _check_same(ours, theirs: tuple[list[list[int]], list[float]], eos: list[int], length_penalty: float) -> None:
    beams, scores = theirs
    assert [o.token_ids for o in ours.outputs] == beams
    for o, score in zip(ours.outputs, scores):
        assert o.cumulative_logprob / len(o.token_ids) ** length_penalty == pytest.approx(score, abs=2e-3)
        assert o.finish_reason == ("stop" if o.token_ids[-1] in eos else "length")


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"w{s[0]}-n{s[1]}-lp{s[2]}-es{s[3]}")
def test_smollm2_beams_match_hf(engine, hf_smollm2, smollm2_tokenizer, setting):
    tok = smollm2_tokenizer
    eos = list(engine.info.eos_ids)
    chat = tok.encode_chat([{"role": "user", "content": "What is 2+2? Answer with one number."}])
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n"), chat]
    _, n, lp, _, _ = setting
    ours = run_requests(engine, prompts, [_beams(*setting, logprobs=2)] * len(prompts))
    for prompt, out in zip(prompts, ours):
        _check_same(out, _hf_beams(hf_smollm2, prompt, eos, *setting), eos, lp)
        assert len(out.outputs) == n
        for o in out.outputs:  # each token's own logprob and top alternatives, from its own beam
            assert [lp.token_id for lp in o.logprobs] == o.token_ids
            assert sum(lp.logprob for lp in o.logprobs) == pytest.approx(o.cumulative_logprob, abs=1e-4)
            assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-5 for lp in o.logprobs)
            assert o.text == tok.decode([t for t in o.token_ids if t not in eos], skip_special_tokens=True)
    if setting == SETTINGS[0]:
        assert all(o.finish_reason == "stop" for o in ours[2].outputs)  # the chat answers end on EOS


def test_min_tokens_and_stop_ids_match_hf(engine, hf_smollm2, smollm2_tokenizer):
    tok = smollm2_tokenizer
    eos = list(engine.info.eos_ids)
    chat = tok.encode_chat([{"role": "user", "content": "Say hi."}])
    (ours,) = run_requests(engine, [chat], [_beams(3, 2, 1.0, False, 24, min_tokens=8)])
    _check_same(ours, _hf_beams(hf_smollm2, chat, eos, 3, 2, 1.0, False, 24, min_tokens=8), eos, 1.0)
    assert all(len(o.token_ids) >= 9 or o.finish_reason == "length" for o in ours.outputs)
    # A stop id ends beams as EOS does (HF: one more end id): the best beam's first token, which
    # (with no length normalisation) makes the best hypothesis that one token.
    prompt = tok.encode("def fibonacci(n):\n")
    (plain,) = run_requests(engine, [prompt], [_beams(3, 3, 0.0, False, 16)])
    stop = plain.outputs[0].token_ids[0]
    (ours,) = run_requests(engine, [prompt], [_beams(3, 3, 0.0, False, 16, stop_token_ids=[stop])])
    _check_same(ours, _hf_beams(hf_smollm2, prompt, [*eos, stop], 3, 3, 0.0, False, 16), [*eos, stop], 0.0)
    assert any(o.stop_reason == stop for o in ours.outputs)


def test_beams_beside_other_requests_and_under_preemption(model, smollm2_tokenizer, engine):
    tok = smollm2_tokenizer
    prompts = [tok.encode("Once upon a time, in a small village,"), tok.encode("The three laws of robotics are"),
               tok.encode("List three colours:"), tok.encode("The capital of France is")]
    beam = _beams(4, 2, 1.0, False, 32)
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=32)
    alone = [run_requests(engine, [p], [s], f"alone{i}")[0] for i, (p, s) in enumerate(zip(prompts, [beam, greedy, seeded, beam]))]
    mixed = run_requests(engine, prompts, [beam, greedy, seeded, beam], "mixed")
    small = build_engine(model, smollm2_tokenizer, SMALL)
    squeezed = run_requests(small, prompts, [beam, greedy, seeded, beam], "small")
    assert small.num_preemptions > 0
    for a, m, s in zip(alone, mixed, squeezed):
        assert [o.token_ids for o in m.outputs] == [o.token_ids for o in a.outputs]
        assert [o.token_ids for o in s.outputs] == [o.token_ids for o in a.outputs]


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_tiny_models_match_hf(name, tmp_path):
    hf = make_tiny_model(name, tmp_path)
    decoder = load_model(tmp_path, "float32", use_cache=False).model
    engine = build_engine(decoder, None, CONFIG, eos_ids=[2])
    eos = list(engine.info.eos_ids)
    prompts = [[1, 17, 99, 3, 250, 42], [1, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 77], [1, 200]]
    ended = 0
    for setting in SETTINGS:
        ours = run_requests(engine, prompts, [_beams(*setting)] * len(prompts), str(setting))
        for prompt, out in zip(prompts, ours):
            _check_same(out, _hf_beams(hf, prompt, eos, *setting), eos, setting[2])
            ended += sum(o.finish_reason == "stop" for o in out.outputs)
    assert ended > 0  # some beams ended on EOS: the finished-hypothesis rules were exercised


def test_refused(engine, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("Hello")
    bad = [(dict(temperature=0.7), "temperature"), (dict(top_p=0.9), "top_p"), (dict(top_k=40), "top_k"),
           (dict(stop=["\n"]), "stop"), (dict(repetition_penalty=1.2), "repetition_penalty"),
           (dict(logit_bias={5: 1.0}), "logit_bias"), (dict(best_of=9), "best_of"), (dict(best_of=11), "best_of")]
    for extra, name in bad:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", prompt, dataclasses.replace(_beams(4, 2, 1.0, False, 8), **extra))
        assert e.value.param == name
    for name, value in (("length_penalty", 1.5), ("early_stopping", True)):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", prompt, SamplingParams(**{name: value}))
        assert e.value.param == name
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", prompt, _beams(4, 2, 1.0, "sometimes", 8))
    with pytest.raises(RequestTooLongError):  # 8 beams of 250 tokens need more than the 95 pages
        engine.add_request("bad", prompt, _beams(8, 1, 1.0, False, 240))
    # temperature 0 or 1 is the model's distribution: accepted
    (out,) = run_requests(engine, [prompt], [dataclasses.replace(_beams(2, 1, 1.0, False, 4), temperature=0.0)])
    assert len(out.outputs[0].token_ids) == 4 or out.outputs[0].finish_reason == "stop"
