"""BERT-style encoders, as Flax NNX modules: with a sequence-classification head, BERT ([CLS] ->
pooler -> classifier) and RoBERTa / XLM-RoBERTa (<s> -> dense + tanh -> out_proj); without one
(BertModel, RobertaModel, XLMRobertaModel: sentence-transformers checkpoints), the body whose
hidden states an embedding model pools.

Like the decoder, every layer holds its own parameters and the layers run as an unrolled loop
(`jaxserve.models.layers.run_layers`), and attention is passed in, so the same module runs packed
steps and the parity tests. Only absolute position embeddings exist in transformers 5, so only
those are supported. Token types are 0 for a single text and 1 for the second text of a pair
(what a cross-encoder scores).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import UnsupportedModelError
from jaxserve.models.decoder import AttentionFn
from jaxserve.models.layers import Linear, run_layers, zeros_param
from jaxserve.models.packed_attention import PackedAttention

Array = jax.Array

# architecture -> (weight-name prefix of the encoder, family, head kind)
ENCODER_ARCHITECTURES: dict[str, tuple[str, str, str]] = {
    "BertForSequenceClassification": ("bert.", "bert", "pooler"),
    "RobertaForSequenceClassification": ("roberta.", "roberta", "roberta"),
    "XLMRobertaForSequenceClassification": ("roberta.", "roberta", "roberta"),
    # Bare encoders (embedding models): saved by their base class, so no prefix.
    "BertModel": ("", "bert", "none"),
    "RobertaModel": ("", "roberta", "none"),
    "XLMRobertaModel": ("", "roberta", "none"),
}
ENCODER_CLASSIFIERS = tuple(a for a, (_, _, head) in ENCODER_ARCHITECTURES.items() if head != "none")
ENCODER_EMBEDDERS = tuple(a for a, (_, _, head) in ENCODER_ARCHITECTURES.items() if head == "none")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    num_labels: int  # 0 for a bare encoder
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int | None = 0
    # RoBERTa numbers positions from pad_token_id + 1 (fairseq's convention), so its last usable
    # position is max_position_embeddings - 1 and the context is max_position_embeddings - offset.
    position_offset: int = 0
    dtype: str = "float32"

    @property
    def prefix(self) -> str:
        return ENCODER_ARCHITECTURES[self.architecture][0]

    @property
    def family(self) -> str:
        """bert or roberta: how positions are numbered."""
        return ENCODER_ARCHITECTURES[self.architecture][1]

    @property
    def head(self) -> str:
        """pooler (BERT), roberta (dense + out_proj) or none (a bare encoder)."""
        return ENCODER_ARCHITECTURES[self.architecture][2]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings - self.position_offset


def encoder_config_from_hf(cfg: dict[str, Any], num_labels: int) -> EncoderConfig:
    """Parse a BERT/RoBERTa config.json; num_labels comes from the checkpoint's head (0: none)."""
    arch = next((a for a in cfg.get("architectures") or [] if a in ENCODER_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(f"not a BERT-style encoder: {cfg.get('architectures')}")
    kind = cfg.get("position_embedding_type") or "absolute"
    if kind != "absolute":
        raise UnsupportedModelError(f"position_embedding_type {kind!r} is not supported (only absolute)")
    if cfg.get("is_decoder"):
        raise UnsupportedModelError("BERT with is_decoder=true (causal) is not a classifier jaxserve runs")
    act = cfg.get("hidden_act") or "gelu"
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(f"hidden activation {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if hidden % heads:
        raise UnsupportedModelError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    pad = cfg.get("pad_token_id")
    roberta = ENCODER_ARCHITECTURES[arch][1] == "roberta"
    if roberta and pad is None:
        raise UnsupportedModelError("RoBERTa needs pad_token_id: its positions are numbered from it")
    return EncoderConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 512),
        type_vocab_size=int(cfg.get("type_vocab_size") or 2),
        num_labels=num_labels,
        layer_norm_eps=float(cfg.get("layer_norm_eps") or 1e-12),
        hidden_act=act,
        pad_token_id=pad,
        position_offset=int(pad) + 1 if roberta else 0,
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: Any):
        self.weight = zeros_param(dim, dtype=dtype)
        self.bias = zeros_param(dim, dtype=dtype)
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        # float32 statistics whatever the activation dtype, as torch's LayerNorm computes them.
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class EncoderLayer(nnx.Module):
    """Post-norm transformer layer: x = norm(x + attn(x)); x = norm(x + mlp(x))."""

    def __init__(self, cfg: EncoderConfig, dtype: Any):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.query = Linear(h, h, True, dtype)
        self.key = Linear(h, h, True, dtype)
        self.value = Linear(h, h, True, dtype)
        self.attn_out = Linear(h, h, True, dtype)
        self.attn_norm = LayerNorm(h, cfg.layer_norm_eps, dtype)
        self.intermediate = Linear(h, i, True, dtype)
        self.output = Linear(i, h, True, dtype)
        self.out_norm = LayerNorm(h, cfg.layer_norm_eps, dtype)
        self.num_heads, self.head_dim, self.act = cfg.num_heads, cfg.head_dim, cfg.hidden_act

    def __call__(self, x: Array, attend: AttentionFn, layer: Array) -> Array:
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, self.num_heads, self.head_dim)  # noqa: E731
        ctx, _ = attend(split(self.query(x)), split(self.key(x)), split(self.value(x)), None, jnp.int32(0), layer)
        x = self.attn_norm(x + self.attn_out(ctx.reshape(b, t, -1).astype(x.dtype)))
        return self.out_norm(x + self.output(_ACTIVATIONS[self.act](self.intermediate(x))))


