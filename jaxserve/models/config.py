"""Architecture description of a decoder-only model, parsed from a Hugging Face config.json.

One frozen dataclass describes every supported family; the differences between Llama, Mistral,
Qwen2, Qwen3, Gemma2, Gemma3 and Phi-3 are a handful of switches (biases, q/k norms, sandwich norms,
soft-caps, per-layer sliding windows and RoPE), and Mixtral, Qwen2-MoE and Qwen3-MoE are those
families with routed experts in place of the MLP (`MoeConfig`). The model code reads only this, never the raw HF dict.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.multimodal import LANGUAGE_MODEL_ONLY_ARCHITECTURES, VISION_LANGUAGE_ARCHITECTURES

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)

# Mixture-of-experts families -> the dense family whose attention, norms and RoPE they share; the
# MLP of their sparse layers is a routed mixture of experts (jaxserve.models.moe).
MOE_ARCHITECTURES = {"MixtralForCausalLM": "MistralForCausalLM", "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
                     "Qwen3MoeForCausalLM": "Qwen3ForCausalLM"}


# Vision-language models (VISION_LANGUAGE_ARCHITECTURES, and LANGUAGE_MODEL_ONLY_ARCHITECTURES
# served without their images): their language model is one of the families above, described by
# config.json's text_config (jaxserve.models.vision and jaxserve.models.qwen2_vl_vision hold the
# vision sides).
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                       "qwen2_5_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM",
                       "gemma3_text": "Gemma3ForCausalLM"}

# Gemma3TextConfig's defaults: the Hub's Gemma3 4B-27B configs write only what differs from them
# into text_config (4B's names neither heads nor vocabulary).
_GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0, tie_word_embeddings=True,
)


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model jaxserve cannot run; the message says why."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini): per-frequency divisors for sequences up to
    # original_max_position tokens and beyond, and the cos/sin scale.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The routed experts of a mixture-of-experts model's sparse layers: each token's router picks
    `top_k` of `num_experts` SwiGLU experts (width `intermediate_size`) by softmax probability and
    sums their outputs weighted by those probabilities (renormalised over the picked ones with
    `norm_topk_prob`); Qwen2-MoE adds a shared expert every token runs, gated by a sigmoid."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    shared_intermediate_size: int = 0  # 0: no shared expert
    # Per layer: whether its MLP is the experts (Qwen's decoder_sparse_step / mlp_only_layers keep
    # some layers dense, with the config's intermediate_size).
    sparse_layers: tuple[bool, ...] = ()


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    # Gemma3: the sliding-window layers' own RoPE (a lower base, no scaling); None: every layer's
    # is `rope`.
    local_rope: RopeConfig | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # Biases: Llama's `attention_bias` covers q/k/v/o; Qwen2 has q/k/v bias only.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Qwen3: RMSNorm over head_dim on q and k before RoPE.
    qk_norm: bool = False
    # Gemma2 and Gemma3: RMSNorm scales by (1 + w), norms after attention and around the MLP,
    # embeddings scaled by sqrt(hidden); Gemma2's tanh soft-caps on attention and final logits.
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_scale: float = 0.0  # 0 -> head_dim ** -0.5
    # Per-layer sliding window in tokens (0 = full attention); a query at position p sees keys at
    # positions p - window + 1 .. p, as HF's sliding-window masks do.
    layer_windows: tuple[int, ...] = ()
    # Rotated dimensions of each head (Phi-4-mini's partial_rotary_factor 0.75: the first 3/4 are
    # rotated, the rest pass as they are); 0: all of head_dim.
    rotary_dim: int = 0
    # Qwen2.5-VL's multimodal RoPE: consecutive sections of the rotary frequencies rotate by the
    # temporal, height and width positions (() = ordinary RoPE, one position per token).
    mrope_section: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # a mixture-of-experts model's experts (None: every MLP dense)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's own dtype, used by --dtype auto

    @property
    def scale(self) -> float:
        return self.query_scale or self.head_dim**-0.5

    @property
    def rotary(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def windows(self) -> tuple[int, ...]:
        return self.layer_windows or (0,) * self.num_layers

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the routed experts."""
        return self.moe is not None and self.moe.sparse_layers[layer]


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def _rope(cfg: dict[str, Any], layer_type: str | None = None) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older checkpoints write rope_theta + rope_scaling.
    # Models whose layer types rotate differently (Gemma3) key `rope_parameters` by layer type.
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", _get(cfg, "rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "mrope":  # Qwen2-VL's older spelling: default frequencies, sections read by `_mrope_section`
        kind = "default"
    if kind == "su":  # LongRoPE's first name in Phi-3's configs
        kind = "longrope"
    if kind not in ("default", "linear", "llama3", "longrope"):
        raise UnsupportedModelError(
            f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, longrope)"
        )
    original = int(merged.get("original_max_position_embeddings")
                   or _get(cfg, "original_max_position_embeddings", 8192))
    if kind != "longrope":
        return RopeConfig(theta=theta, kind=kind, factor=float(merged.get("factor", 1.0)),
                          low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
                          high_freq_factor=float(merged.get("high_freq_factor", 4.0)), original_max_position=original)
    # HF's LongRoPE: the factor defaults to max_position_embeddings / original (Phi-3's configs
    # leave it out), and the cos/sin scale to sqrt(1 + ln(factor) / ln(original)).
    factor = float(merged.get("factor") or int(_get(cfg, "max_position_embeddings", original)) / original)
    attention = merged.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta=theta, kind=kind, factor=factor, original_max_position=original,
                      short_factor=tuple(float(f) for f in merged["short_factor"]),
                      long_factor=tuple(float(f) for f in merged["long_factor"]), attention_factor=float(attention))


