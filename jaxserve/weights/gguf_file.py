"""GGUF files: model config and tensors from llama.cpp's format, renamed to HF's names.

The gguf package reads the file (memory-mapped) and dequantizes each quant block type to float32;
this module maps llama.cpp's metadata and tensor names onto the Hugging Face config.json keys and
tensor names, so everything after it is shared with the safetensors path. llama.cpp stores the
q and k projections of llama-architecture models with RoPE's halves interleaved; they are permuted
back to HF's rotate-half layout here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.weights.safetensors_dir import TensorSource, WeightsError

# GGUF general.architecture -> HF architectures entry. Mistral checkpoints convert as "llama".
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueErrors/struct errors on corrupt files
        raise WeightsError(f"{path}: not a readable GGUF file ({e})") from e


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader: Any, path: Path) -> dict[str, Any]:
    """A Hugging Face style config.json dict built from GGUF metadata."""
    arch = field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise WeightsError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    names = {t.name for t in reader.tensors}
    heads = int(field(reader, f"{arch}.attention.head_count"))
    hidden = int(field(reader, f"{arch}.embedding_length"))
    vocab = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens"))
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(field(reader, f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": weights_dtype(reader),
    }
    scaling = field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"type": scaling, "factor": float(field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    if "rope_freqs.weight" in names:
        raise WeightsError(f"{path}: per-frequency RoPE factors (rope_freqs) are not supported yet")
    return cfg


def weights_dtype(reader: Any) -> str:
    """The precision most of the weights are stored in, for --dtype auto: "float32", "float16",
    "bfloat16", or a quantized type's name ("q4_1"), which auto treats like a 16-bit checkpoint
    (dequantized values lose nothing that matters in bfloat16)."""
    elements: dict[str, int] = {}
    for t in reader.tensors:
        elements[t.tensor_type.name] = elements.get(t.tensor_type.name, 0) + int(t.n_elements)
    most = max(elements, key=elements.__getitem__)
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(most, most.lower())


def _hf_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's convert script reorders each head's rows from [half0, half1] to interleaved
    # pairs; undo it so rotate-half RoPE applies.
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_tensors(reader: Any, cfg: dict[str, Any], path: Path) -> dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]]:
    """HF name -> (lazy dequantizing loader, shape, float32)."""
    import gguf

    permute = cfg["architectures"][0] == "LlamaForCausalLM"
    out: dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]] = {}
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            raise WeightsError(f"{path}: unexpected tensor {t.name!r}")
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dimensions innermost first
        heads = None
        if permute and hf.endswith("q_proj.weight"):
            heads = cfg["num_attention_heads"]
        elif permute and hf.endswith("k_proj.weight"):
            heads = cfg["num_key_value_heads"]

        def load(t=t, shape=shape, heads=heads) -> np.ndarray:
            try:
                w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            except NotImplementedError as e:
                raise WeightsError(f"{path}: tensor {t.name} uses unsupported type {t.tensor_type.name}") from e
            return _unpermute(w, heads) if heads else w

        out[hf] = (load, shape, np.dtype(np.float32))
    return out
