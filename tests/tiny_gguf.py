"""GGUF files written from the tiny HF llama checkpoints (tiny_models.py) as llama.cpp's converter
writes them: RoPE rows interleaved, llama.cpp's tensor names, each 2-D weight in a chosen type."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from jaxserve.weights.gguf_file import _hf_name


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # What llama.cpp's converter does to q/k rows (interleave RoPE halves).
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, hf_dir, config, qtype: Q = Q.F32, types: dict[str, Q] | None = None) -> None:
    """A GGUF as llama.cpp's converter would write it, from a HF llama directory: 2-D weights in
    `qtype`, or in types[gguf name] (e.g. {"blk.0.ffn_up.weight": Q.Q5_0}). The gguf package cannot
    quantize to Q4_K or Q6_K, so those tensors get random super-blocks (random_k_blocks) instead of
    the checkpoint's values: a model the file defines, for comparing two ways of reading it."""
    from safetensors.numpy import load_file

    tensors = load_file(hf_dir / "model.safetensors")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_vocab_size(config.vocab_size)
    names = {v: k for k, v in _GGUF_TO_HF(tensors).items()}
    for hf, arr in tensors.items():
        if hf == "lm_head.weight":
            continue
        arr = arr.astype(np.float32)
        if hf.endswith("q_proj.weight"):
            arr = _permute(arr, config.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            arr = _permute(arr, config.num_key_value_heads)
        kind = (types or {}).get(names[hf], qtype)
        if arr.ndim == 2 and kind in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(names[hf], random_k_blocks(kind, *arr.shape, seed=len(names[hf])), raw_dtype=kind)
        elif arr.ndim == 2 and kind != Q.F32:
            w.add_tensor(names[hf], gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(names[hf], arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _GGUF_TO_HF(tensors) -> dict[str, str]:
    out = {}
    for i in range(64):
        for g in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            for suffix in ("weight", "bias"):
                hf = _hf_name(f"blk.{i}.{g}.{suffix}")
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
