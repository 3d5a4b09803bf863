"""What makes a step fast, checked on the CPU's compiled steps: every weight read in place and the
KV cache and device batch updated in place.

XLA:CPU (like XLA:GPU) copied each layer's weights out of the old stacked weights in the layer scan:
a decode step's scratch was one layer's weights (14.2 MB in SmolLM2's, 1.6 MB with one buffer per
layer). Here the layers are big (3 MiB of weights each in float32) and everything else small, so
any weight-sized temporary stands out: the scratch of every step must stay below 5% of one
layer's weights plus its own activations (a few [tokens, intermediate] and [rows, vocab] float32
arrays at once: 0.6 MiB for the 16-token prefill, a fifth of a layer). The TPU steps have the same checks
through the real TPU compiler (tests/tpu_aot).
"""

from __future__ import annotations

import json

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.tokenizer import load_tokenizer
from jaxserve.weights import load_model
from tiny_models import make_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.slow

HIDDEN, INTERMEDIATE = 128, 2048


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("big-layers")
    make_tiny_model("llama3", directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)
    (directory / "config.json").write_text(json.dumps(config))
    save_tiny_tokenizer(directory)
    model = load_model(directory, "float32", use_cache=False, load_format="dummy").model
    return build_engine(model, load_tokenizer(directory), EngineConfig(
        cache=CacheConfig(page_size=4, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_seqs=2, max_model_len=48,
                                  decode_buckets=(1, 4), prefill_buckets=(16,), decode_steps=4)))


def test_no_step_copies_a_weight(engine):
    cfg = engine.runner.cfg
    layer_bytes = 3 * HIDDEN * INTERMEDIATE * 4  # the MLP alone: 3 MiB
    for key, compiled in engine.runner.compiled_steps.items():
        tokens = key[1]
        activations = 4 * tokens * (INTERMEDIATE + cfg.vocab_size) * 4
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp < 0.05 * layer_bytes + activations, (key, temp, layer_bytes)


def test_the_cache_and_the_device_batch_are_updated_in_place(engine):
    import jax

    runner = engine.runner
    state = sum(a.nbytes for a in jax.tree_util.tree_leaves((runner.kv, runner.batch)))
    for key, compiled in runner.compiled_steps.items():
        assert compiled.memory_analysis().alias_size_in_bytes >= state, key
