"""Image-token throughput of LLaVA-OneVision's vision step, on the current device.

    python -m benchmarks.vision [--preset onevision-0.5b|onevision-7b|tiny] [--images N]
                                [--dtype float32|bfloat16] [--sizes 384x384,1000x700,...] [--buckets 1,4]

The model is the preset's config.json as llava-hf publishes it (onevision-0.5b:
llava-hf/llava-onevision-qwen2-0.5b-ov-hf, onevision-7b: its 7B sibling; both a SigLIP-so400m
tower of 26 layers read at its last, 384-pixel tiles of 27x27 patches, anyres_max_9 over the 36
default pinpoints, a projector to the text model's 896 / 3584) with random weights
(jaxserve.weights.vision_loader.random_vision) in --dtype (default: bfloat16, or float32 on a CPU
without bfloat16 dot products, as the server picks). `tiny` is a 2-layer toy of 60-pixel tiles for
the tests. Set JAX_PLATFORMS=cpu to force the CPU.

Each --sizes entry (WIDTHxHEIGHT in pixels) is a random-noise RGB image run --images times through
the server's path, the median reported:

  preprocess  LlavaImageProcessor.preprocess on the host (PIL resizes, tiling, normalizing)
  encode      the vision tower + projector: LlavaEncoder's compiled program per tile bucket (1, 2,
              4, 8 tiles; an image of more tiles runs several calls), each call timed to completion
  pack        the rest of LlavaEncoder.encode on the host: padding the tiles to the bucket,
              reading the features back and pack_image_features (unpad, OneVision's bilinear
              shrink past 9 tiles' worth, newlines)
  tokens/s    the image's placeholder tokens over preprocess + encode + pack

The encoder's cache is off, so every run encodes. Every bucket is compiled before timing, then one
untimed image (the size of fewest tiles) warms the path up. A second table gives the tower alone
per bucket: the median of every call made for that bucket (the images' calls, plus --images calls
on random tiles for each of --buckets), tiles/s counting the padding tiles the call computes, and
the FLOP rate that implies (matrix products and attention only).

On the idle 2-core AMD EPYC CPU box (benchmarks/RESULTS.md) a 384-pixel tile takes ~2 s in
bfloat16 (~3.4 s in float32), and the default run (two sizes, 2 and 7 tiles, 3 images each)
takes ~1.5 minutes; a 1920x1080 image is 16 tiles (two calls of 8, 7,269 tokens), ~37 s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

_PINPOINTS = [[384 * h, 384 * w] for h in range(1, 7) for w in range(1, 7)]
_SIGLIP_SO400M = {"hidden_size": 1152, "image_size": 384, "intermediate_size": 4304,
                  "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 26,
                  "patch_size": 14, "vision_use_head": False}
_ONEVISION = {
    "architectures": ["LlavaOnevisionForConditionalGeneration"], "model_type": "llava_onevision",
    "image_grid_pinpoints": _PINPOINTS, "image_token_index": 151646, "video_token_index": 151647,
    "projector_hidden_act": "gelu", "use_image_newline_parameter": True,
    "vision_aspect_ratio": "anyres_max_9", "vision_config": _SIGLIP_SO400M, "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
}  # fmt: skip
_ONEVISION_PREPROCESSOR = {
    "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
    "image_grid_pinpoints": _PINPOINTS, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "LlavaOnevisionImageProcessor", "resample": 3,
    "rescale_factor": 0.00392156862745098, "size": {"height": 384, "width": 384},
}  # fmt: skip
_TINY_PINPOINTS = [[60 * h, 60 * w] for h in range(1, 7) for w in range(1, 7)]

# preset -> (config.json, preprocessor_config.json, default --sizes). Of the text model only its
# hidden size matters here (the projector's output); its other keys are Qwen2's, for the record.
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "onevision-0.5b": (dict(_ONEVISION, text_config={
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2}),
        _ONEVISION_PREPROCESSOR, "384x384,1000x700"),
    "onevision-7b": (dict(_ONEVISION, text_config={
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4}),
        _ONEVISION_PREPROCESSOR, "384x384,1000x700"),
    "tiny": (dict(_ONEVISION, image_grid_pinpoints=_TINY_PINPOINTS, text_config={"hidden_size": 48},
                  vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 60,
                                 "patch_size": 14}),
             dict(_ONEVISION_PREPROCESSOR, image_grid_pinpoints=_TINY_PINPOINTS, size={"height": 60, "width": 60}),
             "60x60,150x100,400x250"),
}  # fmt: skip


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """Parse "384x384,1000x700" into [(width, height), ...]."""
    sizes = []
    for part in text.split(","):
        try:
            width, height = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"image size {part!r} is not WIDTHxHEIGHT") from None
        if width < 1 or height < 1:
            raise ValueError(f"image size {part!r} must be positive")
        sizes.append((width, height))
    return sizes


def tile_flops(cfg: Any) -> float:
    """Floating-point operations of one tile through the tower and projector: matrix products
    and attention's two products (norms, activations and softmax left out)."""
    t, h, i = cfg.num_positions, cfg.hidden_size, cfg.intermediate_size
    patch = 2 * t * cfg.num_channels * cfg.patch_size**2 * h
    layer = 2 * t * (4 * h * h + 2 * h * i) + 4 * t * t * h
    d = cfg.text_hidden_size
    projector = 2 * cfg.tokens_per_tile * (h * len(cfg.feature_layers) * d + d * d)
    return patch + cfg.num_layers_used * layer + projector


