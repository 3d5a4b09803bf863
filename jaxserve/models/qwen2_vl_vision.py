"""Qwen2.5-VL's vision encoder (HF's Qwen2_5_VisionTransformerPretrainedModel) as a Flax NNX
module with static shapes.

The encoder reads the patch rows of one or more images (jaxserve.multimodal.qwen2_vl_processing),
embeds each patch (HF's Conv3d, whose stride equals its kernel, is one matmul), and runs `depth`
pre-norm blocks: most attend inside windows of window_size pixels, the blocks at
fullatt_block_indexes across a whole frame. A final PatchMerger turns each merge_size x merge_size
block of patches into one token of the language model's width.

HF attends over variable-length pieces (cu_seqlens). Here one call has a bucketed patch count P,
and the pieces are segment ids computed on the host (`vision_layout`): a query sees the keys of its
own segment only, so padding (segment -1) sees nothing and several images never see each other.
HF also reorders the tokens so every window is contiguous (window_index) and undoes it after the
merger; the host gives that permutation too, so the device only gathers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxserve.models.layers import Linear, RMSNorm, run_layers, zeros_param
from jaxserve.models.packed_attention import PackedAttention

Array = jax.Array
Grid = tuple[int, int, int]  # (t, h, w) in patches

__all__ = ["Qwen2VisionTransformer", "VisionConfig", "VisionLayout", "vision_config_from_hf", "vision_layout"]

NORM_EPS = 1e-6  # HF hard-codes the vision RMSNorms' epsilon


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the language model's hidden size
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112  # in pixels
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per language-model token."""
        return self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        """Values in one patch row: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merger_window(self) -> int:
        """A window's side in merged tokens (HF's vit_merger_window_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def window_patches(self) -> int:
        """The most patches one window holds."""
        return self.merger_window**2 * self.merge_unit


def vision_config_from_hf(config: dict[str, Any]) -> VisionConfig:
    """The vision_config of a Qwen2_5_VLForConditionalGeneration config.json (or that dict itself).
    The Hub's files name the channels in_chans; transformers 5.x writes in_channels."""
    v = config.get("vision_config", config)
    rope = v.get("rope_parameters") or {}
    merge = int(v.get("spatial_merge_size", 2))
    patch = int(v.get("patch_size", v.get("spatial_patch_size", 14)))
    window = int(v.get("window_size", 112))
    if window // merge // patch < 1:
        raise ValueError(f"vision window_size {window} is smaller than one merged token ({merge} x {patch} pixels)")
    if v["hidden_size"] % v["num_heads"] or (v["hidden_size"] // v["num_heads"]) % 4:
        raise ValueError(f"vision hidden_size {v['hidden_size']} must split into {v['num_heads']} heads of a "
                         "multiple of 4 (the 2D rotary rotates height and width halves)")
    return VisionConfig(
        depth=int(v["depth"]),
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]),
        out_hidden_size=int(v["out_hidden_size"]),
        patch_size=patch,
        spatial_merge_size=merge,
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        window_size=window,
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        hidden_act=str(v.get("hidden_act", "silu")),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
    )


# ---- host: the layout of one call ---------------------------------------------------------------


@struct.dataclass
class VisionLayout:
    """What one encode call needs besides the pixels, computed on the host (NumPy arrays; a pytree,
    so it passes through jit). P is the call's bucketed patch count, U = merge_unit.

    Window order is HF's: each window's tokens contiguous, windows row-major inside each frame,
    frames and images in input order. The padding tail stays where it is."""

    window_index: Any  # int32 [P // U]: the merged token (input order) at each window-order slot
    reverse_index: Any  # int32 [P // U]: its inverse, applied to the merger's output
    window_segments: Any  # int32 [P], window order: one id per window, -1 for padding
    full_segments: Any  # int32 [P], window order: one id per frame of each image, -1 for padding
    rope_positions: Any  # int32 [P, 2], window order: each patch's (row, column) in its frame


