"""The offline API's beam search and draft model, on tiny random-init checkpoints saved as a user
would have them: `LLM.beam_search` (vLLM's) returns HF transformers' beams; `LLM(speculative_config=
{"model": ...})` loads the draft as `--speculative-model` does and changes no output; the model's
generation_config.json num_assistant_tokens is the deployment's default draft length (OVMS), and a
request's own setting wins."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_tiny_model, save_tiny_tokenizer

from jaxserve import BeamSearchParams, SamplingParams
from jaxserve.llm import LLM

pytestmark = pytest.mark.slow

SMALL = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=48)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    target, draft = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    hf = make_tiny_model("llama3", target)
    save_tiny_tokenizer(target)
    make_tiny_model("qwen2", draft)
    return target, draft, hf


@pytest.fixture(scope="module")
def plain(checkpoints, cache_dir):
    return LLM(str(checkpoints[0]), cache_dir=cache_dir, **SMALL)


def test_beam_search_returns_hf_beams(checkpoints, plain):
    _, _, hf = checkpoints
    llm = plain
    prompt = [1, 17, 99, 3, 250, 42]
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=10),
                             use_tqdm=False)
    want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       num_beams=3, num_return_sequences=3, max_new_tokens=10, do_sample=False, eos_token_id=2,
                       pad_token_id=2, length_penalty=1.0, early_stopping=False)
    beams = []
    for row in want.tolist():
        out_ids = row[len(prompt):]
        beams.append(prompt + (out_ids[: out_ids.index(2) + 1] if 2 in out_ids else out_ids))
    assert [s.tokens for s in out.sequences] == beams
    for s in out.sequences:
        assert s.text == llm.tokenizer.decode(s.tokens)
        assert sum(lp.logprob for lp in s.logprobs) == pytest.approx(s.cum_logprob, abs=1e-4)
    with pytest.raises(ValueError, match="temperature"):
        llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5))


def test_a_draft_model_and_the_deployment_default(checkpoints, plain, cache_dir):
    target, draft, _ = checkpoints
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "num_assistant_tokens": 2}))
    try:
        spec = LLM(str(target), cache_dir=cache_dir, speculative_config={"model": str(draft), "num_speculative_tokens": 3},
                   **SMALL)
    finally:
        (target / "generation_config.json").unlink()
    prompts = [{"prompt_token_ids": [1, 17, 99, 3]}, {"prompt_token_ids": [1, 5, 5, 5, 77]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours, theirs = spec.generate(prompts, greedy, use_tqdm=False), plain.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert all(out.num_draft_tokens > 0 for out in ours)
    (three,) = spec.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                         num_assistant_tokens=3), use_tqdm=False)
    assert three.outputs[0].token_ids == theirs[0].outputs[0].token_ids
    # The tiny draft is mostly wrong, so every verify step yields about one token: the request's 3
    # drafts a step outnumber generation_config.json's 2.
    assert three.num_draft_tokens > ours[0].num_draft_tokens
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(str(target), speculative_config={"model": str(draft), "prompt_lookup_max": 2}, **SMALL)