class _TimedProgram:
    """A compiled tile-bucket program that records how long each call takes to finish."""

    def __init__(self, program: Any, bucket: int, calls: list[tuple[int, float]]):
        self.program, self.bucket, self.calls = program, bucket, calls

    def __call__(self, params: Any, pixels: Any) -> Any:
        start = time.perf_counter()
        out = self.program(params, pixels)
        out.block_until_ready()
        self.calls.append((self.bucket, time.perf_counter() - start))
        return out


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="onevision-0.5b", choices=list(PRESETS))
    p.add_argument("--images", type=int, default=3, help="timed images per size (the median is reported)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16, float32 on a CPU without bfloat16 dot products")
    p.add_argument("--sizes", default=None, help="WIDTHxHEIGHT,... (default: the preset's)")
    p.add_argument("--buckets", default="", help="also time the tower alone on these buckets, e.g. 1,4")
    args = p.parse_args(argv)
    if args.images < 1:
        p.error("--images must be >= 1")
    config, preprocessor, default_sizes = PRESETS[args.preset]
    try:
        sizes = parse_sizes(args.sizes or default_sizes)
        extra_buckets = sorted({int(b) for b in args.buckets.split(",") if b.strip()})
    except ValueError as e:
        p.error(str(e))

    import jax
    import jax.numpy as jnp
    import numpy as np
    from PIL import Image

    from jaxserve.engine.buckets import powers_of_two
    from jaxserve.engine.embeds import ImageItem
    from jaxserve.engine.vision_encoder import MAX_TILE_BUCKET, LlavaEncoder
    from jaxserve.models.vision import vision_config_from_hf
    from jaxserve.multimodal.llava_processing import LlavaImageProcessor
    from jaxserve.weights.loader import cpu_has_native_bf16
    from jaxserve.weights.vision_loader import random_vision

    buckets = powers_of_two(1, MAX_TILE_BUCKET)
    bad = [b for b in extra_buckets if b not in buckets]
    if bad:
        p.error(f"--buckets {bad}: the encoder's buckets are {list(buckets)}")
    platform = jax.default_backend()
    dtype = args.dtype or ("bfloat16" if platform != "cpu" or cpu_has_native_bf16() else "float32")
    cfg = vision_config_from_hf(config)
    processor = LlavaImageProcessor.from_hf(preprocessor, config)
    start = time.perf_counter()
    model = random_vision(cfg, jnp.dtype(dtype))
    init_s = time.perf_counter() - start
    encoder = LlavaEncoder(model, cache_bytes=0)  # no cache: every image runs the tower
    compile_s = encoder.compile()
    calls: list[tuple[int, float]] = []
    encoder._programs = {b: _TimedProgram(prog, b, calls) for b, prog in encoder._programs.items()}
    print(f"# {args.preset} {dtype} on {platform} ({jax.devices()[0].device_kind}): {cfg.num_layers_used} layers, "
          f"{cfg.image_size}-pixel tiles of {cfg.tokens_per_tile} tokens, text hidden {cfg.text_hidden_size}; "
          f"random weights in {init_s:.1f} s, buckets {list(encoder.buckets)} compiled in "
          f"{sum(compile_s.values()):.1f} s", flush=True)

    rng = np.random.default_rng(0)
    images = {size: Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for size in sizes}

    def run(size: tuple[int, int], index: int) -> dict[str, Any]:
        image = images[size]
        start = time.perf_counter()
        data = processor.preprocess(image)
        preprocess = time.perf_counter() - start
        first = len(calls)
        start = time.perf_counter()
        embeds = encoder.encode(ImageItem(0, data.num_tokens, f"{size}-{index}", data))
        encode_total = time.perf_counter() - start
        mine = calls[first:]
        if embeds.shape[0] != data.num_tokens:
            raise RuntimeError(f"{size}: the encoder packed {embeds.shape[0]} rows for {data.num_tokens} tokens")
        tower = sum(s for _, s in mine)
        return {"tiles": len(data.pixel_values), "calls": "+".join(str(b) for b, _ in mine),
                "tokens": data.num_tokens, "preprocess": preprocess, "encode": tower, "pack": encode_total - tower}

    warm = min(sizes, key=lambda s: len(processor.preprocess(images[s]).pixel_values))
    run(warm, -1)
    del calls[:]

    rows = []
    for size in sizes:
        runs = [run(size, i) for i in range(args.images)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("preprocess", "encode", "pack")}
        total = sum(med.values())
        rows.append({"size": f"{size[0]}x{size[1]}", "tiles": runs[0]["tiles"], "calls": runs[0]["calls"],
                     "tokens": runs[0]["tokens"], "preprocess_ms": 1e3 * med["preprocess"],
                     "encode_ms": 1e3 * med["encode"], "pack_ms": 1e3 * med["pack"], "total_ms": 1e3 * total,
                     "tokens_per_s": runs[0]["tokens"] / total})
        print(f"# {rows[-1]['size']}: {rows[-1]['total_ms']:.0f} ms, {rows[-1]['tokens_per_s']:.1f} tokens/s",
              flush=True)
    for bucket in extra_buckets:
        pixels = rng.standard_normal((bucket, cfg.num_channels, cfg.image_size, cfg.image_size)).astype(np.float32)
        for _ in range(args.images):
            encoder._programs[bucket](encoder.params, pixels)

    flops = tile_flops(cfg)
    towers = []
    for bucket in sorted({b for b, _ in calls}):
        seconds = [s for b, s in calls if b == bucket]
        ms = _median_ms(seconds)
        towers.append({"bucket": bucket, "calls": len(seconds), "ms": ms, "ms_per_tile": ms / bucket,
                       "tiles_per_s": bucket / ms * 1e3, "gflops": flops * bucket / ms / 1e6})

    print("\n| image (WxH) | tiles | bucket calls | image tokens | preprocess ms | encode ms | pack ms | total ms "
          "| image tokens/s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['tiles']} | {r['calls']} | {r['tokens']:,} | {r['preprocess_ms']:,.1f} "
              f"| {r['encode_ms']:,.1f} | {r['pack_ms']:,.1f} | {r['total_ms']:,.1f} | {r['tokens_per_s']:,.1f} |")
    print("\n| bucket (tiles) | calls | ms per call | ms per tile | tiles/s | GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t in towers:
        print(f"| {t['bucket']} | {t['calls']} | {t['ms']:,.1f} | {t['ms_per_tile']:,.1f} | {t['tiles_per_s']:,.2f} "
              f"| {t['gflops']:,.1f} |")
    print(f"\n{flops / 1e9:.4g} GFLOP per tile; compile s per bucket: "
          + ", ".join(f"{b}: {s:.1f}" for b, s in compile_s.items()))
    return {"dtype": dtype, "platform": platform, "images": rows, "tower": towers, "compile_s": compile_s,
            "init_s": init_s}


if __name__ == "__main__":
    main()
