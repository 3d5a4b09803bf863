"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) beyond the shared architecture tests (which
check HF parity in float32 and bfloat16 and the paged engine for the tiny ones): the Hub's config
layouts, the CPU's grouped product against a dense reference, GGUF files (stacked and per-expert
tensors, llama.cpp's routing settings), and the refusals of what the experts do not support."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jaxserve.models.config import MoeConfig, UnsupportedModelError, decoder_config_from_hf
from jaxserve.models.moe import _chunk_rows, _grouped_loop, grouped_matmul, route
from jaxserve.weights import load_model
from jaxserve.weights.safetensors_dir import WeightsError
from tiny_gguf import write_gguf
from tiny_models import dense_logits, make_tiny_model

PROMPTS = [[1, 17, 99, 5, 200, 33, 7, 250, 12, 64, 3, 18], [1, 42]]

# The Hub's config.json files, as published (keys that do not matter here left out).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1, "head_dim": 128, "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "vocab_size": 151936, "torch_dtype": "bfloat16",
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
}
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_size": 2048, "intermediate_size": 5632,
    "max_position_embeddings": 8192, "moe_intermediate_size": 1408, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 16, "shared_expert_intermediate_size": 5632, "vocab_size": 151936,
    "use_sliding_window": False, "max_window_layers": 21, "sliding_window": 32768, "tie_word_embeddings": False,
}


def test_hub_configs():
    qwen3 = decoder_config_from_hf(QWEN3_30B_A3B)
    assert qwen3.moe == MoeConfig(128, 8, 768, True, 0, (True,) * 48)
    assert qwen3.qk_norm and not qwen3.qkv_bias
    mixtral = decoder_config_from_hf(MIXTRAL_8X7B)
    assert mixtral.moe == MoeConfig(8, 2, 14336, True, 0, (True,) * 32)
    assert mixtral.windows() == (0,) * 32
    qwen2 = decoder_config_from_hf(QWEN15_MOE_A27B)
    assert qwen2.moe == MoeConfig(60, 4, 1408, False, 5632, (True,) * 24)
    assert qwen2.qkv_bias and qwen2.windows() == (0,) * 24
    # Qwen's dense layers: off the decoder_sparse_step grid, or named in mlp_only_layers.
    stepped = decoder_config_from_hf({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                      "mlp_only_layers": [3]})
    assert stepped.moe.sparse_layers == (False, True, False, False, False, True)
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        decoder_config_from_hf({**MIXTRAL_8X7B, "num_experts_per_tok": 9})


def test_route_picks_and_renormalises_the_top_k():
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.0]])
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    weights, ids = route(logits, 2, normalize=False)
    assert np.asarray(ids).tolist() == [[1, 2], [0, 3]]
    np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(probs, np.asarray(ids), 1), rtol=1e-6)
    weights, _ = route(logits, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("counts", [[5, 0, 3, 0, 0, 9, 1, 2], [0, 0, 0, 20, 0, 0, 0, 0], [1] * 8, [0] * 7 + [70]])
def test_cpu_grouped_product_equals_dense(counts):
    """The CPU loop (chunks of one expert's rows, only as many as there are) against each row
    times its expert's kernel, for empty experts, one expert taking every row, rows spanning
    several chunks and chunks that end past their expert's rows."""
    rng = np.random.default_rng(0)
    rows, experts = sum(counts), len(counts)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    w = rng.standard_normal((experts, 16, 12)).astype(np.float32)
    expert_of = np.repeat(np.arange(experts), counts)
    want = np.einsum("rk,rkn->rn", x, w[expert_of])
    got = jax.jit(_grouped_loop)(jnp.asarray(x), jnp.asarray(counts, jnp.int32), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # grouped_matmul picks the loop on this platform.
    np.testing.assert_allclose(np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(counts, jnp.int32),
                                                         jnp.asarray(w))), want, rtol=1e-5, atol=1e-5)
    assert _chunk_rows(rows, experts) in (4, 8, 16, 32, 64)


def test_ragged_dot_lowers_for_gpus_and_tpus_and_the_loop_for_cpus():
    """One traced function, lowered per platform: XLA's ragged dot on GPUs and TPUs, the loop on
    the CPU (whose ragged dot is a dense product over every expert)."""
    x = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    counts = jax.ShapeDtypeStruct((8,), jnp.int32)
    w = jax.ShapeDtypeStruct((8, 32, 16), jnp.bfloat16)
    lowered = jax.jit(grouped_matmul).trace(x, counts, w)
    tpu = lowered.lower(lowering_platforms=("tpu",)).as_text()
    cpu = lowered.lower(lowering_platforms=("cpu",)).as_text()
    assert "ragged_dot" in tpu and "while" not in tpu
    assert "while" in cpu and "ragged_dot" not in cpu


GGUF_ARCH = {"mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe"}


def _tiny(name: str, directory, **extra):
    return make_tiny_model(name, directory, seed=2, **extra)


def _assert_hf_logits(decoder, hf) -> None:
    ours = dense_logits(decoder, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float().numpy()
        np.testing.assert_allclose(ours[i, : len(prompt)], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name, per_expert", [("mixtral", False), ("mixtral", True), ("qwen2-moe", False),
                                              ("qwen3-moe", False)])
