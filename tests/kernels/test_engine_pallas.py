"""The engine on the Pallas attention backends equals the reference backend, token for token.

On the CPU the kernels run interpreted (the GPU flavour by the generic Pallas interpreter, the TPU
flavour in TPU interpret mode with out-of-bounds reads raising), over the engine's stacked
[layers, kv_heads, pages, page_size, head_dim] cache with the layer index of the decoder's loop.
The workload crosses chunked prefill (a 19-token prompt through a 16-token budget), prefix-cache
hits (a second round of the same prompts), decode buckets (the decode kernel) and prefill buckets
(the ragged kernel); the models cover GQA ratios 2 and 4, soft-capping and sliding windows longer
than a page. Tiny shapes, few tokens: interpretation is slow.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import pytest

import pallas_kernels
from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine import attention
from jaxserve.engine.build import EngineConfig, build_engine
from jaxserve.engine.core import Engine, run_to_completion
from jaxserve.engine.request import SamplingParams
from jaxserve.tokenizer import load_tokenizer
from jaxserve.weights import load_model
from tiny_models import make_tiny_model, save_tiny_tokenizer

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18, 40, 41, 42, 43, 44, 45, 46], [1, 42, 7], [1, 9, 8, 7, 6]]
MAX_TOKENS = 8
CONFIG = EngineConfig(
    cache=CacheConfig(page_size=4, num_pages=32),
    scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_seqs=2, max_model_len=32,
                              decode_buckets=(2,), prefill_buckets=(16,)),
)

# llama3: GQA 4:2, no window; gemma2: soft-cap 5 and a 5-token window on alternate layers; mistral:
# GQA 4:1 with a window on every layer.
CASES = [("llama3", "pallas_gpu"), ("gemma2", "pallas_gpu"), ("mistral", "pallas_gpu"), ("gemma2", "pallas_tpu"),
         ("llama3", "cpu"), ("gemma2", "cpu"), ("mistral", "cpu")]  # cpu: the native kernel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (model, tokenizer), built once per model."""
    built = {}

    def get(name):
        if name not in built:
            directory = tmp_path_factory.mktemp(name)
            make_tiny_model(name, directory)
            save_tiny_tokenizer(directory)
            built[name] = (load_model(directory, "float32", use_cache=False).model, load_tokenizer(directory))
        return built[name]

    return get


def cache_copies(engine: Engine) -> list[str]:
    """Instructions of the compiled steps that copy a whole K or V cache: there must be none, or every
    layer of every step would pay for copying the cache (the point of passing the layer index)."""
    k = engine.runner.kv.k
    shape = re.escape(f"{jnp.dtype(k.dtype).name.replace('float', 'f')}[{','.join(map(str, k.shape))}]")
    pattern = re.compile(rf"= {shape}\{{[^}}]*\}} copy(-start)?\(")
    return [line.strip()[:200] for exe in engine.runner.compiled_steps.values() for line in exe.as_text().splitlines()
            if pattern.search(line)]


