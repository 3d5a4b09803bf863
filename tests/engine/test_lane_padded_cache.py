"""On a TPU the KV cache's head_dim is the model's rounded up to 128 lanes (engine/kv_cache.py:
XLA:TPU laid a 64-wide cache out with the pages minor and copied it whole around every step;
tests/tpu_aot checks the compiled steps). Here, on the CPU, with the cache made that wide: the
engine answers exactly as with the model's head_dim, and the padding lanes stay zero."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine import kv_cache
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.kv_cache import KVCache, bytes_per_page, cache_head_dim, num_pages_for
from jaxserve.engine.request import SamplingParams
from jaxserve.models.config import decoder_config_from_hf
from jaxserve.tokenizer import load_tokenizer
from jaxserve.weights import load_model
from engine_requests import run_requests
from tiny_models import make_tiny_model, save_tiny_tokenizer

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18, 40, 41, 42, 43, 44, 45, 46], [1, 42], [1, 9, 8, 7, 6, 5, 4]]
# Small pages and a small cache: chunked prefill, preemption and prefix hits all read the cache.
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=14),
    scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_seqs=2, max_model_len=48,
                              decode_buckets=(2,)),
    attention_backend="reference",
)


def test_only_a_tpu_cache_is_rounded_up_to_128_lanes():
    assert [cache_head_dim(d, "tpu") for d in (8, 64, 80, 128, 192, 256)] == [128, 128, 128, 128, 256, 256]
    assert [cache_head_dim(d, p) for d in (64, 80) for p in ("cpu", "gpu")] == [64, 64, 80, 80]
    cfg = decoder_config_from_hf(dict(
        architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256))  # fmt: skip
    assert bytes_per_page(cfg, 16, jnp.bfloat16, "tpu") == 2 * bytes_per_page(cfg, 16, jnp.bfloat16, "gpu")
    assert KVCache.shape(cfg, 10, 16, "tpu") == (16, 8, 10, 16, 128)
    assert KVCache.shape(cfg, 10, 16, "cpu") == (16, 8, 10, 16, 64)

    @dataclasses.dataclass
    class Tpu:  # what num_pages_for reads of a 16 GiB chip
        platform: str = "tpu"

        def memory_stats(self) -> dict:
            return {"bytes_limit": 16 * 2**30, "bytes_in_use": 0}

    budget = CacheConfig(page_size=16, kv_cache_memory_fraction=0.5)
    assert num_pages_for(budget, cfg, jnp.bfloat16, Tpu()) == 8 * 2**30 // (2 * 16 * 8 * 16 * 128 * 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    make_tiny_model("llama3", path)
    save_tiny_tokenizer(path)
    return load_model(path, "float32", use_cache=False).model, load_tokenizer(path)


def _serve(engine, tag: str) -> dict:
    """Two rounds of the prompts, greedy: the first with prompt logprobs (every prompt token
    computed), the second reading its prompts' full pages from the prefix cache."""
    out = {}
    for round_ in range(2):
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1 - round_ or None)
        for i, r in enumerate(run_requests(engine, PROMPTS, params, f"{tag}{round_}")):
            lps = [None if lp is None else lp.logprob for lp in (r.prompt_logprobs or [])]
            out[(round_, i)] = (r.outputs[0].token_ids, lps, r.num_cached_tokens)
    return out


def test_a_lane_padded_cache_answers_as_the_models_head_dim(tiny, monkeypatch):
    model, tokenizer = tiny
    head_dim = model.cfg.head_dim
    assert head_dim < 128
    plain = build_engine(model, tokenizer, CONFIG)
    assert plain.runner.kv.k.shape[-1] == head_dim
    expected = _serve(plain, "plain")
    assert plain.num_preemptions > 0

    # The cache as a TPU holds it; everything else (the reference attention, its CPU write) as here.
    as_on_tpu = kv_cache.cache_head_dim
    monkeypatch.setattr(kv_cache, "cache_head_dim", lambda head_dim, platform=None: as_on_tpu(head_dim, "tpu"))
    padded = build_engine(model, tokenizer, CONFIG)
    assert padded.runner.kv.k.shape[-1] == padded.runner.kv.v.shape[-1] == 128
    got = _serve(padded, "padded")
    assert padded.num_preemptions == plain.num_preemptions
    for key, (tokens, lps, cached) in expected.items():
        g_tokens, g_lps, g_cached = got[key]
        assert g_tokens == tokens, key
        assert g_cached == cached, key
        # Zero lanes add nothing to q.k; the sums' order may differ in the last float32 bits.
        np.testing.assert_allclose(np.array(g_lps[1:], float), np.array(lps[1:], float), atol=1e-5)
    assert got[(1, 0)][2] > 0  # the second round did read its prompt from the cache
    # Keys and values were written (the cache is not all zeros) into the model's lanes only.
    k, v = np.asarray(jax.device_get(padded.runner.kv.k)), np.asarray(jax.device_get(padded.runner.kv.v))
    assert np.abs(k[..., :head_dim]).sum() > 0 and np.abs(v[..., :head_dim]).sum() > 0
    assert not k[..., head_dim:].any() and not v[..., head_dim:].any()
