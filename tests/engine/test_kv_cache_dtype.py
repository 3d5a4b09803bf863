"""An 8-bit KV cache (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2): the cache holds a byte per key
and value, so twice the tokens fit and a step reads half the KV bytes; the engine's output is then
exactly the model's with every key and value rounded to the cache's float8 format (saturated), and
nothing else changes: the prompt logprobs equal those of a no-cache forward whose attention rounds
its keys and values, and greedy decoding (through chunked prefill, preemption and prefix hits)
picks that forward's argmax at every step. The accuracy this costs a real model is held to a bound
in tests/model/test_quantized_quality.py."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cli import config_from_args, parse_args
from jaxserve.config import KV_CACHE_DTYPES, CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.kv_cache import bytes_per_page, cache_dtype, num_pages_for, triton_safe_pages
from jaxserve.engine.request import SamplingParams
from jaxserve.models.decoder import Decoder
from jaxserve.models.reference import forward_logits
from jaxserve.tokenizer import load_tokenizer
from jaxserve.weights import load_model
from engine_requests import run_requests
from tiny_models import make_tiny_model, save_tiny_tokenizer

FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
HLO_NAMES = {"fp8_e4m3": "f8e4m3fn", "fp8_e5m2": "f8e5m2"}
PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18, 40, 41, 42, 43, 44, 45, 46], [1, 42], [1, 9, 8, 7, 6, 5, 4]]
# 13 usable pages of 4 tokens: three sequences of up to 39 tokens cannot all fit, so some are
# preempted and recomputed; prefills come in chunks of 16 tokens. One decode bucket: which bucket
# pads a batch changes no token.
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=14),
    scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_seqs=2, max_model_len=48,
                              decode_buckets=(2,)),
)


def test_names_map_to_dtypes_and_fp8_halves_a_page():
    assert cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert cache_dtype("auto", jnp.float32) == jnp.float32
    assert cache_dtype("fp8", jnp.bfloat16) == cache_dtype("fp8_e4m3", jnp.float32) == jnp.float8_e4m3fn
    assert cache_dtype("fp8_e5m2", jnp.bfloat16) == jnp.float8_e5m2
    assert cache_dtype("bfloat16", jnp.float32) == jnp.bfloat16
    for name in ("int8", "float32"):  # nothing wider than the model's
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, fp8"):
            cache_dtype(name, jnp.bfloat16)
    cfg = load_cfg()
    assert bytes_per_page(cfg, 16, jnp.float8_e4m3fn) * 2 == bytes_per_page(cfg, 16, jnp.bfloat16)
    budget = CacheConfig(cpu_kv_cache_bytes=2**26)
    cpu = jax.devices("cpu")[0]
    assert num_pages_for(budget, cfg, jnp.float8_e5m2, cpu) == 2 * num_pages_for(budget, cfg, jnp.bfloat16, cpu)


def test_the_flag_reaches_the_cache_config():
    for name in KV_CACHE_DTYPES:
        assert config_from_args(parse_args(["--kv-cache-dtype", name])).cache.kv_cache_dtype == name
    assert config_from_args(parse_args([])).cache.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):  # argparse refuses it, naming the flag and its choices
        parse_args(["--kv-cache-dtype", "int4"])


def test_gpu_8bit_arrays_stay_out_of_the_offset_wrap():
    """For the GPU kernels an 8-bit K or V array of 2-4 GiB (per device) is cut to 2 GiB
    (tests/gpu_lowering shows why); a draft model's cache counts too. Under 2 GiB or over 4 GiB the
    pages stay as many as fit."""
    mib = 2**20
    assert triton_safe_pages(1000, [mib]) == 1000  # 1000 MiB
    assert triton_safe_pages(3000, [mib]) == 2048  # 3000 MiB: cut to 2 GiB
    assert triton_safe_pages(4096, [mib]) == 2048  # exactly 4 GiB still wraps
    assert triton_safe_pages(4097, [mib]) == 4097  # over 4 GiB: 64-bit offsets
    # A draft's 2.4 GiB array: cutting it to 2 GiB would leave the target's at exactly 4 GiB, so both go.
    assert triton_safe_pages(5000, [mib, 0.5 * mib]) == 2048
    assert triton_safe_pages(5000, [mib, 0.1 * mib]) == 5000


def test_e4m3_is_refused_on_gpus_triton_cannot_convert_it():
    from types import SimpleNamespace

    from jaxserve.engine.kv_cache import check_cache_dtype

    a100 = SimpleNamespace(compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    h100 = SimpleNamespace(compute_capability="9.0", device_kind="NVIDIA H100 80GB HBM3")
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*A100.*fp8_e5m2"):
        check_cache_dtype(jnp.float8_e4m3fn, "pallas_gpu", a100)
    check_cache_dtype(jnp.float8_e5m2, "pallas_gpu", a100)
    check_cache_dtype(jnp.float8_e4m3fn, "reference", a100)  # XLA converts it itself
    check_cache_dtype(jnp.float8_e4m3fn, "pallas_gpu", h100)
    check_cache_dtype(jnp.float8_e4m3fn, "cpu", jax.devices("cpu")[0])


def test_start_up_warns_of_an_8bit_cache_only_where_it_is_slow(caplog):
    """The reference attention on the CPU copies an 8-bit cache around every layer's write (measured
    1.8-3.4x slower steps); the native backend writes it in place, and a GPU converts it itself."""
    from types import SimpleNamespace

    from jaxserve.engine.kv_cache import check_cache_dtype

    cpu = jax.devices("cpu")[0]
    with caplog.at_level("WARNING", logger="jaxserve.engine"):
        check_cache_dtype(jnp.float8_e4m3fn, "cpu", cpu)
        check_cache_dtype(jnp.bfloat16, "reference", cpu)
        check_cache_dtype(jnp.float8_e5m2, "reference", SimpleNamespace(platform="gpu", compute_capability="9.0"))
        assert not caplog.records
        check_cache_dtype(jnp.float8_e5m2, "reference", cpu)
    assert "float8_e5m2 with --attention-backend reference on the CPU" in caplog.text


def load_cfg():
    from jaxserve.models.config import decoder_config_from_hf

    return decoder_config_from_hf(dict(
        architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512))  # fmt: skip


def rounded_log_probs(model: Decoder, tokens: list[int], dtype: Any) -> np.ndarray:
    """[len(tokens), vocab] next-token log-probabilities of the forward with rounded keys and values."""
    return np.asarray(jax.nn.log_softmax(forward_logits(model, jnp.asarray(tokens), dtype), axis=-1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    make_tiny_model("llama3", path)
    save_tiny_tokenizer(path)
    return load_model(path, "float32", use_cache=False).model, load_tokenizer(path)


# Each format once, through the native CPU kernel and through the pure-jnp reference (the kernels
# of every backend are compared on an 8-bit cache in tests/kernels).
@pytest.mark.parametrize("name, backend", [("fp8_e4m3", "cpu"), ("fp8_e5m2", "reference")])
def test_engine_equals_the_model_with_rounded_keys_and_values(tiny, name, backend):
    model, tokenizer = tiny
    config = dataclasses.replace(CONFIG, cache=dataclasses.replace(CONFIG.cache, kv_cache_dtype=name),
                                 attention_backend=backend)
    engine = build_engine(model, tokenizer, config)
    assert engine.runner.kv.k.dtype == FP8[name]
    # No step holds a widened copy of the cache: XLA:CPU has no float8 scatter or gather, and left
    # to itself it converted the whole cache to float16 around every layer's write and read (35x
    # slower decode steps). Only the cache's own bytes (float8, or uint8 bitcasts) have its shape.
    shape = ",".join(map(str, engine.runner.kv.k.shape))
    for key, compiled in engine.runner.compiled_steps.items():
        hlo = compiled.as_text()
        kinds = set(re.findall(rf"(\w+)\[{shape}\]", hlo))
        assert kinds and kinds <= {HLO_NAMES[name], "u8"}, (key, kinds)
        if backend == "cpu":
            # The native backend writes the cache in place (an aliased custom call) and reads it
            # as stored: nothing makes a cache-sized array at all. Scattering the cache's bytes
            # instead made XLA:CPU bitcast-copy the whole cache twice per layer (30x slower steps).
            made = set(re.findall(rf"= \w+\[{shape}\]\S* ([\w-]+)\(", hlo))
            assert made <= {"parameter", "custom-call", "get-tuple-element"}, (key, made)
    for round_ in range(2):
        # Prompt logprobs need every prompt token computed; the second round, without them, reads
        # its prompts' full pages from the prefix cache.
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1 - round_ or None)
        results = run_requests(engine, PROMPTS, params, str(round_))
        for result, prompt in zip(results, PROMPTS):
            out = result.outputs[0].token_ids
            expected = rounded_log_probs(model, prompt + out, FP8[name])
            # Prompt logprobs: the rounded forward's, to float32 summation order.
            lps = result.prompt_logprobs or [None] * len(prompt)
            for i in range(1, len(prompt) if round_ == 0 else 0):
                np.testing.assert_allclose(lps[i].logprob, expected[i - 1, prompt[i]], atol=2e-4)
            # Greedy decoding: the rounded forward's argmax after the prompt and every output token.
            assert out == list(np.argmax(expected[len(prompt) - 1 : -1], axis=-1))
    assert engine.num_preemptions > 0
    assert results[0].num_cached_tokens > 0  # the second round's first prompt
    # The rounding is real: a float32 cache answers differently somewhere.
    exact = rounded_log_probs(model, PROMPTS[0], jnp.float32)
    assert not np.allclose(exact, rounded_log_probs(model, PROMPTS[0], FP8[name]), atol=1e-3)