def vision_layout(cfg: VisionConfig, grids: Sequence[Grid], num_patches: int) -> VisionLayout:
    """The layout for images of `grids` ((t, h, w) patches each, in order) padded to `num_patches`
    (the bucket: a multiple of merge_unit, at least their patches). Raises ValueError otherwise."""
    m, unit, win = cfg.spatial_merge_size, cfg.merge_unit, cfg.merger_window
    total = sum(t * h * w for t, h, w in grids)
    if num_patches % unit or num_patches < total:
        raise ValueError(f"a bucket of {num_patches} patches cannot hold {total} (it must be a multiple of "
                         f"{unit} and at least the images' patches)")
    index, window_seg, full_seg, rope = [], [], [], []
    offset, windows, frames = 0, 0, 0  # merged tokens, windows and frames so far
    for t, h, w in grids:
        if h % m or w % m:
            raise ValueError(f"grid {(t, h, w)} is not a whole number of {m}x{m} patch blocks")
        gh, gw = h // m, w // m
        # HF pads each frame up to whole windows (a full extra window when it already divides;
        # those windows are empty and vanish) and walks the windows row-major.
        nh, nw = gh // win + 1, gw // win + 1
        tokens = np.full((t, nh * win, nw * win), -1, np.int64)
        tokens[:, :gh, :gw] = np.arange(t * gh * gw).reshape(t, gh, gw)
        tokens = tokens.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
        sizes = (tokens >= 0).sum(-1)  # [t, windows]
        order = tokens[tokens >= 0]
        index.append(order + offset)
        live = sizes.reshape(-1)[sizes.reshape(-1) > 0]
        window_seg.append(np.repeat(np.arange(windows, windows + len(live)), live * unit))
        windows += len(live)
        full_seg.append(np.repeat(np.arange(frames, frames + t), gh * gw * unit))
        frames += t
        # Each merged token's patches in its frame, in the processor's order (block-major).
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = lambda a: a.reshape(gh, m, gw, m).transpose(0, 2, 1, 3).reshape(gh * gw, unit)  # noqa: E731
        rc = np.stack([blocks(rows), blocks(cols)], axis=-1)  # [gh * gw, unit, 2]
        rope.append(np.tile(rc, (t, 1, 1))[order].reshape(-1, 2))
        offset += t * gh * gw
    pad_tokens = num_patches // unit - offset
    window_index = np.concatenate([*index, np.arange(offset, offset + pad_tokens)]).astype(np.int32)
    pad = np.full(num_patches - total, -1, np.int32)
    return VisionLayout(
        window_index=window_index,
        reverse_index=np.argsort(window_index).astype(np.int32),
        window_segments=np.concatenate([*window_seg, pad]).astype(np.int32),
        full_segments=np.concatenate([*full_seg, pad]).astype(np.int32),
        rope_positions=np.concatenate([*rope, np.zeros((num_patches - total, 2), np.int64)]).astype(np.int32),
    )


# ---- device: the encoder ------------------------------------------------------------------------


def _activation(name: str) -> Callable[[Array], Array]:
    acts = {
        "silu": jax.nn.silu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    }
    if name not in acts:
        raise ValueError(f"vision hidden_act {name!r} is not one of {sorted(acts)}")
    return acts[name]


