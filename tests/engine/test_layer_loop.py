"""--layer-loop unrolled: the weights move into one buffer per layer, the model computes the same
logits, the engine the same greedy tokens, and the step no longer copies a layer's weights."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.engine import Engine, EngineConfig, resolve_layer_loop, run_to_completion
from jaxserve.engine.request import SamplingParams
from jaxserve.tokenizer import load_tokenizer
from jaxserve.weights import load_model
from tiny_models import make_tiny_model, save_tiny_tokenizer

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18, 40], [1, 42], [1, 9, 8, 7, 6, 5, 4]]
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=14),  # forces preemption, as in test_engine_tiny
    scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_seqs=2, max_model_len=48),
)


def _tiny(name, directory, **overrides):
    make_tiny_model(name, directory)
    if overrides:
        config = json.loads((directory / "config.json").read_text())
        config.update(overrides)
        (directory / "config.json").write_text(json.dumps(config))
    save_tiny_tokenizer(directory)
    return load_model(directory, "float32", use_cache=False, load_format="dummy" if overrides else "auto").model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "gemma2"])  # gemma2: sliding windows per layer, sandwich norms
def test_unstacked_model_and_engine_match_the_scan(name, tmp_path):
    model = _tiny(name, tmp_path)
    tokens = jnp.asarray([[1, 17, 99, 5, 200, 33, 7, 250]], jnp.int32)
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    stacked_logits = np.asarray(model(tokens, positions, jnp.asarray([8])))
    tokenizer = load_tokenizer(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def greedy(engine):
        engine.compile()
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, params)
        results = run_to_completion(engine, [str(i) for i in range(len(PROMPTS))])
        return [results[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]

    scan = greedy(Engine(model, tokenizer, CONFIG))
    assert not model.unstacked
    unrolled_engine = Engine(model, tokenizer, EngineConfig(**{**CONFIG.__dict__, "layer_loop": "unrolled"}))
    assert model.unstacked and len(model.layer_list) == model.cfg.num_layers
    np.testing.assert_allclose(np.asarray(model(tokens, positions, jnp.asarray([8]))), stacked_logits,
                               rtol=1e-5, atol=1e-5)
    assert greedy(unrolled_engine) == scan
    assert unrolled_engine.num_preemptions > 0


@pytest.mark.slow
def test_unrolled_step_reads_each_layer_in_place(tmp_path):
    # Layers big enough that one layer's weights (3 x 128 x 2048 floats = 3 MiB) dwarf the rest.
    model = _tiny("llama3", tmp_path, hidden_size=128, intermediate_size=2048)
    layer_bytes = 3 * 128 * 2048 * 4
    tokenizer = load_tokenizer(tmp_path)
    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=14),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16, max_prefill_seqs=1,
                                                    max_model_len=48, decode_buckets=(1,), prefill_buckets=(16,)))

    def decode_scratch(engine):
        engine.compile()
        return max(c.memory_analysis().temp_size_in_bytes for b, c in engine.runner._compiled.items()
                   if b.kind == "decode")

    assert decode_scratch(Engine(model, tokenizer, config)) >= layer_bytes  # the scan copies a layer out
    unrolled = Engine(model, tokenizer, EngineConfig(**{**config.__dict__, "layer_loop": "unrolled"}))
    assert decode_scratch(unrolled) < layer_bytes / 4


def test_layer_loop_choice():
    assert resolve_layer_loop("auto", "gpu") == "scan"  # until unrolling is timed on a GPU
    assert resolve_layer_loop("auto", "cpu") == "scan"
    assert resolve_layer_loop("unrolled", "cpu") == "unrolled"
    with pytest.raises(ValueError, match="--layer-loop must be one of auto, scan, unrolled"):
        resolve_layer_loop("loop")