def _layer_body(layer: EncoderLayer, x: Array, attend: AttentionFn, index: Array) -> Array:
    return layer(x, attend, index)


class Encoder(nnx.Module):
    """BERT / RoBERTa encoder plus its classification head, if it has one; parameters named after HF's."""

    def __init__(self, cfg: EncoderConfig, dtype: Any = jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        h = cfg.hidden_size
        self.word_embeddings = zeros_param(cfg.vocab_size, h, dtype=dtype)  # [vocab, hidden]
        self.position_embeddings = zeros_param(cfg.max_position_embeddings, h, dtype=dtype)
        self.token_type_embeddings = zeros_param(cfg.type_vocab_size, h, dtype=dtype)
        self.embeddings_norm = LayerNorm(h, cfg.layer_norm_eps, dtype)
        self.layers = nnx.List([EncoderLayer(cfg, dtype) for _ in range(cfg.num_layers)])
        if cfg.head == "pooler":
            self.pooler = Linear(h, h, True, dtype)
            self.classifier = Linear(h, cfg.num_labels, True, dtype)
        elif cfg.head == "roberta":
            self.head_dense = Linear(h, h, True, dtype)
            self.head_out = Linear(h, cfg.num_labels, True, dtype)

    def hidden_states(self, tokens: Array, positions: Array, attend: AttentionFn,
                      token_types: Array | None = None) -> Array:
        """tokens, positions, token_types: [batch, tokens] -> last hidden states [batch, tokens,
        hidden]. No token_types: a single text, type 0 everywhere."""
        x = jnp.take(self.word_embeddings[...], tokens, axis=0)
        x = x + jnp.take(self.position_embeddings[...], positions, axis=0)
        if token_types is None:
            x = x + self.token_type_embeddings[0]
        else:
            x = x + jnp.take(self.token_type_embeddings[...], token_types, axis=0)
        x = self.embeddings_norm(x)
        per_layer = [jnp.int32(i) for i in range(self.cfg.num_layers)]
        return run_layers(self.layers, _layer_body, x, attend, per_layer)

    def head(self, first: Array) -> Array:
        """Hidden state of each sequence's first token ([CLS] / <s>) [n, hidden] -> float32 logits [n, labels]."""
        if self.cfg.head == "pooler":
            return self.classifier(jnp.tanh(self.pooler(first))).astype(jnp.float32)
        return self.head_out(jnp.tanh(self.head_dense(first))).astype(jnp.float32)

    def packed_hidden_states(self, tokens: Array, positions: Array, segments: Array, token_types: Array,
                             max_segment: int | None = None) -> Array:
        """One packed row: tokens, positions, segments, token_types [T] -> hidden [T, hidden]."""
        attend = PackedAttention(segments, positions, causal=False, scale=self.cfg.head_dim**-0.5,
                                 max_segment=max_segment)
        return self.hidden_states(tokens[None], positions[None], attend, token_types[None])[0]

    def __call__(self, tokens: Array, positions: Array, segments: Array, pool_rows: Array, token_types: Array,
                 max_segment: int | None = None) -> Array:
        """One packed step: tokens, positions, segments, token_types [T]; pool_rows [S] (each
        sequence's first token) -> float32 logits [S, num_labels]. max_segment: the longest input
        (static)."""
        hidden = self.packed_hidden_states(tokens, positions, segments, token_types, max_segment)
        return self.head(hidden[pool_rows])
