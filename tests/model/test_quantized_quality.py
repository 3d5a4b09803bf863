"""--quantization int8 on SmolLM2 (bfloat16): perplexity of a public-domain text (the opening of
Pride and Prejudice, Jane Austen, 1813) within 2% of the unquantized model's, the next-token
argmax agreeing at most positions (reported), and the native CPU kernel's int8 products agreeing
with XLA's dot on the same int8 weights (kernel correctness on a whole model, not quality). The
8-bit KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) is held to the same text: its forward is the
model's with keys and values rounded (`reference.RoundedKV`; the engine equals it,
tests/engine/test_kv_cache_dtype.py)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from smollm2 import smollm2_gguf

from jaxserve.models import products
from jaxserve.models.reference import forward_logits
from jaxserve.weights import load_model

TEXT = (Path(__file__).parents[1] / "data" / "pride_and_prejudice_ch1.txt").read_text()


@pytest.fixture(scope="module")
def model_and_tokens(cache_dir, smollm2_tokenizer):
    model = load_model(smollm2_gguf(), "bfloat16", cache_dir=cache_dir).model
    tokens = smollm2_tokenizer.encode_prompt(TEXT)
    assert 400 <= len(tokens) <= 600
    return model, np.asarray(tokens, np.int32)


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    t = len(tokens)
    return np.asarray(jax.jit(lambda m, x: m(x[None], jnp.arange(t)[None], jnp.array([t])))(model, tokens)[0],
                      np.float32)


def _nll(logits: np.ndarray, tokens: np.ndarray) -> float:
    """Mean negative log-likelihood of tokens[1:] given their prefixes."""
    x = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return float(np.mean(lse - x[np.arange(len(x)), tokens[1:]]))


def _placed(model, backend: str, quantization: str):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, products.place(state, backend, model.head_path, quantization=quantization))


def test_int8_perplexity_within_2_percent(model_and_tokens, capsys):
    model, tokens = model_and_tokens
    base = _logits(model, tokens)
    int8 = _logits(_placed(model, "xla", "int8"), tokens)
    ppl_base, ppl_int8 = np.exp(_nll(base, tokens)), np.exp(_nll(int8, tokens))
    agree = float(np.mean(base[:-1].argmax(-1) == int8[:-1].argmax(-1)))
    with capsys.disabled():
        print(f"\nSmolLM2 bf16 perplexity {ppl_base:.3f}, int8 {ppl_int8:.3f} "
              f"({100 * (ppl_int8 / ppl_base - 1):+.2f}%), next-token argmax agreement {100 * agree:.1f}% "
              f"over {len(tokens) - 1} positions")
    assert abs(ppl_int8 / ppl_base - 1) <= 0.02
    assert agree >= 0.9


@pytest.mark.parametrize("name, dtype, bound, agreement", [("fp8_e4m3", jnp.float8_e4m3fn, 0.02, 0.93),
                                                             ("fp8_e5m2", jnp.float8_e5m2, 0.04, 0.88)])
def test_8bit_kv_cache_perplexity(model_and_tokens, capsys, name, dtype, bound, agreement):
    """Measured 2026-11-25: bf16 16.288, e4m3 16.463 (+1.1%, argmax 95.5%), e5m2 16.655 (+2.3%,
    91.1%): e4m3's third mantissa bit is worth more here than e5m2's range."""
    model, tokens = model_and_tokens
    forward = jax.jit(forward_logits, static_argnums=2)
    base = np.asarray(forward(model, tokens, None), np.float32)
    rounded = np.asarray(forward(model, tokens, dtype), np.float32)
    ppl_base, ppl = np.exp(_nll(base, tokens)), np.exp(_nll(rounded, tokens))
    agree = float(np.mean(base[:-1].argmax(-1) == rounded[:-1].argmax(-1)))
    with capsys.disabled():
        print(f"\nSmolLM2 bf16 perplexity {ppl_base:.3f}, KV cache {name} {ppl:.3f} "
              f"({100 * (ppl / ppl_base - 1):+.2f}%), next-token argmax agreement {100 * agree:.1f}%")
    assert abs(ppl / ppl_base - 1) <= bound
    assert agree >= agreement


def test_int8_weights_halve_the_bytes(model_and_tokens):
    model, _ = model_and_tokens
    _, state = nnx.split(model)
    placed = products.place(state, "xla", model.head_path, quantization="int8")
    kernels = [x for x in jax.tree.leaves(placed, is_leaf=lambda x: isinstance(x, products.Int8Weight))
               if isinstance(x, products.Int8Weight)]
    assert len(kernels) == 7 * model.cfg.num_layers + 1  # q k v o gate up down per layer, and the tied head
    assert all(k.q.dtype == jnp.int8 and k.scale.dtype == jnp.float32 for k in kernels)


def test_native_int8_products_match_xla(model_and_tokens):
    from pallas_kernels import cpu_matmul

    if not cpu_matmul.available():
        pytest.skip("needs the native CPU kernel (a C++ compiler; AVX512-BF16, or AVX2 with FMA)")
    model, tokens = model_and_tokens
    xla = _logits(_placed(model, "xla", "int8"), tokens[:64])
    native = _logits(_placed(model, "cpu", "int8"), tokens[:64])
    # Same int8 weights and scales; sums in another order, rounded to bfloat16 between layers.
    assert np.mean(xla.argmax(-1) == native.argmax(-1)) >= 0.95
    np.testing.assert_allclose(native, xla, atol=0.35 * np.abs(xla).std(), rtol=0)


def _backend() -> str:
    """What the server runs on this CPU: the native kernels where they build, else XLA's dot."""
    from pallas_kernels import cpu_qmatmul

    return "cpu" if cpu_qmatmul.available() else "xla"


