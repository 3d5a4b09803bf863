"""GGUF files: model config and tensors from llama.cpp's format, renamed to HF's names.

The gguf package reads the file (memory-mapped) and dequantizes each quant block type to float32;
`open_blocks` instead reads the blocks that the block-quantized products (pallas_kernels.cpu_qmatmul,
jaxserve.models.products) take as they are: Q4_0, Q4_1, Q8_0, Q4_K and Q6_K (KEPT_TYPES). This
module maps llama.cpp's metadata and tensor names onto the Hugging Face config.json keys and
tensor names, so everything after it is shared with the safetensors path. llama.cpp stores the
q and k projections of llama-architecture models with RoPE's halves interleaved; they are permuted
back to HF's rotate-half layout here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.weights.safetensors_dir import TensorSource, WeightsError

# GGUF general.architecture -> HF architectures entry. Mistral checkpoints convert as "llama".
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                  "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# Mixtral converts as "llama" with experts (llama.expert_count).
_MIXTRAL = "MixtralForCausalLM"
# Gemma's RMSNorm scales by (1 + w); llama.cpp's converter stores 1 + w, which llama.cpp multiplies
# by as any norm weight. The model here adds the 1 itself, so it is taken off when read.
_GEMMA = ("gemma2", "gemma3")

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
    # A mixture of experts: the router, every expert's projections stacked [experts, out, in], and
    # Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Older Mixtral files store each expert on its own: blk.N.ffn_gate.E.weight (stacked by the source).
_PER_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# Gemma's four norms per layer ("sandwich"): llama.cpp's ffn_norm is the pre-MLP norm, which Gemma
# calls pre_feedforward_layernorm (its post_attention_layernorm follows the attention).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's fused projections: attn_qkv, and ffn_up holding gate and up (split by the source).
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
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
        "eos_token_id": _end_ids(reader, arch),
        "torch_dtype": weights_dtype(reader),
    }
    scaling = field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"type": scaling, "factor": float(field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    if field(reader, f"{arch}.expert_count"):
        cfg.update(_moe_config(reader, arch, path, cfg))
    if arch in _GEMMA:
        cfg.update(_gemma_config(reader, arch, cfg))
    if arch == "phi3":
        rotary = field(reader, f"{arch}.rope.dimension_count")
        if rotary is not None:
            cfg["partial_rotary_factor"] = int(rotary) / cfg["head_dim"]
        window = field(reader, f"{arch}.attention.sliding_window")
        if window:
            cfg["sliding_window"] = int(window)
        if _LONGROPE_TENSORS & names:
            cfg["rope_scaling"] = _longrope(reader, arch, path)
    if "rope_freqs.weight" in names:
        raise WeightsError(f"{path}: per-frequency RoPE factors (rope_freqs) are not supported yet")
    return cfg


# LongRoPE's factors, which llama.cpp's converter stores as tensors beside the weights.
_LONGROPE_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}


def _longrope(reader: Any, arch: str, path: Path) -> dict[str, Any]:
    """A Phi-3 GGUF's LongRoPE as HF's rope_scaling: the factor tensors, the switch
    (rope.scaling.original_context_length) and the cos/sin scale (rope.scaling.attn_factor)."""
    tensors = {t.name: t for t in reader.tensors if t.name in _LONGROPE_TENSORS}
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if len(tensors) != 2 or original is None:
        raise WeightsError(f"{path}: LongRoPE needs both rope_factors_long and rope_factors_short and "
                           f"{arch}.rope.scaling.original_context_length")
    factors = {name: [float(x) for x in np.asarray(t.data, np.float32).reshape(-1)] for name, t in tensors.items()}
    out = {"type": "longrope", "long_factor": factors["rope_factors_long.weight"],
           "short_factor": factors["rope_factors_short.weight"], "original_max_position_embeddings": int(original)}
    attention = field(reader, f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        out["attention_factor"] = float(attention)
    return out


def _moe_config(reader: Any, arch: str, path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' settings as HF's config.json names them, as llama.cpp runs them:
    Mixtral ("llama" with experts) and Qwen3-MoE renormalise the top-k weights, Qwen2-MoE does
    not; every layer is sparse."""
    if arch not in ("llama", "qwen2moe", "qwen3moe"):
        raise WeightsError(f"{path}: GGUF architecture {arch!r} with experts is not supported")
    scale = field(reader, f"{arch}.expert_weights_scale")
    if scale not in (None, 1.0):
        raise WeightsError(f"{path}: {arch}.expert_weights_scale {scale} (scaled expert weights) is not supported")
    gating = field(reader, f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise WeightsError(f"{path}: {arch}.expert_gating_func {gating} is not supported (softmax routing only)")
    out: dict[str, Any] = {"num_experts": int(field(reader, f"{arch}.expert_count")),
                           "num_experts_per_tok": int(field(reader, f"{arch}.expert_used_count"))}
    if arch == "llama":
        return {**out, "architectures": [_MIXTRAL]}
    out["moe_intermediate_size"] = int(field(reader, f"{arch}.expert_feed_forward_length",
                                             cfg["intermediate_size"] // out["num_experts_per_tok"]))
    out["norm_topk_prob"] = bool(field(reader, f"{arch}.expert_weights_norm", arch == "qwen3moe"))
    shared = field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _end_ids(reader: Any, arch: str) -> list[int] | int | None:
    """The tokens that end a generation, as llama.cpp ends it: the file's eos, its end-of-turn and
    end-of-message tokens when it names them, and Gemma's <end_of_turn> (the chat template closes
    every turn with it; a Gemma GGUF's eos is <eos>)."""
    ids = [field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    if arch in _GEMMA:
        tokens = field(reader, "tokenizer.ggml.tokens") or []
        ids.append(next((i for i, t in enumerate(tokens) if t == "<end_of_turn>"), None))
    ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return ids[0] if len(ids) == 1 else (ids or None)


def _gemma_config(reader: Any, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The Gemma settings a GGUF leaves to llama.cpp's code, as llama.cpp reads them: the query
    scale is 1/sqrt(hidden / heads) for the 27B models (Gemma2's 46 layers, Gemma3's 62) and
    1/sqrt(head_dim) otherwise; Gemma2 alternates sliding and full layers, Gemma3 has one full
    layer in six (unless the file names its pattern), its sliding layers rotating at base 10,000
    unless the file says otherwise."""
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    is_27b = layers == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = {
        "query_pre_attn_scalar": hidden // heads if is_27b else cfg["head_dim"],
        "sliding_window": int(field(reader, f"{arch}.attention.sliding_window", 4096)),
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": field(reader, f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": field(reader, f"{arch}.final_logit_softcapping"),
    }
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):  # per layer, True where the layer slides
        out["layer_types"] = ["sliding_attention" if slides else "full_attention" for slides in pattern]
    else:
        out["sliding_window_pattern"] = int(pattern)
        out["layer_types"] = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                              for i in range(layers)]
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(field(reader, f"{arch}.rope.freq_base_swa", 10000.0))
    return out


def weights_dtype(reader: Any) -> str:
    """The precision most of the weights are stored in, for --dtype auto: "float32", "float16",
    "bfloat16", or a quantized type's name ("q4_1"), which auto treats like a 16-bit checkpoint
    (dequantized values lose nothing that matters in bfloat16)."""
    elements: dict[str, int] = {}
    for t in reader.tensors:
        elements[t.tensor_type.name] = elements.get(t.tensor_type.name, 0) + int(t.n_elements)
    most = max(elements, key=elements.__getitem__)
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(most, most.lower())


def _hf_name(name: str, arch: str = "llama") -> str | None:
    """GGUF tensor `name` of a file of GGUF architecture `arch` -> its HF name (None: not a model tensor)."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    layer_names = _GEMMA_LAYER_NAMES if arch in _GEMMA else _PHI3_LAYER_NAMES if arch == "phi3" else _LAYER_NAMES
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _PER_EXPERT and parts[3].isdigit():
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{_PER_EXPERT[parts[2]]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's convert script reorders each head's rows from [half0, half1] to interleaved
    # pairs; undo it so rotate-half RoPE applies.
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Block types a product reads as they are (--quantization auto on a GGUF): bits per value. Q4_0 is
# w = (q - 8) d, Q4_1 w = q d + m, Q8_0 w = q d, in blocks of 32 along each row; the K-quants'
# super-blocks of 256 hold sub-blocks of 32 (Q4_K: w = q d sc - dmin m) or 16 (Q6_K: w = (q - 32)
# d sc) whose scales, exact in float32, are computed here.
KEPT_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q4_K": 4, "Q6_K": 8}
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK = 32


def _permuted_heads(cfg: dict[str, Any], hf: str) -> int | None:
    """The head count whose RoPE halves llama.cpp interleaved in this tensor's rows, if any."""
    if cfg["architectures"][0] not in ("LlamaForCausalLM", _MIXTRAL):
        return None
    if hf.endswith("q_proj.weight"):
        return cfg["num_attention_heads"]
    if hf.endswith("k_proj.weight"):
        return cfg["num_key_value_heads"]
    return None


def tensor_types(reader: Any) -> dict[str, str]:
    """HF name -> the GGUF tensor's type name (F32, Q4_1, Q6_K, ...)."""
    arch = field(reader, "general.architecture")
    return {hf: t.tensor_type.name for t in reader.tensors if (hf := _hf_name(t.name, arch)) is not None}


def gguf_name(hf: str, reader: Any) -> str:
    """The GGUF name of the tensor that holds HF tensor `hf` (for messages)."""
    arch = field(reader, "general.architecture")
    return next((t.name for t in reader.tensors if _hf_name(t.name, arch) == hf), hf)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry on the last axis -> float16 values."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _q4_k(b: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [rows, n, 144]: d, dmin (f16), 12 bytes of eight 6-bit (scale, min) pairs,
    128 bytes of nibbles (each 32 bytes: 32 values of sub-block 2i in the low nibbles, 2i + 1 in
    the high) -> 4-bit values in groups of 32 with float32 scale d sc and minimum -dmin m."""
    d, dmin = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
    s = b[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(rows, cols)  # sub-blocks 2i, 2i + 1 of each 32 bytes
    scale = (d[..., None] * sc).reshape(rows, -1)
    mn = (-(dmin[..., None] * m)).reshape(rows, -1)
    return q, scale.astype(np.float32), mn.astype(np.float32)


def _q6_k(b: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks [rows, n, 210]: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
    scales, d (f16) -> int8 values q - 32 in groups of 16 with float32 scale d sc."""
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 64)  # per half of 128 values
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210]).astype(np.float32)
    lo = np.concatenate([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    hi = np.concatenate([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=-1)
    q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, cols)
    return q, (d[..., None] * sc).reshape(rows, -1).astype(np.float32)


def decode_blocks(data: np.ndarray, type_name: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A KEPT_TYPES tensor's raw bytes [rows, bytes per row] -> (q [rows, cols], d [rows, groups],
    mn [rows, groups] or None): w = q d (+ mn), q uint8 0..15 for 4 bits and int8 for 8. Lossless:
    the values are the file's, the scales its float16 ones (float32 products of them for the
    K-quants, whose groups are 32 values for Q4_K and 16 for Q6_K; 32 for the others)."""
    if type_name in ("Q4_K", "Q6_K"):
        b = np.ascontiguousarray(data).reshape(rows, cols // 256, -1)
        return _q4_k(b, rows, cols) if type_name == "Q4_K" else (*_q6_k(b, rows, cols), None)
    nb = cols // BLOCK
    b = np.ascontiguousarray(data).reshape(rows, nb, -1)
    if type_name == "Q8_0":  # d f16, 32 x int8
        return b[..., 2:].view(np.int8).reshape(rows, cols), b[..., :2].copy().view(np.float16)[..., 0], None
    if type_name == "Q4_1":  # d f16, m f16, 16 bytes: value j in byte j % 16, low nibble for j < 16
        d, mn, qs = b[..., :2].copy().view(np.float16)[..., 0], b[..., 2:4].copy().view(np.float16)[..., 0], b[..., 4:]
    elif type_name == "Q4_0":  # d f16, 16 bytes as Q4_1's; w = (q - 8) d, so mn = -8 d (exact in float16)
        d, qs = b[..., :2].copy().view(np.float16)[..., 0], b[..., 2:]
        mn = (d.astype(np.float32) * -8).astype(np.float16)
    else:
        raise ValueError(f"no block decoder for {type_name}")
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, cols)
    return q, d, mn


def open_blocks(reader: Any, cfg: dict[str, Any], path: Path) -> dict[str, tuple[str, Callable[[], tuple]]]:
    """HF name -> (type name, loader of decode_blocks' (q, d, mn) in HF's [out, in] orientation,
    RoPE rows un-interleaved as open_tensors does) for every tensor stored in KEPT_TYPES blocks."""
    out: dict[str, tuple[str, Callable[[], tuple]]] = {}
    arch = field(reader, "general.architecture")
    for t in reader.tensors:
        hf = _hf_name(t.name, arch)
        # Experts run in the model's dtype (jaxserve.models.moe): their blocks are never kept.
        if hf is None or t.tensor_type.name not in KEPT_TYPES or ".experts." in hf:
            continue
        cols, rows = (int(n) for n in t.shape)  # ggml lists dimensions innermost first
        block = 256 if t.tensor_type.name.endswith("_K") else BLOCK
        if cols % block:
            raise WeightsError(f"{path}: tensor {t.name} has rows of {cols} values, not whole blocks of {block}")
        heads = _permuted_heads(cfg, hf)

        def load(t=t, rows=rows, cols=cols, heads=heads) -> tuple:
            q, d, mn = decode_blocks(t.data, t.tensor_type.name, rows, cols)
            if heads:
                q, d = _unpermute(q, heads), _unpermute(d, heads)
                mn = None if mn is None else _unpermute(mn, heads)
            return q, d, mn

        out[hf] = (t.tensor_type.name, load)
    return out


def open_tensors(reader: Any, cfg: dict[str, Any], path: Path) -> dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]]:
    """HF name -> (lazy dequantizing loader, shape, float32)."""
    import gguf

    out: dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]] = {}
    arch = field(reader, "general.architecture")
    for t in reader.tensors:
        hf = _hf_name(t.name, arch)
        if hf is None and t.name in _LONGROPE_TENSORS:
            continue  # read into the config (_longrope)
        if hf is None:
            raise WeightsError(f"{path}: unexpected tensor {t.name!r}")
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dimensions innermost first
        heads = _permuted_heads(cfg, hf)
        shift = 1.0 if arch in _GEMMA and hf.endswith("norm.weight") else 0.0

        def load(t=t, shape=shape, heads=heads, shift=shift) -> np.ndarray:
            try:
                w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            except NotImplementedError as e:
                raise WeightsError(f"{path}: tensor {t.name} uses unsupported type {t.tensor_type.name}") from e
            if shift:
                w = w - shift
            return _unpermute(w, heads) if heads else w

        out[hf] = (load, shape, np.dtype(np.float32))
    return out
