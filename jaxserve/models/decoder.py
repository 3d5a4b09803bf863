"""One Flax NNX decoder for the Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3 and Phi-3/Phi-4 families.

Every layer holds its own parameter buffers (`layers` is an `nnx.List`) and the layers run as an
unrolled loop (`jaxserve.models.layers.run_layers`), so each weight is read in place by the
products that use it.

Attention is an object passed in by the caller (`AttentionFn`): a pytree whose arrays describe
the step (positions, page tables, ...) and whose call attends one layer. The full no-cache
forward (`DenseAttention`) is the reference used by the parity tests; the engine passes a
paged-KV-cache attention (`jaxserve.engine.attention.PagedAttention`), so both paths share every
projection, norm and RoPE line below.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxserve.models import products
from jaxserve.models.config import DecoderConfig, RopeConfig
from jaxserve.models.layers import Linear, RMSNorm, activation, run_layers, zeros_param
from jaxserve.models.moe import SparseMoe

Array = jax.Array

__all__ = ["AttentionFn", "Decoder", "DecoderLayer", "DenseAttention", "Linear", "RMSNorm", "grouped_attention"]


class AttentionFn(Protocol):
    """Attend q to k/v for one layer; a pytree (its arrays cross the per-layer jit boundary).

    q: [batch, tokens, q_heads, head_dim]; k, v: [batch, tokens, kv_heads, head_dim];
    cache: the caller's whole cache pytree, carried through the layers (None for the dense
    forward) -- whole, not sliced per layer, so writes and reads index the layer inside one
    scatter/gather and the cache buffer is updated in place instead of copied layer by layer;
    window: sliding window of this layer (0 = full) and layer: its index, int32 scalars.
    Returns ([batch, tokens, q_heads, head_dim], new cache).
    """

    def __call__(self, q: Array, k: Array, v: Array, cache: Any, window: Array, layer: Array) -> tuple[Array, Any]: ...


def rope_inv_freq(cfg: DecoderConfig, rope: RopeConfig | None = None, long: bool = False) -> Array:
    """Inverse frequencies [rotary // 2] of `rope` (default: cfg.rope), with llama3 / linear
    scaling applied; LongRoPE's short factors, or with `long` its long ones."""
    rope = rope or cfg.rope
    dim = cfg.rotary
    inv = 1.0 / (rope.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if rope.kind == "longrope":
        return inv / jnp.asarray(rope.long_factor if long else rope.short_factor, jnp.float32)
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * jnp.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(is_medium, smoothed, scaled)
    return inv


def rope_tables(positions: Array, inv_freq: Array, dtype: Any,
                mrope_section: tuple[int, ...] = ()) -> tuple[Array, Array]:
    """(cos, sin) [batch, tokens, 1, head_dim] in `dtype`, for `apply_rope`. Computed once per
    step and shared by every layer. positions: [batch, tokens], or with mrope_section (M-RoPE)
    [batch, tokens, 3]: (temporal, height, width), consecutive sections of the frequencies
    reading one axis each (section j: axis j % 3, as HF's Qwen2.5-VL)."""
    if mrope_section:
        axes = jnp.asarray([j % 3 for j, size in enumerate(mrope_section) for _ in range(size)])
        pos = jnp.take(positions.astype(jnp.float32), axes, axis=-1)  # [batch, tokens, head_dim/2]
        freqs = pos * inv_freq
    else:
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, tokens, head_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: Array, rope: tuple[Array, Array]) -> Array:
    """Rotate-half RoPE (HF layout). x: [batch, tokens, heads, head_dim]; rope: `rope_tables`,
    whose width is the rotated part: tables narrower than head_dim (partial rotary) rotate the
    leading dimensions and pass the rest."""
    cos, sin = rope
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :width], rope), x[..., width:]], axis=-1)
    half = width // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, dtype: Any):
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_heads * d, cfg.qkv_bias, dtype)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype)
        self.o_proj = Linear(cfg.num_heads * d, h, cfg.o_bias, dtype)
        norm = lambda: RMSNorm(d, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype)  # noqa: E731
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def qkv(self, x: Array, rope: tuple[Array, Array], lora_mask: Array | None = None) -> tuple[Array, Array, Array]:
        """Project and rotate: q [b, t, q_heads, d], k and v [b, t, kv_heads, d]."""
        b, t, _ = x.shape
        q = self.q_proj(x, lora_mask).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x, lora_mask).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, lora_mask).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def __call__(self, x: Array, rope: tuple[Array, Array], attend: AttentionFn, cache: Any, window: Array,
                 layer: Array, lora_mask: Array | None = None) -> tuple[Array, Any]:
        q, k, v = self.qkv(x, rope, lora_mask)
        out, cache = attend(q, k, v, cache, window, layer)
        b, t = x.shape[:2]
        return self.o_proj(out.reshape(b, t, -1).astype(x.dtype), lora_mask), cache


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, dtype: Any, width: int | None = None):
        h, i = cfg.hidden_size, width or cfg.intermediate_size
        self.gate_proj = Linear(h, i, cfg.mlp_bias, dtype)
        self.up_proj = Linear(h, i, cfg.mlp_bias, dtype)
        self.down_proj = Linear(i, h, cfg.mlp_bias, dtype)
        self.act_name = cfg.hidden_act

    def __call__(self, x: Array, lora_mask: Array | None = None) -> Array:
        act = activation(self.act_name)
        return self.down_proj(act(self.gate_proj(x, lora_mask)) * self.up_proj(x, lora_mask), lora_mask)