def generate(model, tokenizer, backend: str) -> list[list[list[int]]]:
    """Greedy outputs of two rounds of PROMPTS (the second hits the prefix cache)."""
    engine = build_engine(model, tokenizer, dataclasses.replace(CONFIG, attention_backend=backend))
    if not attention.is_interpreted(backend):  # the Pallas interpreter itself copies its inputs
        assert cache_copies(engine) == []
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rounds = []
    for round_ in range(2):
        ids = [f"{round_}-{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS):
            engine.add_request(rid, prompt, params)
        results = run_to_completion(engine, ids)
        rounds.append([results[rid].outputs[0].token_ids for rid in ids])
        engine.check_idle_integrity()
    assert results["1-0"].num_cached_tokens > 0, "the second round should hit the prefix cache"
    return rounds


@pytest.fixture(scope="module")
def reference_outputs(tiny):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = generate(*tiny(name), "reference")
        return cache[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name,backend", CASES)
def test_engine_pallas_backend_equals_reference(name, backend, tiny, reference_outputs, monkeypatch):
    kernels_used = set()
    getters = ((pallas_kernels.get_decode_attention, "decode"), (pallas_kernels.get_ragged_attention, "ragged"))
    for getter, kind in getters:
        def spy(b, getter=getter, kind=kind):
            kernels_used.add((kind, b))
            return getter(b)

        monkeypatch.setattr(pallas_kernels, getter.__name__, spy)
    try:
        outputs = generate(*tiny(name), backend)
    finally:
        if backend == "pallas_tpu":
            from jax.experimental.pallas import tpu as pltpu

            pltpu.reset_tpu_interpret_mode_state()
    assert {("decode", backend), ("ragged", backend)} <= kernels_used
    assert outputs == reference_outputs(name)
    assert all(len(ids) == MAX_TOKENS for round_ in outputs for ids in round_)


def test_resolve_backend():
    assert attention.resolve_backend("auto", "cpu") == "cpu"  # the native kernel: this machine has g++
    assert attention.resolve_backend("auto", "cpu", tensor_parallel=2) == "reference"  # the kernel does not shard
    assert attention.resolve_backend("auto", "gpu") == "pallas_gpu"  # checked and timed on an H100
    assert attention.resolve_backend("auto") == "cpu"  # this (CPU) machine
    assert attention.resolve_backend("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match="CPU only"):
        attention.resolve_backend("cpu", "gpu")
    with pytest.raises(ValueError, match="does not shard"):
        attention.resolve_backend("cpu", "cpu", tensor_parallel=2)
    assert "native" in attention.describe_backend("cpu", "cpu")
    assert attention.resolve_backend("auto", "tpu") == "pallas_tpu"
    assert attention.resolve_backend("pallas", "gpu") == "pallas_gpu"
    assert attention.resolve_backend("pallas", "tpu") == "pallas_tpu"
    assert attention.resolve_backend("pallas", "cpu") == "pallas_gpu"  # interpreted
    assert attention.resolve_backend("pallas_tpu", "cpu") == "pallas_tpu"
    assert attention.is_interpreted("pallas_gpu", "cpu") and not attention.is_interpreted("pallas_gpu", "gpu")
    assert not attention.is_interpreted("reference", "cpu")
    assert "interpret mode" in attention.describe_backend("pallas_gpu", "cpu")
    with pytest.raises(ValueError, match="attention backend"):
        attention.resolve_backend("cuda", "gpu")


def test_cli_accepts_pallas_backend(tmp_path):
    from jaxserve.cli import build_parser, config_from_args, parse_args

    help_text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    assert "interpret mode" in help_text and "auto = the Pallas kernels on GPUs" in help_text
    for choice in attention.CHOICES:
        config = config_from_args(parse_args(["--model", str(tmp_path), "--attention-backend", choice]))
        assert config.attention_backend == choice
    assert config_from_args(parse_args(["--model", str(tmp_path)])).attention_backend == "auto"


@pytest.mark.parametrize("decode", [True, False], ids=["decode-step", "ragged-step"])
def test_paged_attention_takes_the_kernel_of_its_step(decode, monkeypatch):
    """A decode step (one token per sequence) runs the decode kernel, any other step the ragged one
    (here a step shaped like decode, tokens == seqs, that is not); both must equal the reference
    (and write the same K/V)."""
    import jax
    import numpy as np

    from jaxserve.engine.kv_cache import KVCache

    q_lens = [1, 1, 1] if decode else [1, 2, 0]
    rng = np.random.default_rng(0)
    layers, kv_heads, q_heads, pages, page, dim, seqs = 2, 2, 4, 13, 4, 16, 4  # seqs: 3 live + 1 padding
    kv_lens = np.array([5, 9, 3, 0], np.int32)
    tables = rng.permutation(np.arange(1, pages)).reshape(seqs, 3).astype(np.int32)  # shuffled
    cu = np.concatenate([[0], np.cumsum(q_lens + [0])]).astype(np.int32)
    slots = np.full(seqs, -1, np.int32)
    for b, n in enumerate(q_lens):
        for i in range(n):
            pos = kv_lens[b] - n + i
            slots[cu[b] + i] = tables[b, pos // page] * page + pos % page
    cache = KVCache(*(jnp.asarray(rng.standard_normal((layers, kv_heads, pages, page, dim)), jnp.float32)
                      for _ in range(2)))
    q = jnp.asarray(rng.standard_normal((1, seqs, q_heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, seqs, kv_heads, dim)), jnp.float32) for _ in range(2))

    def run(backend):
        attend = attention.paged_attention(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(cu),
                                           jnp.asarray(kv_lens), jnp.int32(3), scale=0.25, softcap=None,
                                           backend=backend, decode=decode)
        return jax.jit(lambda c: attend(q, k, v, c, jnp.int32(0), jnp.int32(1)))(cache)

    (ref_out, ref_cache), (out, new_cache) = run("reference"), run("pallas_gpu")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(new_cache.k), np.asarray(ref_cache.k))
    np.testing.assert_array_equal(np.asarray(out)[0, sum(q_lens):], 0.0)  # padding rows

    # Which kernel ran: a marked stand-in for the decode kernel shows up only in the decode step.
    marker = lambda q, *args, **kwargs: jnp.full_like(q, 7.0)  # noqa: E731
    monkeypatch.setattr(pallas_kernels, "get_decode_attention", lambda backend: marker)
    marked = np.asarray(run("pallas_gpu")[0])
    assert (marked == 7.0).all() if decode else not (marked == 7.0).any()


def test_a_one_sequence_decode_padded_to_two_rows_attends_both_in_the_gpu_kernel(monkeypatch):
    """On a GPU a one-sequence decode step has two token rows (runner.min_product_rows). The GPU
    decode kernel takes both, the padding row with length 0 (zeros out), and sizes its splits for the
    one sequence (`live_rows`): padding the kernel's output instead was a kernel per layer per
    decode iteration. The result equals the reference's, which attends the real row only."""
    import jax
    import numpy as np

    from jaxserve.engine.kv_cache import KVCache

    rng = np.random.default_rng(1)
    layers, kv_heads, q_heads, pages, page, dim = 2, 2, 4, 9, 4, 16
    tables = np.array([[5, 2, 7]], np.int32)
    kv_len = 10
    slots = np.array([tables[0, (kv_len - 1) // page] * page + (kv_len - 1) % page, -1], np.int32)
    cache = KVCache(*(jnp.asarray(rng.standard_normal((layers, kv_heads, pages, page, dim)), jnp.float32)
                      for _ in range(2)))
    q = jnp.asarray(rng.standard_normal((1, 2, q_heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 2, kv_heads, dim)), jnp.float32) for _ in range(2))
    calls = []
    real = pallas_kernels.get_decode_attention

    def recording(backend):
        kernel = real(backend)
        return lambda q, *args, **kwargs: (calls.append((backend, q.shape, kwargs.get("live_rows"))),
                                           kernel(q, *args, **kwargs))[1]

    monkeypatch.setattr(pallas_kernels, "get_decode_attention", recording)

    def run(backend):
        attend = attention.paged_attention(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray([0, 1], jnp.int32),
                                           jnp.asarray([kv_len], jnp.int32), jnp.int32(1), scale=0.25, softcap=None,
                                           backend=backend, decode=True)
        return jax.jit(lambda c: attend(q, k, v, c, jnp.int32(0), jnp.int32(1)))(cache)

    (ref_out, ref_cache), (out, new_cache) = run("reference"), run("pallas_gpu")
    assert calls == [("reference", (1, q_heads, dim), None), ("pallas_gpu", (2, q_heads, dim), 1)]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(out)[0, 1], 0.0)  # the padding row
    np.testing.assert_array_equal(np.asarray(new_cache.v), np.asarray(ref_cache.v))
