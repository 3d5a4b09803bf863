"""LLM(skip_tokenizer_init=True) on a checkpoint saved with no tokenizer files: token-id prompts give
exactly HF transformers' greedy tokens (float32), outputs carry token ids and empty text, sequences
end at the EOS ids of config.json and generation_config.json and at stop_token_ids, and everything
that needs a tokenizer (text prompts, chat, structured output, stop strings) is refused saying why."""

from __future__ import annotations

import json

import pytest
import torch

from jaxserve.engine.request import SamplingParams
from jaxserve.llm import LLM
from jaxserve.startup import generation_eos_ids
from jaxserve.tokenizer import load_tokenizer
from jaxserve.weights.source import resolve
from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 13, 17], [1, 2], [1, 100, 101, 102, 7, 250]]
MAX_TOKENS = 10
GENERATION_CONFIG_EOS = 2  # what make_tiny_model's generation_config.json says


def _hf_greedy(hf, prompt: list[int], eos_ids: list[int] | None) -> list[int]:
    """HF's greedy `generate` for one prompt: the new tokens, ending at the first of `eos_ids`
    (None: never ends early)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=eos_ids, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _first_new(tokens: list[int], start: int, exclude: set[int]) -> int:
    """The index (>= start) of the first token not seen before it and not in `exclude`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in exclude)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, cache_dir):
    directory = tmp_path_factory.mktemp("no-tokenizer")
    hf = make_tiny_model("llama3", directory)
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "generation_config.json",
                                                           "model.safetensors"]
    hf.generation_config.eos_token_id = None  # the reference stops only where each test says
    free = [_hf_greedy(hf, p, None) for p in PROMPTS]
    assert all(len(f) == MAX_TOKENS for f in free)
    # config.json's EOS becomes a token prompt 0 produces part-way, so generation must end there;
    # generation_config.json keeps its own EOS id, which must count too.
    at = _first_new(free[0], 3, {GENERATION_CONFIG_EOS})
    eos = free[0][at]
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    llm = LLM(str(directory), skip_tokenizer_init=True, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=64, num_pages=32, page_size=4, cache_dir=cache_dir)
    return llm, hf, free, eos, at


def test_greedy_ids_match_hf_with_empty_text(tiny):
    llm, hf, free, eos, at = tiny
    assert llm.tokenizer is None and llm.engine.tokenizer is None
    assert llm.engine.info.eos_ids == tuple(sorted({eos, GENERATION_CONFIG_EOS}))
    prompts = [PROMPTS[0], {"prompt_token_ids": PROMPTS[1]}, PROMPTS[2]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, [eos, GENERATION_CONFIG_EOS])
                                                      for p in PROMPTS]
    assert outs[0].outputs[0].token_ids == free[0][: at + 1]  # ended at config.json's EOS, which it keeps
    assert outs[0].outputs[0].finish_reason == "stop"
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert [o.outputs[0].text for o in outs] == ["", "", ""]
    # ignore_eos runs to max_tokens: HF's tokens with no EOS at all.
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == free
    assert [(o.outputs[0].finish_reason, o.outputs[0].text) for o in outs] == [("length", "")] * 3
    # One prompt of token ids is one request, not a batch of one-token prompts.
    single = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in single] == [free[2][:3]]


def test_stop_token_ids_end_generation(tiny):
    llm, hf, free, _, _ = tiny
    at = _first_new(free[2], 2, set())
    stop = free[2][at]
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == _hf_greedy(hf, PROMPTS[2], [stop]) == free[2][: at + 1]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, "")


def test_what_needs_a_tokenizer_is_refused(tiny):
    llm = tiny[0]
    why = "needs a tokenizer, and none was loaded because skip_tokenizer_init=True"
    with pytest.raises(ValueError, match=f"a text prompt {why}"):
        llm.generate("w5 w9", use_tqdm=False)
    with pytest.raises(ValueError, match=f"a text prompt {why}"):
        llm.generate([[1, 5], {"prompt": "w5"}], use_tqdm=False)
    with pytest.raises(ValueError, match=rf"LLM.chat \(its chat template renders text\) {why}"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match=rf"structured output \(LLM.structured\) {why}"):
        llm.structured(choice=["a", "b"])
    with pytest.raises(ValueError, match=r"^stop: stop strings need a tokenizer, and this engine has none "
                                         r"\(skip_tokenizer_init=True\); use stop_token_ids$"):
        llm.generate([[1, 5]], SamplingParams(stop=["w7"]), use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.classify needs task 'classify', but this LLM was started for task "
                                         "'generate'"):
        llm.classify([[1, 5]], use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing refused was left queued
    out = llm.generate([[1, 5]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == _hf_greedy(tiny[1], [1, 5], None)[:3]


def test_a_directory_without_a_tokenizer_says_so(tmp_path):
    directory = tmp_path / "m"
    make_tiny_model("llama3", directory)
    with pytest.raises(ValueError, match=r"holds no tokenizer .*skip_tokenizer_init=True"):
        load_tokenizer(directory)


def test_generation_config_eos_ids(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert generation_eos_ids(resolve(tmp_path, weights=False)) == ()
    for value, expected in ((7, (7,)), ([5, 9], (5, 9)), (None, ())):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert generation_eos_ids(resolve(tmp_path, weights=False)) == expected
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["2"]}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be a token id or a list of "
                                         r"them, got \['2'\]"):
        generation_eos_ids(resolve(tmp_path, weights=False))
