"""Tiny random-init Hugging Face models, one per supported architecture, saved as safetensors.

Every parameter (norms and biases included) is randomised, so a weight that is loaded into the
wrong place or ignored changes the logits and fails the parity tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# name -> (config class, overrides). Sliding windows are tiny so the 3-prompt batch crosses them.
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64,
            ),
            tie_word_embeddings=False,
        ),
    ),
    "llama-mha-tied-bias": (
        "LlamaConfig",
        dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    ),
    # Rows of 256 values: GGUF's K-quant super-blocks fit every weight (tests/tiny_gguf.py).
    "llama-256": (
        "LlamaConfig",
        dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, tie_word_embeddings=True),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=5, num_key_value_heads=1, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    # Sliding layers rotate by their own base; the full layer's RoPE is linearly scaled (as
    # Gemma3 4B-27B's). Layers: sliding, full, sliding.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16, sliding_window=5, query_pre_attn_scalar=24, sliding_window_pattern=2,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1_000_000.0),
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
            ),
        ),
    ),
    # Fused qkv_proj and gate_up_proj (read as slices); half of each head rotated (Phi-4-mini's
    # partial_rotary_factor is 0.75).
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, tie_word_embeddings=False)),
    # LongRoPE switching at 16 tokens: the engine test's prompts start on both sides of it, and
    # the short ones grow past it (recomputed with the long factors, as HF does).
    "phi3-longrope": ("Phi3Config", dict(
        original_max_position_embeddings=16, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
                             short_factor=[1.0 + 0.1 * i for i in range(8)],
                             long_factor=[1.5 + 0.7 * i for i in range(8)]))),
    # Mixtures of experts: every layer sparse (Mixtral, top-k renormalised); Qwen3-MoE with a
    # dense middle layer (mlp_only_layers) and top-3 of 8; Qwen2-MoE's gated shared expert and
    # unnormalised top-k weights.
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(
        head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], tie_word_embeddings=False)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, tie_word_embeddings=True)),
}


def make_tiny_model(name: str, directory: Path, seed: int = 0, **changes: Any) -> transformers.PreTrainedModel:
    """Build, randomise and save (safetensors) the tiny model `name`, its config with `changes`;
    returns the float32 HF model."""
    cls_name, overrides = TINY_CONFIGS[name]
    config = getattr(transformers, cls_name)(**{**_BASE, **overrides, **changes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize_weights(model)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def dense_logits(decoder: Any, prompts: list[list[int]]) -> Any:
    """Our no-cache forward (the reference the engine tests compare with) on right-padded
    `prompts`: numpy float32 logits [len(prompts), longest, vocab]."""
    import jax.numpy as jnp
    import numpy as np

    t = max(map(len, prompts))
    tokens = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape)
    lengths = np.array([len(p) for p in prompts], np.int32)
    return np.asarray(decoder(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(lengths)))


def randomize_weights(model: torch.nn.Module) -> None:
    """Every parameter random: norm scales near 1, biases and matrices around 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def save_tiny_tokenizer(directory: Path, vocab_size: int = 256) -> None:
    """A word-level tokenizer over "w0".."w{n}" (enough for engine tests on the tiny models)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", bos_token="w1").save_pretrained(directory)
