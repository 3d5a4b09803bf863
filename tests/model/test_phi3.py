"""Phi-3's LongRoPE beyond the shared architecture tests (which run the tiny Phi-3 models on
prompts shorter than the switch): the Hub's config layouts, a prompt longer than
original_max_position against HF's one forward, and in the engine sequences that grow past the
switch, recomputed with the long factors as HF's Phi3 recomputes its cache, while the prefix
cache never lends short pages to long sequences."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jaxserve.models.config import UnsupportedModelError, decoder_config_from_hf
from jaxserve.weights import load_model
from tiny_models import TINY_CONFIGS, dense_logits, make_tiny_model, save_tiny_tokenizer

SWITCH = TINY_CONFIGS["phi3-longrope"][1]["original_max_position_embeddings"]

# microsoft/Phi-3-mini-128k-instruct's config.json, factors shortened to their count (48 = 96 / 2).
PHI3_MINI_128K = {
    "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [1.5] * 48, "short_factor": [1.0] * 48, "type": "longrope"},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False, "vocab_size": 32064,
}


def test_hub_longrope_config():
    cfg = decoder_config_from_hf(PHI3_MINI_128K)
    rope = cfg.rope
    assert (rope.kind, rope.original_max_position, rope.factor) == ("longrope", 4096, 32.0)
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert rope.short_factor == (1.0,) * 48 and rope.long_factor == (1.5,) * 48
    assert cfg.windows() == (262144,) * 32 and cfg.rotary_dim == 0
    su = {**PHI3_MINI_128K, "rope_scaling": {**PHI3_MINI_128K["rope_scaling"], "type": "su"}}
    assert decoder_config_from_hf(su).rope == rope  # LongRoPE's first name
    short = {**PHI3_MINI_128K, "rope_scaling": {**PHI3_MINI_128K["rope_scaling"], "short_factor": [1.0] * 47}}
    with pytest.raises(UnsupportedModelError, match="48 short and long factors"):
        decoder_config_from_hf(short)
    llama = {**PHI3_MINI_128K, "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        decoder_config_from_hf(llama)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("phi3-longrope")
    hf = make_tiny_model("phi3-longrope", directory)
    save_tiny_tokenizer(directory)
    return directory, hf


def test_long_prompt_matches_hf(tiny):
    """A prompt past the switch rotates by the long factors in HF's forward, and in ours."""
    directory, hf = tiny
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(SWITCH + 5)]
    ours = dense_logits(load_model(directory, "float32", use_cache=False).model, [prompt])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    with torch.no_grad():  # the short factors give other logits for the same positions
        assert np.abs(hf(torch.tensor([prompt[:SWITCH]])).logits[0].float().numpy() - ref[:SWITCH]).max() > 1e-2


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's greedy tokens, a full forward each: past the switch HF rotates the whole sequence long."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_engine_switches_to_the_long_factors_by_recomputing(tiny):
    """Greedy tokens equal HF's token by token (each step a full forward, so past the switch HF
    rotates the whole sequence long): prompts start short and long, the short ones cross the
    switch while decoding several tokens a step. The prefix cache serves a long prompt's pages to
    the same long prompt and never a short sequence's pages to a long one."""
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.engine.build import EngineConfig, build_engine
    from jaxserve.engine.core import run_to_completion
    from jaxserve.engine.request import SamplingParams
    from jaxserve.tokenizer import load_tokenizer

    directory, hf = tiny
    prompts = [[1] + [(5 * i) % 250 + 3 for i in range(SWITCH + 3)], [1, 42], [1, 9, 8, 7, 6, 5, 4, 3, 2, 11, 12, 13]]
    expected = [_hf_greedy(hf, prompt, 18) for prompt in prompts]
    config = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=4, max_model_len=48,
                                  decode_buckets=(4,), decode_steps=4),
        check_integrity=True)
    model = load_model(directory, "float32", use_cache=False).model
    engine = build_engine(model, load_tokenizer(directory), config)
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", prompt, params)
        results = run_to_completion(engine, [f"{round_}-{i}" for i in range(len(prompts))])
        assert [results[f"{round_}-{i}"].outputs[0].token_ids for i in range(len(prompts))] == expected
        engine.check_idle_integrity()
    # Each round, the two short prompts crossed the switch and were recomputed (no page pressure
    # here: 64 pages for 3 sequences of at most 32 tokens).
    assert engine.num_preemptions == 4
    # Round two found round one's pages: the long prompt its long ones, the 12-token prompt
    # (admitted short again) its short ones. A prompt's last token is always computed, so 16 of
    # 20 and 8 of 12.
    assert results["1-0"].num_cached_tokens == 16 and results["1-2"].num_cached_tokens == 8
    # A short prompt's pages are not lent to a long prompt that starts with it.
    short = [1] + [(3 * i) % 250 + 5 for i in range(11)]
    long = short + [7] * (SWITCH - 4)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    cached = {}
    for request_id, prompt in (("short", short), ("long", long), ("short again", short)):
        engine.add_request(request_id, prompt, one)
        out = run_to_completion(engine, [request_id])[request_id]
        with torch.no_grad():
            assert out.outputs[0].token_ids == [int(hf(torch.tensor([prompt])).logits[0, -1].argmax())]
        cached[request_id] = out.num_cached_tokens
    assert cached == {"short": 0, "long": 0, "short again": 8}


def test_ngram_drafts_stop_at_the_switch(tiny):
    """Prompt-lookup speculation on a LongRoPE model: tokens stay HF's, across the switch."""
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.engine.build import EngineConfig, build_engine
    from jaxserve.engine.core import run_to_completion
    from jaxserve.engine.request import SamplingParams

    directory, hf = tiny
    # Repeating prompts, so the n-gram drafter finds continuations.
    prompts = [[1] + [5, 6, 7, 8] * 3, [1] + [9, 10, 11] * 6]
    config = EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=4, max_model_len=48,
                                  decode_buckets=(4,), speculative_method="ngram", num_speculative_tokens=3,
                                  max_ngram_size=3, min_ngram_size=1),
        check_integrity=True)
    engine = build_engine(load_model(directory, "float32", use_cache=False).model, None, config)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    results = run_to_completion(engine, [str(i) for i in range(len(prompts))])
    assert [results[str(i)].outputs[0].token_ids for i in range(len(prompts))] == [
        _hf_greedy(hf, p, 14) for p in prompts]
    # Drafts were verified, and the short prompt crossed the switch (the cut itself: the
    # scheduler's unit test, where the drafts are chosen).
    assert engine.num_draft_tokens > 0 and engine.num_preemptions == 1