def _perplexity_report(capsys, name: str, base: np.ndarray, other: np.ndarray, tokens: np.ndarray) -> tuple[float, float]:
    ppl_base, ppl = np.exp(_nll(base, tokens)), np.exp(_nll(other, tokens))
    agree = float(np.mean(base[:-1].argmax(-1) == other[:-1].argmax(-1)))
    with capsys.disabled():
        print(f"\nSmolLM2 bf16 perplexity {ppl_base:.3f}, {name} {ppl:.3f} ({100 * (ppl / ppl_base - 1):+.2f}%), "
              f"next-token argmax agreement {100 * agree:.1f}% over {len(tokens) - 1} positions")
    return float(ppl / ppl_base), agree


@pytest.mark.parametrize("group", [32])
def test_int4_perplexity_within_6_percent(model_and_tokens, capsys, group):
    """--quantization int4 (Linear kernels in 4-bit groups, the head int8) against the bf16 model.
    The only SmolLM2 here is the Q4_1 file dequantized, whose weights already sit on a 4-bit grid
    per 32 rows: groups of 32 find that grid again (near lossless), while groups of 64 quantize
    them a second time onto a coarser one (+27% measured, benchmarks.quantization_quality), so
    this bounds the int4 path's error on the server's default group size, not int4 on a bf16
    checkpoint."""
    model, tokens = model_and_tokens
    base = _logits(model, tokens)
    graphdef, state = nnx.split(model)
    int4 = nnx.merge(graphdef, products.place(state, _backend(), model.head_path, quantization="int4", group=group))
    ratio, agree = _perplexity_report(capsys, f"int4 (groups of {group})", base, _logits(int4, tokens), tokens)
    assert abs(ratio - 1) <= 0.06
    assert agree >= 0.8


def test_gguf_blocks_served_as_stored(model_and_tokens, capsys):
    """The file's own Q4_1 / Q8_0 blocks (--quantization auto) through the native kernel: the same
    weights as the dequantized bf16 model up to bf16's rounding of them, so the perplexity agrees
    to within 1% (it is the file's model, not a requantized one)."""
    from jaxserve.weights import resolve
    from jaxserve.weights.loader import stored_blocks

    model, tokens = model_and_tokens
    base = _logits(model, tokens)
    graphdef, state = nnx.split(model)
    blocks = stored_blocks(resolve(smollm2_gguf()), model.head_path)
    kept = nnx.merge(graphdef, products.place(state, _backend(), model.head_path, quantization="gguf", blocks=blocks))
    ratio, agree = _perplexity_report(capsys, "GGUF blocks kept (Q4_1, head Q8_0)", base, _logits(kept, tokens), tokens)
    assert abs(ratio - 1) <= 0.01
    assert agree >= 0.9