def _sparse_mlp(cfg: DecoderConfig, dtype: Any) -> SparseMoe:
    moe = cfg.moe
    shared = MLP(cfg, dtype, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
    return SparseMoe(cfg, dtype, shared)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DecoderConfig, dtype: Any, index: int = 0):
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = norm()
        # A mixture-of-experts model's sparse layers route each token to its experts.
        self.mlp = _sparse_mlp(cfg, dtype) if cfg.is_sparse(index) else MLP(cfg, dtype)
        # Gemma2's "sandwich": post_attention_layernorm normalises the attention output and two
        # more norms wrap the MLP; in Llama post_attention_layernorm is the pre-MLP norm.
        self.pre_feedforward_layernorm = norm() if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if cfg.sandwich_norms else None

    def __call__(self, x: Array, rope: tuple[Array, Array], attend: AttentionFn, cache: Any, window: Array,
                 layer: Array, lora_mask: Array | None = None) -> tuple[Array, Any]:
        h, cache = self.self_attn(self.input_layernorm(x), rope, attend, cache, window, layer, lora_mask)
        if self.pre_feedforward_layernorm is None:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x), lora_mask), cache
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), lora_mask)), cache


def _layer_body(layer: DecoderLayer, carry: tuple[Array, Any], shared: tuple[AttentionFn, Array | None],
                per_layer: tuple[Array, Array, tuple[Array, Array]]) -> tuple[Array, Any]:
    x, cache = carry
    attend, lora_mask = shared
    window, index, rope = per_layer
    return layer(x, rope, attend, cache, window, index, lora_mask)