def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE in float32, cast back (HF's apply_rotary_pos_emb_vision). x [t, heads, d];
    cos, sin [t, 1, d]."""
    h = x.astype(jnp.float32)
    half = h.shape[-1] // 2
    rotated = jnp.concatenate([-h[..., half:], h[..., :half]], axis=-1)
    return (h * cos + rotated * sin).astype(x.dtype)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype: Any):
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, True, dtype)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, True, dtype)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def __call__(self, x: Array, rope: tuple[Array, Array], attend: PackedAttention) -> Array:
        t = x.shape[0]
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(t, 3, self.num_heads, self.head_dim), 1, 0)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        zero = jnp.int32(0)
        out, _ = attend(q[None], k[None], v[None], None, zero, zero)  # [1, t, heads, d]
        return self.proj(out[0].reshape(t, -1).astype(x.dtype))


class VisionMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype: Any):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, True, dtype)
        self.up_proj = Linear(h, i, True, dtype)
        self.down_proj = Linear(i, h, True, dtype)
        self.act_name = cfg.hidden_act

    def __call__(self, x: Array) -> Array:
        return self.down_proj(_activation(self.act_name)(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype: Any, full: bool):
        self.norm1 = RMSNorm(cfg.hidden_size, NORM_EPS, 0.0, dtype)
        self.norm2 = RMSNorm(cfg.hidden_size, NORM_EPS, 0.0, dtype)
        self.attn = VisionAttention(cfg, dtype)
        self.mlp = VisionMLP(cfg, dtype)
        # Static: a full-attention block attends per frame, the others per window (whose length
        # bounds the keys a query block must read).
        self.full = full
        self.max_segment = None if full else cfg.window_patches
        self.scale = cfg.head_dim**-0.5

    def __call__(self, x: Array, rope: tuple[Array, Array], layout: VisionLayout) -> Array:
        segments = layout.full_segments if self.full else layout.window_segments
        # Non-causal attention reads no positions; the segments stand in for them.
        attend = PackedAttention(segments, segments, causal=False, scale=self.scale, max_segment=self.max_segment)
        x = x + self.attn(self.norm1(x), rope, attend)
        return x + self.mlp(self.norm2(x))


def _block_body(block: VisionBlock, x: Array, shared: tuple[tuple[Array, Array], VisionLayout],
                per_layer: Any) -> Array:
    rope, layout = shared
    return block(x, rope, layout)


class PatchMerger(nnx.Module):
    """RMSNorm each patch, concatenate a merge block's patches, then Linear-GELU-Linear (HF's
    merger.mlp.0 and merger.mlp.2: `fc1`, `fc2`)."""

    def __init__(self, cfg: VisionConfig, dtype: Any):
        width = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size, NORM_EPS, 0.0, dtype)
        self.fc1 = Linear(width, width, True, dtype)
        self.fc2 = Linear(width, cfg.out_hidden_size, True, dtype)
        self.width = width

    def __call__(self, x: Array) -> Array:
        h = self.ln_q(x).reshape(-1, self.width)
        return self.fc2(jax.nn.gelu(self.fc1(h), approximate=False))


class Qwen2VisionTransformer(nnx.Module):
    """Qwen2.5-VL's vision encoder. Parameters mirror HF's names under `visual.` (the merger's
    mlp.0 / mlp.2 are fc1 / fc2; the patch embedding keeps Conv3d's [hidden, C, T, p, p])."""

    def __init__(self, cfg: VisionConfig, dtype: Any = jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        # [hidden, channels, temporal, patch, patch]: HF's Conv3d weight as stored.
        self.patch_embed = zeros_param(cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                       cfg.patch_size, dtype=dtype)
        full = set(cfg.fullatt_block_indexes)
        self.blocks = nnx.List([VisionBlock(cfg, dtype, i in full) for i in range(cfg.depth)])
        self.merger = PatchMerger(cfg, dtype)

    def rope(self, positions: Array) -> tuple[Array, Array]:
        """float32 (cos, sin) [P, 1, head_dim] for (row, column) positions [P, 2]: the first quarter
        of the frequencies rotates by row, the second by column, and the half repeats."""
        quarter = self.cfg.head_dim // 4
        inv_freq = 1.0 / (self.cfg.rope_theta ** (jnp.arange(0, 2 * quarter, 2, dtype=jnp.float32) / (2 * quarter)))
        freqs = (positions.astype(jnp.float32)[:, :, None] * inv_freq).reshape(positions.shape[0], -1)  # [P, d/2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
        return jnp.cos(emb), jnp.sin(emb)

    def encode(self, pixel_values: Array, layout: VisionLayout) -> Array:
        """pixel_values [P, patch_dim] (the images' rows in order, then padding) -> language-model
        embeddings [P // merge_unit, out_hidden_size] in input order: image i's tokens follow
        image i-1's, and rows past the images' tokens are padding."""
        cfg = self.cfg
        num_patches, unit = pixel_values.shape[0], cfg.merge_unit
        kernel = self.patch_embed[...].reshape(cfg.hidden_size, -1)  # [hidden, patch_dim]
        x = jnp.dot(pixel_values.astype(self.dtype), kernel.T)  # [P, hidden]
        x = x.reshape(num_patches // unit, unit, -1)[layout.window_index].reshape(num_patches, -1)
        rope = self.rope(jnp.asarray(layout.rope_positions))
        x = run_layers(self.blocks, _block_body, x, (rope, layout), [None] * cfg.depth)
        return self.merger(x)[layout.reverse_index]

    def __call__(self, pixel_values: Array, layout: VisionLayout) -> Array:
        return self.encode(pixel_values, layout)