def _gemma3_local_rope(cfg: dict[str, Any]) -> RopeConfig:
    """Gemma3's sliding-window layers' RoPE: `rope_parameters["sliding_attention"]`
    (transformers 5), else the Hub configs' `rope_local_base_freq` (default 10,000), unscaled:
    `rope_scaling` applies to the full-attention layers only."""
    params = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(params, dict):
        return _rope({"rope_parameters": params})
    return RopeConfig(theta=float(_get(cfg, "rope_local_base_freq", 10000.0)))


def _mrope_section(cfg: dict[str, Any]) -> tuple[int, ...]:
    merged = {**dict(cfg.get("rope_scaling") or {}), **dict(cfg.get("rope_parameters") or {})}
    return tuple(int(x) for x in merged.get("mrope_section") or ())


def _eos(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _layer_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window") or 0
    layer_types = cfg.get("layer_types")
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return (int(window),) * num_layers
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM") and not layer_types:
        # Gemma2 alternates: even layers slide, odd layers see everything. Gemma3's Hub configs
        # name a period instead: every sliding_window_pattern-th layer sees everything (6).
        period = 2 if arch == "Gemma2ForCausalLM" else int(_get(cfg, "sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not layer_types:
        if cfg.get("use_sliding_window") and window:
            first_full = int(_get(cfg, "max_window_layers", num_layers))
            layer_types = ["sliding_attention" if i >= first_full else "full_attention" for i in range(num_layers)]
    if not layer_types:
        return (0,) * num_layers
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    if any(t == "sliding_attention" for t in layer_types) and not window:
        raise UnsupportedModelError("layer_types asks for sliding attention but sliding_window is not set")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)


def _moe(cfg: dict[str, Any], arch: str, num_layers: int) -> MoeConfig:
    """The experts of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json. Mixtral's experts are
    `intermediate_size` wide, renormalise their top-k weights, and every layer is sparse; Qwen's
    are `moe_intermediate_size` wide, renormalise with norm_topk_prob, and a layer is sparse unless
    it is in mlp_only_layers or off the decoder_sparse_step grid."""
    experts = int(_get(cfg, "num_local_experts", None) or _get(cfg, "num_experts", 0))
    top_k = int(_get(cfg, "num_experts_per_tok", 2))
    if experts < 1 or not 0 < top_k <= experts:
        raise UnsupportedModelError(f"{arch} needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, "
                                    f"got {experts} and {top_k}")
    if arch == "MixtralForCausalLM":
        # (router_jitter_noise is a training device: HF applies it in train mode only.)
        return MoeConfig(experts, top_k, int(cfg["intermediate_size"]), True, 0, (True,) * num_layers)
    step = int(_get(cfg, "decoder_sparse_step", 1))
    dense = set(int(i) for i in _get(cfg, "mlp_only_layers", []))
    sparse = tuple(i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers))
    shared = int(_get(cfg, "shared_expert_intermediate_size", 0)) if arch == "Qwen2MoeForCausalLM" else 0
    return MoeConfig(experts, top_k, int(_get(cfg, "moe_intermediate_size", cfg["intermediate_size"])),
                     bool(_get(cfg, "norm_topk_prob", False)), shared, sparse)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a vision-language config.json (its text_config, with the
    causal-LM architecture of its model_type); any other config as it is."""
    archs = cfg.get("architectures") or []
    if not any(a in VISION_LANGUAGE_ARCHITECTURES + LANGUAGE_MODEL_ONLY_ARCHITECTURES for a in archs):
        return cfg
    # Hub checkpoints of Qwen2.5-VL keep the language model's keys at the top level.
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    model_type = text.get("model_type", "llama")
    if model_type == "gemma3_text":
        text = {**_GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if model_type not in _TEXT_ARCHITECTURES:
        raise UnsupportedModelError(f"{archs[0]}'s language model {model_type!r} is not supported; supported: "
                                    + ", ".join(_TEXT_ARCHITECTURES))
    # Token ids and dtype may sit at the top level only.
    for key in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype", "tie_word_embeddings"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return {**text, "architectures": [_TEXT_ARCHITECTURES[model_type]]}


def decoder_config_from_hf(cfg: dict[str, Any]) -> DecoderConfig:
    """Parse a Hugging Face config.json dict; raises UnsupportedModelError naming what is missing."""
    cfg = text_config(cfg)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or '(none given)'} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES + VISION_LANGUAGE_ARCHITECTURES + LANGUAGE_MODEL_ONLY_ARCHITECTURES)
        )
    # A mixture-of-experts model parses as its dense family, with its experts (`_moe`) added.
    family = MOE_ARCHITECTURES.get(arch, arch)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(_get(cfg, "num_key_value_heads", heads))
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    num_layers = int(cfg["num_hidden_layers"])
    head_dim = int(_get(cfg, "head_dim", hidden // heads))
    act = _get(cfg, "hidden_act", None) or _get(cfg, "hidden_activation", "silu")
    if act not in ("silu", "gelu_pytorch_tanh", "gelu"):
        raise UnsupportedModelError(f"hidden activation {act!r} is not supported (silu, gelu_pytorch_tanh, gelu)")
    common = dict(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope=_rope(cfg, "full_attention" if arch == "Gemma3ForCausalLM" else None),
        hidden_act=act,
        layer_windows=_layer_windows(cfg, family, num_layers),
        moe=_moe(cfg, arch, num_layers) if arch in MOE_ARCHITECTURES else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos(cfg),
        dtype=str(_get(cfg, "dtype", None) or _get(cfg, "torch_dtype", "float32")),
    )
    if common["rope"].kind == "longrope" and arch != "Phi3ForCausalLM":
        raise UnsupportedModelError(f"rope scaling type 'longrope' is supported for Phi3ForCausalLM, not {arch}")
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        # Gemma3 is Gemma2's layer with q/k norms and its sliding layers' own RoPE.
        gemma3 = arch == "Gemma3ForCausalLM"
        if gemma3 and cfg.get("use_bidirectional_attention"):
            # EmbeddingGemma's encoder: its tokens see the whole window both ways.
            raise UnsupportedModelError("Gemma3 with use_bidirectional_attention (an encoder, as EmbeddingGemma) "
                                        "is not supported")
        bias = bool(_get(cfg, "attention_bias", False))
        return DecoderConfig(
            **common,
            local_rope=_gemma3_local_rope(cfg) if gemma3 else None,
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=gemma3,
            norm_weight_offset=1.0,
            sandwich_norms=True,
            embed_scale=math.sqrt(hidden),
            attn_logit_softcap=cfg.get("attn_logit_softcapping"),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            query_scale=float(_get(cfg, "query_pre_attn_scalar", head_dim)) ** -0.5,
        )
    tie = bool(_get(cfg, "tie_word_embeddings", False))
    if arch == "Phi3ForCausalLM":
        # Phi-3 and Phi-4 store q/k/v and gate/up fused (qkv_proj, gate_up_proj); the loader reads
        # each projection as its slice (jaxserve.weights.source), so the layer is Llama's.
        factor = float(_get(cfg, "partial_rotary_factor", None)
                       or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0)
        rotary = int(head_dim * factor)
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise UnsupportedModelError(f"partial_rotary_factor {factor} rotates {rotary} of head_dim {head_dim}: "
                                        "an even count up to head_dim is needed")
        rope = common["rope"]
        if rope.kind == "longrope" and not len(rope.short_factor) == len(rope.long_factor) == rotary // 2:
            raise UnsupportedModelError(f"LongRoPE needs {rotary // 2} short and long factors (one per rotary "
                                        f"frequency), got {len(rope.short_factor)} and {len(rope.long_factor)}")
        return DecoderConfig(**common, tie_word_embeddings=tie, rotary_dim=0 if rotary == head_dim else rotary)
    if family == "Qwen2ForCausalLM":
        mrope = _mrope_section(cfg)
        if mrope and 2 * sum(mrope) != head_dim:
            raise UnsupportedModelError(f"mrope_section {list(mrope)} covers {sum(mrope)} of head_dim/2 = "
                                        f"{head_dim // 2} rotary frequencies")
        return DecoderConfig(**common, tie_word_embeddings=tie, qkv_bias=True, mrope_section=mrope)
    if family == "Qwen3ForCausalLM":
        bias = bool(_get(cfg, "attention_bias", False))
        return DecoderConfig(**common, tie_word_embeddings=tie, qkv_bias=bias, o_bias=bias, qk_norm=True)
    bias = bool(_get(cfg, "attention_bias", False))
    return DecoderConfig(
        **common,
        tie_word_embeddings=tie,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(_get(cfg, "mlp_bias", False)),
    )