class Decoder(nnx.Module):
    """Decoder-only LM. Parameters mirror HF names so weight maps stay one-to-one."""

    def __init__(self, cfg: DecoderConfig, dtype: Any = jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = zeros_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)  # [vocab, hidden]
        self.layers = nnx.List([DecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype)
        # [vocab, hidden], HF's own orientation, so a tied head is the embedding itself.
        self.lm_head = None if cfg.tie_word_embeddings else zeros_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        # LoRA adapter slots and their rank (jaxserve.models.lora.add_lora_slots); 0: none.
        self.lora_slots = 0
        self.lora_rank = 0

    def embed(self, tokens: Array) -> Array:
        x = products.rows(self.embed_tokens.get_value(), tokens, self.dtype)
        if self.cfg.embed_scale != 1.0:
            # HF multiplies by the scale rounded to the activation dtype.
            x = x * jnp.asarray(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def hidden_states(self, tokens: Array, positions: Array, attend: AttentionFn, cache: Any = None,
                      embeds: tuple[Array, Array] | None = None,
                      rope_positions: Array | None = None, lora_slots: Array | None = None,
                      long_rope: Array | None = None) -> tuple[Array, Any]:
        """Run every layer. tokens, positions: [batch, tokens]. cache: any pytree `attend`
        understands (or None), carried through the layers. embeds: (values [b, t, hidden], mask
        [b, t]): where mask is set the input is the given embedding (an image's, or the client's
        input_embeds), taken as it is (no embedding scale, as HF's inputs_embeds). Returns
        final-normed hidden [b, t, hidden] and the new cache. rope_positions: an M-RoPE model's
        [b, t, 3] positions (which, unlike `positions`, the masks and the cache never read);
        None: every axis at `positions`. lora_slots: [b, t] each token's LoRA adapter slot (-1 or
        None: the base model). long_rope: [b, t] whether each token rotates by LongRoPE's long
        factors (a LongRoPE model; None: the short ones)."""
        x = self.embed(tokens)
        if embeds is not None:
            values, mask = embeds
            x = jnp.where(mask[..., None], values.astype(x.dtype), x)
        if self.cfg.mrope_section and rope_positions is None:
            rope_positions = jnp.repeat(positions[..., None], 3, axis=-1)
        rope = rope_tables(positions if rope_positions is None else rope_positions, rope_inv_freq(self.cfg), x.dtype,
                           self.cfg.mrope_section)
        if self.cfg.rope.kind == "longrope":
            rope = self._longrope(positions, rope, long_rope, x.dtype)
        # Each layer is handed its RoPE tables: Gemma3's sliding-window layers rotate by their own.
        local = rope
        if self.cfg.local_rope is not None:
            local = rope_tables(positions, rope_inv_freq(self.cfg, self.cfg.local_rope), x.dtype)
        per_layer = [(jnp.int32(window), jnp.int32(i), local if window else rope)
                     for i, window in enumerate(self.cfg.windows())]
        lora_mask = None
        if self.lora_slots and lora_slots is not None:
            from jaxserve.models.lora import token_mask

            lora_mask = token_mask(lora_slots, self.lora_slots, self.lora_rank, x.dtype)
        x, cache = run_layers(self.layers, _layer_body, (x, cache), (attend, lora_mask), per_layer)
        return self.norm(x), cache

    def _longrope(self, positions: Array, short: tuple[Array, Array], long_rope: Array | None,
                  dtype: Any) -> tuple[Array, Array]:
        """LongRoPE's tables: each token's from the long factors where long_rope [b, t] is set, the
        short ones elsewhere, both scaled by the attention factor (HF's Phi3 rotary embedding)."""
        rope = self.cfg.rope
        if long_rope is not None:
            long = rope_tables(positions, rope_inv_freq(self.cfg, long=True), dtype)
            pick = long_rope[:, :, None, None]
            short = (jnp.where(pick, long[0], short[0]), jnp.where(pick, long[1], short[1]))
        scale = jnp.asarray(rope.attention_factor, dtype)
        return short[0] * scale, short[1] * scale

    @property
    def head_path(self) -> tuple[str, ...]:
        """The parameter the LM head multiplies by: the embedding when they are tied."""
        return ("embed_tokens",) if self.lm_head is None else ("lm_head",)

    def logits(self, hidden: Array) -> Array:
        """[..., hidden] -> float32 [..., vocab], with Gemma2's final soft-cap."""
        head = (self.embed_tokens if self.lm_head is None else self.lm_head).get_value()
        out = products.head(hidden, head).astype(jnp.float32)
        cap = self.cfg.final_logit_softcap
        return out if not cap else jnp.tanh(out / cap) * cap

    def __call__(self, tokens: Array, positions: Array, lengths: Array,
                 embeds: tuple[Array, Array] | None = None, rope_positions: Array | None = None,
                 lora_slots: Array | None = None) -> Array:
        """Full no-cache forward (the reference): right-padded [batch, tokens] -> logits."""
        attend = DenseAttention(positions, lengths, scale=self.cfg.scale, softcap=self.cfg.attn_logit_softcap)
        long_rope = None
        if self.cfg.rope.kind == "longrope":
            # As HF's one forward: long factors for a sequence longer than original_max_position.
            last = jnp.take_along_axis(positions, jnp.maximum(lengths - 1, 0)[:, None], axis=1)
            long_rope = jnp.broadcast_to(last + 1 > self.cfg.rope.original_max_position, positions.shape)
        hidden, _ = self.hidden_states(tokens, positions, attend, embeds=embeds, rope_positions=rope_positions,
                                       lora_slots=lora_slots, long_rope=long_rope)
        return self.logits(hidden)


@struct.dataclass
class DenseAttention:
    """Causal attention over the batch's own tokens (no cache); keys past `lengths` are masked."""

    positions: Array  # [b, t]
    lengths: Array  # [b]
    scale: float = struct.field(pytree_node=False)
    softcap: float | None = struct.field(pytree_node=False, default=None)

    def __call__(self, q: Array, k: Array, v: Array, cache: Any, window: Array, layer: Array) -> tuple[Array, Any]:
        t = self.positions.shape[1]
        valid_k = jnp.arange(t)[None, :] < self.lengths[:, None]  # [b, t_k]
        q_pos, k_pos = self.positions[:, :, None], self.positions[:, None, :]
        mask = (k_pos <= q_pos) & valid_k[:, None, :]
        mask &= (window == 0) | (q_pos - k_pos < window)
        return grouped_attention(q, k, v, mask, self.scale, self.softcap), cache


def grouped_attention(q: Array, k: Array, v: Array, mask: Array, scale: float, softcap: float | None) -> Array:
    """GQA attention with float32 softmax. q [b, tq, hq, d]; k, v [b, tk, hkv, d]; mask [b, tq, tk]."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, tq, hkv, hq // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    # A fully masked row (padding queries) gives NaN from softmax; zero it so it cannot spread.
    p = jnp.where(mask[:, None, None].any(-1, keepdims=True), p, 0.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, hq, d)
