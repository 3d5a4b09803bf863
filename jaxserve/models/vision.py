"""The image side of LLaVA-OneVision (a SigLIP tower) and LLaVA-NeXT (a CLIP tower), as Flax NNX: the
vision tower up to the feature layer the language model reads, the multimodal projector, and the
`image_newline` embedding; plus the host-side packing of one image's tile features into the rows
that replace its `<image>` tokens.

An image reaches the model as tiles of image_size x image_size (the HF image processor makes
them): a base tile (the whole image resized) and, for "anyres", the tiles of the best grid
resolution. `VisionModel.encode_tiles` encodes any batch of tiles independently (attention never
crosses tiles, so padding tiles only cost compute); `pack_image_features` then lays one image's
tiles out on its grid, cuts the letterbox padding, OneVision-downsamples, and appends a newline
per row -- on the host, because those shapes depend on each image's size.

Parameters mirror HF names (jaxserve.weights.vision_loader maps them one to one). HF takes the
features from `hidden_states[vision_feature_layer]`, the output of a layer *before* SigLIP's
post_layernorm, so layers past the deepest selected one, SigLIP's post_layernorm and pooling
head, and CLIP's post_layernorm are never built.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import products
from jaxserve.models.bert import LayerNorm
from jaxserve.models.config import UnsupportedModelError
from jaxserve.models.layers import Linear, run_layers, zeros_param
from jaxserve.multimodal.llava_processing import select_best_resolution

Array = jax.Array

# architecture -> (vision config model_type when config.json leaves it out, that config when the
# whole vision_config is left out: the defaults of HF's config class)
VISION_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlavaOnevisionForConditionalGeneration": ("siglip_vision_model", dict(
        hidden_size=1152, intermediate_size=4304, patch_size=14, image_size=384, num_hidden_layers=26,
        num_attention_heads=16)),
    "LlavaNextForConditionalGeneration": ("clip_vision_model", dict(
        intermediate_size=4096, hidden_size=1024, patch_size=14, image_size=336, num_hidden_layers=24,
        num_attention_heads=16)),
}
_MODEL_TYPES = {"llava_onevision": "LlavaOnevisionForConditionalGeneration",
                "llava_next": "LlavaNextForConditionalGeneration"}
# transformers writes config.json as a diff against these class defaults, so a key may be absent.
_TOP_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlavaOnevisionForConditionalGeneration": dict(
        image_token_index=151646, projector_hidden_act="gelu", vision_feature_select_strategy="full",
        vision_feature_layer=-1, multimodal_projector_bias=True, vision_aspect_ratio="anyres_max_9",
        image_grid_pinpoints=[[h, w] for h in range(384, 2305, 384) for w in range(384, 2305, 384)]),
    "LlavaNextForConditionalGeneration": dict(
        image_token_index=32000, projector_hidden_act="gelu", vision_feature_select_strategy="default",
        vision_feature_layer=-2, multimodal_projector_bias=True, vision_aspect_ratio=None,
        image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]),
}
# vision model_type -> (tower, defaults of its HF config class)
_TOWERS: dict[str, tuple[str, dict[str, Any]]] = {
    "siglip_vision_model": ("siglip", dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3,
        image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)),
    "clip_vision_model": ("clip", dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3,
        image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)),
}

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    architecture: str
    tower: str  # siglip | clip (CLIP adds a class token and pre_layrnorm)
    hidden_size: int
    intermediate_size: int
    num_layers: int  # the checkpoint's tower; only num_layers_used are built
    num_heads: int
    image_size: int  # a tile's side in pixels
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    # HF's vision_feature_layer as a tuple: hidden_states indices (0 = the embeddings, i = after
    # layer i, negative from the end), their features concatenated in this order.
    feature_layers: tuple[int, ...]
    select_strategy: str  # "default" drops the first token (CLIP's class token); "full" keeps all
    projector_hidden_act: str
    projector_bias: bool
    text_hidden_size: int
    image_grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width) in pixels
    vision_aspect_ratio: str | None  # OneVision's "anyres_max_9"; None for NeXT (no downsampling)
    image_token_index: int
    num_channels: int = 3
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        return self.patches_per_side**2 + (self.tower == "clip")

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """feature_layers as indices into HF's hidden_states (num_layers + 1 entries)."""
        return tuple(i if i >= 0 else i + self.num_layers + 1 for i in self.feature_layers)

    @property
    def num_layers_used(self) -> int:
        return max(self.hidden_state_indices)

    @property
    def tokens_per_tile(self) -> int:
        return self.num_positions - (self.select_strategy == "default")

    @property
    def max_num_patches(self) -> int | None:
        """OneVision's anyres_max_N: N, the most base tiles' worth of features an image keeps."""
        if self.vision_aspect_ratio is None:
            return None
        # HF parses it with str.strip, which strips a character set, not a prefix.
        return int(self.vision_aspect_ratio.strip("anyres_max_"))