def test_gguf_logits_match_hf(tmp_path, name, per_expert):
    """llama.cpp's MoE files: experts stacked (ffn_gate_exps) or, in older Mixtral files, one
    tensor per expert (ffn_gate.E); Mixtral's q/k rows interleaved as any llama file's; Qwen3-MoE
    renormalises its top-k weights and Qwen2-MoE does not, as llama.cpp runs them. llama.cpp has
    no dense layers in a Qwen MoE, so the checkpoint here has none either."""
    hf = _tiny(name, tmp_path / "hf", **({"mlp_only_layers": []} if name == "qwen3-moe" else {}))
    path = tmp_path / "model.gguf"
    write_gguf(path, tmp_path / "hf", hf.config, GGUF_ARCH[name], per_expert=per_expert)
    loaded = load_model(path, "float32", use_cache=False)
    assert loaded.model.cfg.architecture == hf.config.architectures[0]
    assert loaded.model.cfg.moe.norm_topk_prob == (name != "qwen2-moe")
    _assert_hf_logits(loaded.model, hf)


def test_quantized_gguf_experts_run_dequantized_under_auto_and_are_refused_under_gguf(tmp_path, caplog):
    """A Q8_0 file: --quantization auto keeps the attention's blocks and runs the experts
    dequantized (said in a warning); --quantization gguf, which promises the file's blocks, refuses."""
    from jaxserve.models import products

    hf = _tiny("qwen3-moe", tmp_path / "hf", mlp_only_layers=[])
    path = tmp_path / "model.gguf"
    from gguf import GGMLQuantizationType as Q

    write_gguf(path, tmp_path / "hf", hf.config, "qwen3moe", qtype=Q.Q8_0)
    with pytest.raises(WeightsError, match="experts .* have no block-quantized product"):
        load_model(path, "bfloat16", use_cache=False, keep_blocks="strict")
    with caplog.at_level("WARNING", logger="jaxserve.weights"):
        loaded = load_model(path, "bfloat16", use_cache=False, keep_blocks="auto")
    assert "expert tensors (blk.0.ffn_" in caplog.text and "run dequantized to bfloat16" in caplog.text
    assert loaded.blocks is not None
    assert loaded.blocks(("layers", 0, "self_attn", "q_proj", "kernel")) is not None
    experts = loaded.model.layers[0].mlp.experts.gate_proj.kernel[...]
    assert experts.dtype == jnp.bfloat16 and experts.shape == (8, 64, 32)
    products.check_quantization_for(loaded.model.cfg, "gguf")  # auto's blocks are fine


def test_refusals(tmp_path):
    from jaxserve.models import products
    from jaxserve.models.lora import target_shapes

    make_tiny_model("mixtral", tmp_path)
    model = load_model(tmp_path, "float32", use_cache=False).model
    with pytest.raises(ValueError, match="--quantization int4 is not supported for MixtralForCausalLM"):
        products.check_quantization_for(model.cfg, "int4")
    products.check_quantization_for(model.cfg, "int8")
    with pytest.raises(ValueError, match="LoRA adapters are not supported for MixtralForCausalLM"):
        target_shapes(model)


def test_int8_experts_in_the_engine(tmp_path):
    """--quantization int8 quantizes the experts too (per expert and output channel): the engine's
    greedy tokens equal the no-cache reference on the same quantized weights, whose logits stay
    near the float model's."""
    from flax import nnx

    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.engine.build import EngineConfig, build_engine
    from jaxserve.engine.core import run_to_completion
    from jaxserve.engine.request import SamplingParams
    from jaxserve.models import products
    from jaxserve.models.reference import greedy_reference
    from jaxserve.tokenizer import load_tokenizer
    from tiny_models import save_tiny_tokenizer

    make_tiny_model("qwen3-moe", tmp_path)
    save_tiny_tokenizer(tmp_path)
    model = load_model(tmp_path, "float32", use_cache=False).model
    graphdef, state = nnx.split(model)
    placed = nnx.merge(graphdef, products.place(state, "xla", model.head_path, quantization="int8"))
    experts = placed.layers[0].mlp.experts.down_proj.kernel.get_value()
    assert isinstance(experts, products.ExpertInt8Weight) and experts.q.dtype == jnp.int8
    assert experts.scale.shape == (8, 64)
    float_logits, int8_logits = dense_logits(model, PROMPTS), dense_logits(placed, PROMPTS)
    # Near on average; a token whose router sees a near tie may pick another expert (as a dense
    # model's int8 logits drift, a routed one's jump there), so not bounded at every position.
    assert np.abs(int8_logits - float_logits).mean() < 0.02 * np.abs(float_logits).max()
    assert (int8_logits.argmax(-1) == float_logits.argmax(-1)).mean() >= 0.9
    expected = greedy_reference(placed, PROMPTS, 12)
    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=32), quantization="int8",
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_seqs=2,
                                                    max_model_len=48, decode_buckets=(2,)))
    engine = build_engine(model, load_tokenizer(tmp_path), config)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    results = run_to_completion(engine, [str(i) for i in range(len(PROMPTS))])
    assert [results[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == expected


def test_a_missing_expert_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_tiny_model("qwen2-moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.4.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight is missing"):
        load_model(tmp_path, "float32", use_cache=False)
