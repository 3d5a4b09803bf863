"""GGUF files written from the tiny HF checkpoints (tiny_models.py) as llama.cpp's converter writes
them: llama's RoPE rows interleaved, Gemma's norms shifted, llama.cpp's tensor names, each 2-D
weight in a chosen type."""

from __future__ import annotations

import math

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from jaxserve.weights.gguf_file import _hf_name
from jaxserve.weights.source import _mixtral_name


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # What llama.cpp's converter does to q/k rows (interleave RoPE halves).
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, hf_dir, config, qtype: Q = Q.F32, types: dict[str, Q] | None = None) -> None:
    """A GGUF as llama.cpp's converter would write it, from a HF llama directory: 2-D weights in
    `qtype`, or in types[gguf name] (e.g. {"blk.0.ffn_up.weight": Q.Q5_0}). The gguf package cannot
    quantize to Q4_K or Q6_K, so those tensors get random super-blocks (random_k_blocks) instead of
    the checkpoint's values: a model the file defines, for comparing two ways of reading it."""
    write_gguf(path, hf_dir, config, "llama", qtype, types)


def _moe_tensors(tensors: dict[str, np.ndarray], per_expert: bool) -> dict[str, np.ndarray]:
    """A mixture of experts' tensors under the names _hf_name gives llama.cpp's: Mixtral's renamed
    as Qwen's (mlp.gate, mlp.experts.E.gate_proj), and each layer's experts stacked [experts,
    out, in] as llama.cpp's converter writes them (ffn_gate_exps), unless `per_expert` (the older
    Mixtral files' blk.N.ffn_gate.E)."""
    out, stacks = {}, {}
    for name, arr in tensors.items():
        name = _mixtral_name(name)
        head, sep, rest = name.partition(".experts.")
        if not sep or per_expert:
            out[name] = arr
            continue
        index, _, proj = rest.partition(".")
        stacks.setdefault(f"{head}.experts.{proj}", {})[int(index)] = arr
    for name, parts in stacks.items():
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def write_gguf(path, hf_dir, config, arch: str, qtype: Q = Q.F32, types: dict[str, Q] | None = None,
               tokens: list[str] | None = None, per_expert: bool = False) -> None:
    """As write_llama_gguf, for GGUF architecture `arch` (llama, gemma2, gemma3 or phi3: its fused
    attn_qkv and gate-and-up ffn_up as HF's Phi3 stores them, its rotated dimensions). Gemma files are
    written as llama.cpp's converter writes them: norms stored as 1 + w, the sliding window,
    soft-caps and the sliding layers' RoPE base in the metadata, q/k rows not interleaved. tokens:
    a vocabulary to store with the config's bos and eos (the weights alone need none)."""
    from safetensors.numpy import load_file

    tensors = _moe_tensors(load_file(hf_dir / "model.safetensors"), per_expert)
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(path, arch)
    rope = config.rope_parameters
    if gemma:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_sliding_window(config.sliding_window)
        pattern = [t == "sliding_attention" for t in config.layer_types]
        w.add_sliding_window_pattern(pattern)
        if config.attn_logit_softcapping:
            w.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if config.final_logit_softcapping:
            w.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma3":
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
        if rope.get("rope_type", "default") != "default":
            w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
            w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        head_dim = config.hidden_size // config.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":  # as llama.cpp's converter: factors as tensors
            original = rope["original_max_position_embeddings"]
            factor = config.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)))
            w.add_rope_scaling_orig_ctx_len(original)
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    if tokens is not None:
        w.add_token_list(tokens)
        w.add_bos_token_id(config.bos_token_id)
        w.add_eos_token_id(config.eos_token_id)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(config.vocab_size)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    names = {v: k for k, v in _GGUF_TO_HF(tensors, arch).items()}
    for hf, arr in tensors.items():
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        arr = arr.astype(np.float32)
        if gemma and hf.endswith("norm.weight"):
            arr = arr + 1
        elif arch == "llama" and hf.endswith("q_proj.weight"):
            arr = _permute(arr, config.num_attention_heads)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            arr = _permute(arr, config.num_key_value_heads)
        kind = (types or {}).get(names[hf], qtype)
        if arr.ndim == 2 and kind in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(names[hf], random_k_blocks(kind, *arr.shape, seed=len(names[hf])), raw_dtype=kind)
        elif arr.ndim >= 2 and kind != Q.F32:
            w.add_tensor(names[hf], gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(names[hf], arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _GGUF_TO_HF(tensors, arch: str = "llama") -> dict[str, str]:
    out = {}
    for i in range(64):
        for g in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                  "ffn_down", "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm", "attn_qkv",
                  "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
                  "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp",
                  *(f"{p}.{e}" for p in ("ffn_gate", "ffn_up", "ffn_down") for e in range(16))):
            for suffix in ("weight", "bias"):
                hf = _hf_name(f"blk.{i}.{g}.{suffix}", arch)
                if hf in tensors:
                    out[f"blk.{i}.{g}.{suffix}"] = hf
    for g in ("token_embd", "output_norm", "output"):
        hf = _hf_name(f"{g}.weight")
        if hf in tensors:
            out[f"{g}.weight"] = hf
    return out


def random_k_blocks(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K (144 bytes) or Q6_K (210 bytes) super-blocks for a [rows, cols] weight, their
    float16 scales set to small finite values so the weights stay O(0.1-1)."""
    size = 144 if kind == Q.Q4_K else 210
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    if kind == Q.Q4_K:  # d, dmin; 6-bit sub-block scales up to 63
        b[..., 0:4] = rng.uniform(2e-4, 1e-3, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    else:  # d; int8 sub-block scales up to 127, values to 32
        b[..., 208:210] = rng.uniform(1e-5, 5e-5, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)