def _get(cfg: dict[str, Any], key: str, defaults: dict[str, Any]) -> Any:
    value = cfg.get(key)
    return defaults.get(key) if value is None else value


def _side(value: Any, what: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise UnsupportedModelError(f"vision_config.{what}={value}: only square tiles and patches are supported")
        value = value[0]
    return int(value)


def vision_config_from_hf(config: dict[str, Any]) -> VisionConfig | None:
    """The image side of a LLaVA-OneVision / LLaVA-NeXT config.json, or None for any other model.
    Raises UnsupportedModelError naming what this port cannot run."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in VISION_ARCHITECTURES), _MODEL_TYPES.get(config.get("model_type", "")))
    if arch is None:
        return None
    top = _TOP_DEFAULTS[arch]
    default_type, default_vision = VISION_ARCHITECTURES[arch]
    vision = dict(config.get("vision_config") or default_vision)
    model_type = vision.get("model_type") or default_type
    if model_type not in _TOWERS:
        raise UnsupportedModelError(f"vision tower {model_type!r} is not supported (supported: {', '.join(_TOWERS)})")
    tower, tower_defaults = _TOWERS[model_type]
    hidden = int(_get(vision, "hidden_size", tower_defaults))
    heads = int(_get(vision, "num_attention_heads", tower_defaults))
    if hidden % heads:
        raise UnsupportedModelError(f"vision hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    act = _get(vision, "hidden_act", tower_defaults)
    projector_act = _get(config, "projector_hidden_act", top)
    for name in (act, projector_act):
        if name not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    layers = _get(config, "vision_feature_layer", top)
    strategy = _get(config, "vision_feature_select_strategy", top)
    if strategy not in ("default", "full"):
        raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not one of default, full")
    aspect = _get(config, "vision_aspect_ratio", top) if arch == "LlavaOnevisionForConditionalGeneration" else None
    text = config.get("text_config") or {}
    token = config.get("image_token_index", config.get("image_token_id"))
    cfg = VisionConfig(
        architecture=arch,
        tower=tower,
        hidden_size=hidden,
        intermediate_size=int(_get(vision, "intermediate_size", tower_defaults)),
        num_layers=int(_get(vision, "num_hidden_layers", tower_defaults)),
        num_heads=heads,
        image_size=_side(_get(vision, "image_size", tower_defaults), "image_size"),
        patch_size=_side(_get(vision, "patch_size", tower_defaults), "patch_size"),
        layer_norm_eps=float(_get(vision, "layer_norm_eps", tower_defaults)),
        hidden_act=act,
        feature_layers=tuple(int(i) for i in layers) if isinstance(layers, (list, tuple)) else (int(layers),),
        select_strategy=strategy,
        projector_hidden_act=projector_act,
        projector_bias=bool(_get(config, "multimodal_projector_bias", top)),
        text_hidden_size=int(text.get("hidden_size") or 4096),
        image_grid_pinpoints=tuple((int(h), int(w)) for h, w in _get(config, "image_grid_pinpoints", top)),
        vision_aspect_ratio=aspect,
        image_token_index=int(top["image_token_index"] if token is None else token),
        num_channels=int(_get(vision, "num_channels", tower_defaults)),
        dtype=str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "float32"),
    )
    _check(cfg)
    return cfg


def _check(cfg: VisionConfig) -> None:
    if not cfg.feature_layers or any(not 0 <= i <= cfg.num_layers for i in cfg.hidden_state_indices):
        raise UnsupportedModelError(f"vision_feature_layer {list(cfg.feature_layers)} is outside the tower's "
                                    f"{cfg.num_layers + 1} hidden states")
    # HF lays a tile's features out as a patches_per_side square; with CLIP's class token kept, or a
    # SigLIP patch dropped, that view is wrong (HF raises for SigLIP and scrambles CLIP's).
    if cfg.tokens_per_tile != cfg.patches_per_side**2:
        raise UnsupportedModelError(f"vision_feature_select_strategy {cfg.select_strategy!r} with a {cfg.tower} tower "
                                    f"leaves {cfg.tokens_per_tile} features per tile, not a "
                                    f"{cfg.patches_per_side}x{cfg.patches_per_side} grid")
    odd = [p for p in cfg.image_grid_pinpoints if p[0] % cfg.image_size or p[1] % cfg.image_size]
    if odd:
        raise UnsupportedModelError(f"image_grid_pinpoints {odd} are not multiples of the tile size {cfg.image_size}")
    if cfg.vision_aspect_ratio is not None:
        try:
            ok = cfg.max_num_patches > 0
        except ValueError:
            ok = False
        if not ok:
            raise UnsupportedModelError(f"vision_aspect_ratio {cfg.vision_aspect_ratio!r} is not anyres_max_<N>")


# ---- the tower -----------------------------------------------------------------------------------
class PatchEmbedding(nnx.Module):
    """The stride-p convolution as one product over each patch's pixels (channel, row, column). Its
    padding is "valid": a tile whose side is no multiple of p loses its last pixels (SigLIP-so400m
    reads 27x27 patches of 14 from a 384-pixel tile, ignoring the last 6 rows and columns)."""

    def __init__(self, cfg: VisionConfig, dtype: Any):
        p = cfg.patch_size
        self.weight = zeros_param(cfg.hidden_size, cfg.num_channels, p, p, dtype=dtype)  # the conv's own layout
        self.bias = zeros_param(cfg.hidden_size, dtype=dtype) if cfg.tower == "siglip" else None
        self.patch_size = p

    def __call__(self, pixels: Array) -> Array:
        """[tiles, channels, H, W] -> [tiles, patches, hidden], patches in row-major order."""
        p = self.patch_size
        n, c, h, w = pixels.shape
        h, w = h // p, w // p
        x = pixels[:, :, :h * p, :w * p].reshape(n, c, h, p, w, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, -1, c * p * p)
        kernel = self.weight[...].reshape(self.weight.shape[0], -1).T  # [c*p*p, hidden]
        y = products.linear(x.astype(kernel.dtype), kernel)
        return y if self.bias is None else y + self.bias[...]


class Embeddings(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype: Any):
        self.patch_embedding = PatchEmbedding(cfg, dtype)
        self.position_embedding = zeros_param(cfg.num_positions, cfg.hidden_size, dtype=dtype)  # [positions, hidden]
        self.class_embedding = zeros_param(cfg.hidden_size, dtype=dtype) if cfg.tower == "clip" else None

    def __call__(self, pixels: Array) -> Array:
        x = self.patch_embedding(pixels)  # [tiles, patches, hidden]
        if self.class_embedding is not None:
            cls = jnp.broadcast_to(self.class_embedding[...], (x.shape[0], 1, x.shape[-1]))
            x = jnp.concatenate([cls.astype(x.dtype), x], axis=1)
        return x + self.position_embedding[...]


class Attention(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype: Any):
        h = cfg.hidden_size
        self.q_proj = Linear(h, h, True, dtype)
        self.k_proj = Linear(h, h, True, dtype)
        self.v_proj = Linear(h, h, True, dtype)
        self.out_proj = Linear(h, h, True, dtype)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def __call__(self, x: Array) -> Array:
        """Full bidirectional attention within each tile. x: [tiles, tokens, hidden]."""
        n, t, _ = x.shape
        split = lambda y: y.reshape(n, t, self.num_heads, self.head_dim)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        s = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * self.head_dim**-0.5
        p = jax.nn.softmax(s, axis=-1)  # float32, as HF's eager attention
        out = jnp.einsum("nhqk,nkhd->nqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return self.out_proj(out.reshape(n, t, -1).astype(x.dtype))


class MLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype: Any):
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, True, dtype)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, True, dtype)
        self.act = cfg.hidden_act

    def __call__(self, x: Array) -> Array:
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class EncoderLayer(nnx.Module):
    """Pre-norm: x += attn(norm1(x)); x += mlp(norm2(x)) -- the same in SigLIP and CLIP."""

    def __init__(self, cfg: VisionConfig, dtype: Any):
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def __call__(self, x: Array) -> Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


def _layer_body(layer: EncoderLayer, x: Array, shared: Any, per_layer: Any) -> Array:
    return layer(x)


class Projector(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype: Any):
        din = cfg.hidden_size * len(cfg.feature_layers)  # the selected layers' features, concatenated
        self.linear_1 = Linear(din, cfg.text_hidden_size, cfg.projector_bias, dtype)
        self.linear_2 = Linear(cfg.text_hidden_size, cfg.text_hidden_size, cfg.projector_bias, dtype)
        self.act = cfg.projector_hidden_act

    def __call__(self, x: Array) -> Array:
        return self.linear_2(ACTIVATIONS[self.act](self.linear_1(x)))


class VisionModel(nnx.Module):
    """Vision tower (up to the deepest feature layer), projector and image_newline."""

    def __init__(self, cfg: VisionConfig, dtype: Any = jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embeddings = Embeddings(cfg, dtype)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype) if cfg.tower == "clip" else None
        self.layers = nnx.List([EncoderLayer(cfg, dtype) for _ in range(cfg.num_layers_used)])
        self.multi_modal_projector = Projector(cfg, dtype)
        self.image_newline = zeros_param(cfg.text_hidden_size, dtype=dtype)  # [text_hidden]

    def encode_tiles(self, pixel_values: Array) -> Array:
        """[tiles, channels, image_size, image_size] -> [tiles, tokens_per_tile, text_hidden]. Tiles
        never see each other, so a batch may be padded with any tiles (their rows are ignored)."""
        x = self.embeddings(pixel_values.astype(self.dtype))
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        layers = list(self.layers)
        states, done = {0: x}, 0
        for index in sorted(set(self.cfg.hidden_state_indices) - {0}):
            x = run_layers(layers[done:index], _layer_body, x, (), [()] * (index - done))
            states[index], done = x, index
        features = jnp.concatenate([states[i] for i in self.cfg.hidden_state_indices], axis=-1)
        if self.cfg.select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)


# ---- packing one image's tiles (host side) -------------------------------------------------------
def anyres_grid_shape(image_size: tuple[int, int], cfg: VisionConfig) -> tuple[int, int]:
    """(rows, columns) of tiles an image of `image_size` (height, width) is cut into, besides its base tile."""
    h, w = select_best_resolution(image_size, cfg.image_grid_pinpoints)
    return h // cfg.image_size, w // cfg.image_size


def num_tiles(image_size: tuple[int, int], cfg: VisionConfig, multi_image: bool = False) -> int:
    """Tiles the image processor makes of one image: the base tile and its grid; only the base
    tile when the prompt holds several images (OneVision's multi-image mode)."""
    if multi_image:
        return 1
    rows, cols = anyres_grid_shape(image_size, cfg)
    return 1 + rows * cols


def unpad(grid: np.ndarray, image_size: tuple[int, int]) -> np.ndarray:
    """Cut the letterbox padding the processor added around the image: grid [channels, H, W]."""
    height, width = image_size
    _, h, w = grid.shape
    if width / height > w / h:
        new_h = int(round(height * (w / width), 7))
        pad = (h - new_h) // 2
        return grid[:, pad:h - pad, :]
    new_w = int(round(width * (h / height), 7))
    pad = (w - new_w) // 2
    return grid[:, :, pad:w - pad]


def _linear_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # torch's upsample_bilinear2d (align_corners=False, no scale factor), in float32 as its CPU
    # kernel computes it: source = (dst + 0.5) * in/out - 0.5, clamped at 0.
    f32 = np.float32
    scale = f32(in_size) / f32(out_size)
    src = np.maximum(scale * (np.arange(out_size, dtype=f32) + f32(0.5)) - f32(0.5), f32(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    lam = np.clip(src - i0.astype(f32), f32(0), f32(1))
    return i0, np.minimum(i0 + 1, in_size - 1), (f32(1) - lam), lam


def bilinear_resize(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """torch.nn.functional.interpolate(x[None], [height, width], mode="bilinear")[0] for x
    [channels, H, W], computed in float32."""
    x = np.asarray(x, np.float32)
    h0, h1, a0, a1 = _linear_taps(x.shape[1], height)
    w0, w1, b0, b1 = _linear_taps(x.shape[2], width)

    def along_w(rows: np.ndarray) -> np.ndarray:
        return b0 * rows[:, :, w0] + b1 * rows[:, :, w1]

    return a0[:, None] * along_w(x[:, h0]) + a1[:, None] * along_w(x[:, h1])


def pack_image_features(tile_features: np.ndarray, image_size: tuple[int, int], image_newline: np.ndarray,
                        cfg: VisionConfig) -> np.ndarray:
    """One image's rows for its <image> tokens, as HF's pack_image_features: tile_features
    [tiles, tokens_per_tile, text_hidden] (the base tile first, then the grid row by row, as the
    processor orders them), image_size (height, width) of the original image -> [rows, text_hidden].

    One tile (OneVision's multi-image mode): its features and one newline. Otherwise the base
    tile's features, then the grid's feature map unpadded to the image's aspect ratio, bilinearly
    shrunk (OneVision) when it holds more than 1.1^2 x anyres_max base tiles' worth, with a
    newline closing every row."""
    dtype = tile_features.dtype
    newline = np.asarray(image_newline, dtype)
    if tile_features.shape[0] == 1:
        return np.concatenate([tile_features[0], newline[None]], axis=0)
    base, tiles = tile_features[0], tile_features[1:]
    side = cfg.patches_per_side
    rows, cols = anyres_grid_shape(image_size, cfg)
    if base.shape[0] != side * side or tiles.shape[0] != rows * cols:
        raise ValueError(f"an image of {tuple(image_size)} takes 1 + {rows}x{cols} tiles of {side * side} features, "
                         f"got {tile_features.shape[0]} tiles of {tile_features.shape[1]}")
    dim = tiles.shape[-1]
    # [rows, cols, side, side, dim] -> [dim, rows*side, cols*side]: the tiles' patches on one map.
    grid = tiles.reshape(rows, cols, side, side, dim).transpose(4, 0, 2, 1, 3).reshape(dim, rows * side, cols * side)
    grid = unpad(grid, image_size)
    if cfg.max_num_patches is not None:
        _, h, w = grid.shape
        ratio = math.sqrt(h * w / (cfg.max_num_patches * side**2))
        if ratio > 1.1:
            grid = bilinear_resize(grid, int(h // ratio), int(w // ratio)).astype(dtype)
    _, h, w = grid.shape
    grid = np.concatenate([grid, np.broadcast_to(newline[:, None, None], (dim, h, 1))], axis=-1)
    return np.concatenate([base, grid.reshape(dim, -1).T], axis=0)


__all__ = ["VisionConfig", "VisionModel", "anyres_grid_shape", "bilinear_resize", "num_tiles",
           "pack_image_features", "select_best_resolution", "unpad", "vision_config_from_hf"]
