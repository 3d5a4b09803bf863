"""One Flax NNX decoder for the Llama, Mistral, Qwen2, Qwen3 and Gemma2 families.

The layers are loaded stacked (every layer parameter has a leading [num_layers] axis) and run with
`jax.lax.scan`, so a 30-layer model compiles one layer body instead of thirty: start-up compiles
every bucket ahead of time, and compile time is what users wait for. But a scan reads each
layer's weights through a dynamic slice, and XLA on CPUs and GPUs copies that slice out before the
matmuls read it: every weight is read, written and read again on every step (measured on an H100:
the Llama-3-8B decode step at 3.3x its memory floor, its scratch exactly one layer's weights).
`unstack_layers()` moves the weights into one buffer per layer, and the layers then run as an
unrolled loop that reads each buffer in place: the copy is gone (SmolLM2's decode scratch drops
from 14.2 MB, one layer, to 1.6 MB), at the price of compiling every layer. On the CPU that buys
nothing (decode there is not bound by the copy) and costs 5-10x the compile time; on a GPU, where
decode is bound by weight traffic, it is the candidate fix, not yet measured on one (see
`--layer-loop` in `jaxserve.engine.engine`).

Attention is a function passed in by the caller. The full no-cache forward (`dense_attention`) is
the reference used by the parity tests; the engine passes a paged-KV-cache attention with the
same signature, so both paths share every projection, norm and RoPE line below.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models import products
from jaxserve.models.config import DecoderConfig

Array = jax.Array


class AttentionFn(Protocol):
    """Attend q to k/v for one layer.

    q: [batch, tokens, q_heads, head_dim]; k, v: [batch, tokens, kv_heads, head_dim];
    cache: the caller's whole cache pytree, carried through the layer scan (None for the dense
    forward) -- whole, not sliced per layer, so writes and reads index the layer inside one
    scatter/gather and the cache buffer is updated in place instead of copied layer by layer;
    window: sliding window of this layer (0 = full) and layer: its index, traced int32 scalars.
    Returns ([batch, tokens, q_heads, head_dim], new cache).
    """

    def __call__(self, q: Array, k: Array, v: Array, cache: Any, window: Array, layer: Array) -> tuple[Array, Any]: ...


def _zeros(stack: tuple[int, ...], *shape: int, dtype: Any) -> nnx.Param:
    # Weights always come from a checkpoint, so zeros is as good an initial value as any and the
    # abstract (eval_shape) construction used by the loaders allocates nothing.
    return nnx.Param(jnp.zeros((*stack, *shape), dtype))


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, bias: bool, dtype: Any, stack: tuple[int, ...] = ()):
        self.kernel = _zeros(stack, din, dout, dtype=dtype)  # [din, dout]
        self.bias = _zeros(stack, dout, dtype=dtype) if bias else None

    def __call__(self, x: Array) -> Array:
        y = products.current().linear(x, self.kernel[...])
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, offset: float, dtype: Any, stack: tuple[int, ...] = ()):
        self.weight = _zeros(stack, dim, dtype=dtype)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: Array) -> Array:
        # Normalise in float32 as HF does; Gemma scales by (1 + w) in float32, Llama casts back
        # before scaling by w. Matching the order matters for bfloat16 parity.
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * h.astype(x.dtype)


def rope_inv_freq(cfg: DecoderConfig) -> Array:
    """Inverse frequencies [head_dim // 2], with llama3 / linear scaling applied."""
    rope = cfg.rope
    dim = cfg.head_dim
    inv = 1.0 / (rope.theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
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


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotate-half RoPE (HF layout). x: [batch, tokens, heads, head_dim]; positions: [batch, tokens]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, tokens, head_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _activation(name: str) -> Callable[[Array], Array]:
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, dtype: Any, stack: tuple[int, ...]):
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_heads * d, cfg.qkv_bias, dtype, stack)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, stack)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, stack)
        self.o_proj = Linear(cfg.num_heads * d, h, cfg.o_bias, dtype, stack)
        norm = lambda: RMSNorm(d, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype, stack)  # noqa: E731
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def qkv(self, x: Array, positions: Array, inv_freq: Array) -> tuple[Array, Array, Array]:
        """Project and rotate: q [b, t, q_heads, d], k and v [b, t, kv_heads, d]."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def __call__(
        self, x: Array, positions: Array, inv_freq: Array, attend: AttentionFn, cache: Any, window: Array, layer: Array
    ) -> tuple[Array, Any]:
        q, k, v = self.qkv(x, positions, inv_freq)
        out, cache = attend(q, k, v, cache, window, layer)
        b, t = x.shape[:2]
        return self.o_proj(out.reshape(b, t, -1).astype(x.dtype)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, dtype: Any, stack: tuple[int, ...]):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, cfg.mlp_bias, dtype, stack)
        self.up_proj = Linear(h, i, cfg.mlp_bias, dtype, stack)
        self.down_proj = Linear(i, h, cfg.mlp_bias, dtype, stack)
        self.act_name = cfg.hidden_act

    def __call__(self, x: Array) -> Array:
        return self.down_proj(_activation(self.act_name)(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DecoderConfig, dtype: Any, stack: tuple[int, ...] = ()):
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype, stack)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, dtype, stack)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg, dtype, stack)
        # Gemma2's "sandwich": post_attention_layernorm normalises the attention output and two
        # more norms wrap the MLP; in Llama post_attention_layernorm is the pre-MLP norm.
        self.pre_feedforward_layernorm = norm() if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if cfg.sandwich_norms else None

    def __call__(
        self, x: Array, positions: Array, inv_freq: Array, attend: AttentionFn, cache: Any, window: Array, layer: Array
    ) -> tuple[Array, Any]:
        h, cache = self.self_attn(self.input_layernorm(x), positions, inv_freq, attend, cache, window, layer)
        if self.pre_feedforward_layernorm is None:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x)), cache
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), cache


class Decoder(nnx.Module):
    """Decoder-only LM. Parameters mirror HF names so weight maps stay one-to-one."""

    def __init__(self, cfg: DecoderConfig, dtype: Any = jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = _zeros((), cfg.vocab_size, cfg.hidden_size, dtype=dtype)  # [vocab, hidden]
        self.layers = DecoderLayer(cfg, dtype, stack=(cfg.num_layers,))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset, dtype)
        # [vocab, hidden], HF's own orientation, so a tied head is the embedding itself.
        self.lm_head = None if cfg.tie_word_embeddings else _zeros((), cfg.vocab_size, cfg.hidden_size, dtype=dtype)

    def embed(self, tokens: Array) -> Array:
        x = jnp.take(self.embed_tokens[...], tokens, axis=0)
        if self.cfg.embed_scale != 1.0:
            # HF multiplies by the scale rounded to the activation dtype.
            x = x * jnp.asarray(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def hidden_states(self, tokens: Array, positions: Array, attend: AttentionFn, cache: Any = None) -> tuple[Array, Any]:
        """Run every layer. tokens, positions: [batch, tokens]. cache: any pytree `attend`
        understands (or None), carried through the layers. Returns final-normed hidden
        [b, t, hidden] and the new cache."""
        x = self.embed(tokens)
        inv_freq = rope_inv_freq(self.cfg)
        if self.layers is None:  # unstacked: one buffer per layer, read in place
            for i, (layer, window) in enumerate(zip(self.layer_list, self.cfg.windows())):
                x, cache = layer(x, positions, inv_freq, attend, cache, jnp.int32(window), jnp.int32(i))
            return self.norm(x), cache
        windows = jnp.asarray(self.cfg.windows(), jnp.int32)
        graphdef, layer_state = nnx.split(self.layers)

        def body(carry: tuple[Array, Any], per_layer: tuple[Any, Array, Array]) -> tuple[tuple[Array, Any], None]:
            h, cache = carry
            state, window, index = per_layer
            layer = nnx.merge(graphdef, state)
            return layer(h, positions, inv_freq, attend, cache, window, index), None

        layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (layer_state, windows, layer_ids))
        return self.norm(x), cache

    @property
    def unstacked(self) -> bool:
        return self.layers is None

    def unstack_layers(self) -> None:
        """Move the stacked layer weights into one buffer per layer (in place; idempotent). Each
        buffer keeps the stacked array's sharding minus the layer axis, and each stacked array is
        freed as soon as its slices exist, so at most one parameter is ever held twice."""
        if self.layers is None:
            return
        graphdef, stacked = nnx.split(self.layers)
        paths_leaves = jax.tree_util.tree_flatten_with_path(stacked)[0]
        treedef = jax.tree_util.tree_structure(stacked)
        per_layer: list[list[Array]] = [[] for _ in range(self.cfg.num_layers)]
        for _, leaf in paths_leaves:
            take = _layer_taker(leaf.shape, leaf.dtype, leaf.sharding)
            for i in range(self.cfg.num_layers):
                per_layer[i].append(take(leaf, jnp.int32(i)))
            leaf.delete()
        self.layer_list = nnx.List(
            [nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves)) for leaves in per_layer])
        self.layers = None

    def logits(self, hidden: Array) -> Array:
        """[..., hidden] -> float32 [..., vocab], with Gemma2's final soft-cap."""
        head = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
        out = products.current().head(hidden, head).astype(jnp.float32)
        cap = self.cfg.final_logit_softcap
        return out if not cap else jnp.tanh(out / cap) * cap

    def __call__(self, tokens: Array, positions: Array, lengths: Array) -> Array:
        """Full no-cache forward (the reference): right-padded [batch, tokens] -> logits."""
        attend = dense_attention(positions, lengths, self.cfg)
        hidden, _ = self.hidden_states(tokens, positions, attend)
        return self.logits(hidden)


def _layer_taker(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> Callable[[Array, Array], Array]:
    """A jitted `a[i]` along the layer axis whose result keeps `sharding` minus that axis."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec)
        out = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
    else:
        out = sharding
    return jax.jit(lambda a, i: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), out_shardings=out)


def dense_attention(positions: Array, lengths: Array, cfg: DecoderConfig) -> AttentionFn:
    """Causal attention over the batch's own tokens (no cache); keys past `lengths` are masked."""
    t = positions.shape[1]
    valid_k = jnp.arange(t)[None, :] < lengths[:, None]  # [b, t_k]
    q_pos, k_pos = positions[:, :, None], positions[:, None, :]

    def attend(q: Array, k: Array, v: Array, cache: Any, window: Array, layer: Array) -> tuple[Array, Any]:
        mask = (k_pos <= q_pos) & valid_k[:, None, :]
        mask &= (window == 0) | (q_pos - k_pos < window)
        return grouped_attention(q, k, v, mask, cfg.scale, cfg.attn_logit_softcap), cache

    return attend


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
