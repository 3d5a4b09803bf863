"""A tiny random-init LLaVA-OneVision checkpoint, saved as a server loads one: safetensors (HF's
own save_pretrained), preprocessor_config.json, a word-level tokenizer with `<image>`, and a
chat template that writes `<image>` for image parts (as the llava-hf templates do).

SigLIP tower of 60-pixel tiles of 4x4 patches of 14 (like SigLIP-so400m, 60 is no multiple of 14),
a Qwen2 language model, anyres grids of up to 3 tiles and anyres_max_2 (so the bilinear shrink runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tiny_models import randomize_weights

TILE = 60
PINPOINTS = [[h * TILE, w * TILE] for h, w in [[1, 1], [1, 2], [2, 1], [2, 2], [1, 3], [3, 1]]]
VOCAB = 128
IMAGE_TOKEN = 127
WORDS = {**{f"w{i}": i for i in range(124)}, "user": 124, "assistant": 125, "<video>": 126, "<image>": IMAGE_TOKEN}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} "
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def make_tiny_llava(directory: Path, seed: int = 0):
    """Build, randomise and save the checkpoint; returns the float32 HF model."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    torch.manual_seed(seed)
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(image_size=TILE, patch_size=14, hidden_size=32, intermediate_size=48,
                                         num_attention_heads=4, num_hidden_layers=2),
        text_config=Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024,
                                tie_word_embeddings=False, eos_token_id=2),
        image_grid_pinpoints=PINPOINTS, vision_aspect_ratio="anyres_max_2", image_token_index=IMAGE_TOKEN,
        video_token_index=126, tie_word_embeddings=False)
    model = LlavaOnevisionForConditionalGeneration(config).float().eval()
    randomize_weights(model)  # everything random, so a misplaced weight shows
    model.save_pretrained(directory, safe_serialization=True)
    processor = LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS,
                                                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor.save_pretrained(directory)
    _save_tokenizer(directory)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return model


def _save_tokenizer(directory: Path, words: dict[str, int] = WORDS,
                    specials: tuple[str, ...] = ("<image>", "<video>")) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", bos_token="w1",
                                 additional_special_tokens=list(specials))
    hf.save_pretrained(directory)


def hf_processor():
    """HF's image processor of the checkpoint (PIL backend)."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    return LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS,
                                           image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def random_image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


# ---- Qwen2.5-VL ----------------------------------------------------------------------------------
QWEN_IMAGE_TOKEN, QWEN_VISION_START, QWEN_VISION_END = 124, 125, 126
QWEN_WORDS = {**{f"w{i}": i for i in range(120)}, "user": 120, "assistant": 121, "<|video_pad|>": 123,
              "<|image_pad|>": QWEN_IMAGE_TOKEN, "<|vision_start|>": QWEN_VISION_START,
              "<|vision_end|>": QWEN_VISION_END}
# Qwen's own template writes <|vision_start|><|image_pad|><|vision_end|> for an image part.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} "
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
# Small images: 56x56 .. 112x112 pixels (4x4 .. 8x8 patches).
QWEN_PREPROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2,
                     "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711]}


def make_tiny_qwen_vl(directory: Path, seed: int = 0):
    """A tiny Qwen2.5-VL (window attention of 2x2 merged tokens, M-RoPE sections [2, 3, 3]) saved
    with its processor config, tokenizer and chat template; returns the float32 HF model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        vision_config={"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                       "window_size": 56, "fullatt_block_indexes": [1, 3]},
        text_config={"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2,
                     "max_position_embeddings": 1024, "tie_word_embeddings": False,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}},
        image_token_id=QWEN_IMAGE_TOKEN, video_token_id=123, vision_start_token_id=QWEN_VISION_START,
        vision_end_token_id=QWEN_VISION_END, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if p.ndim == 1 else min(0.15, p[0].numel() ** -0.5)
            p.copy_(torch.randn(p.shape) * scale + (1.0 if "norm" in name or "ln_q" in name else 0.0))
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN_PREPROCESSOR))
    _save_tokenizer(directory, QWEN_WORDS, ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_CHAT_TEMPLATE}))
    return model


def qwen_hf_inputs(images: list, **bounds: int) -> dict:
    """HF's Qwen2-VL image processor output (PIL backend) for `images`; bounds: min_pixels /
    max_pixels other than the tiny model's."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    limits = {**QWEN_PREPROCESSOR, **bounds}
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": limits["min_pixels"],
                                               "longest_edge": limits["max_pixels"]})
    return processor(images=images, return_tensors="pt")


# ---- shared by the parity, engine and server tests -------------------------------------------------
def data_url(image: Image.Image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def expand_prompt(support, prompt: list[int], images: list[Image.Image]):
    """The server's path for a prompt's images: loaded, preprocessed, placeholders expanded."""
    import asyncio

    return asyncio.run(support.load_into(prompt, [(data_url(im), "image") for im in images], "image"))


def hf_image_kwargs(family: str, ids: list[int], images: list[Image.Image], **bounds: int) -> dict:
    """The image arguments HF's model takes for `ids` with `images` (none for text alone);
    bounds: as qwen_hf_inputs'."""
    if not images:
        return {}
    if family == "qwen":
        inputs = qwen_hf_inputs(images, **bounds)
        # HF 5.17 computes M-RoPE positions only when given the processor's mm_token_type_ids (1: image).
        return {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"],
                "mm_token_type_ids": torch.tensor([[int(t == QWEN_IMAGE_TOKEN) for t in ids]])}
    if family == "next":
        inputs = next_processor()(images=images, return_tensors="pt")
        return {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]}
    inputs = hf_processor()(images=[images], return_tensors="pt")
    return {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"],
            "batch_num_images": torch.tensor([len(images)])}


def hf_greedy(hf, family: str, ids: list[int], images: list[Image.Image], n: int, **bounds: int) -> list[int]:
    """HF's greedy continuation of exactly n tokens (bounds: as qwen_hf_inputs')."""
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          **hf_image_kwargs(family, ids, images, **bounds))
    return out[0, len(ids):].tolist()


# ---- LLaVA-NeXT ----------------------------------------------------------------------------------
NEXT_TILE = 56  # CLIP tiles of 4x4 patches of 14, the second-to-last layer's features without CLS
NEXT_PINPOINTS = [[h * NEXT_TILE, w * NEXT_TILE] for h, w in [[1, 1], [1, 2], [2, 1], [2, 2], [1, 3], [3, 1]]]


def make_tiny_llava_next(directory: Path, seed: int = 0):
    """A tiny LLaVA-NeXT (CLIP tower + Llama) saved with its processor config, the LLaVA tokenizer
    and chat template; returns the float32 HF model."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(image_size=NEXT_TILE, patch_size=14, hidden_size=32, intermediate_size=48,
                                       num_attention_heads=4, num_hidden_layers=3, projection_dim=16),
        text_config=LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024,
                                tie_word_embeddings=False, eos_token_id=2),
        image_grid_pinpoints=NEXT_PINPOINTS, vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_token_index=IMAGE_TOKEN, tie_word_embeddings=False)
    model = LlavaNextForConditionalGeneration(config).float().eval()
    randomize_weights(model)
    model.save_pretrained(directory, safe_serialization=True)
    next_processor().save_pretrained(directory)
    _save_tokenizer(directory)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return model


def next_processor():
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil(size={"shortest_edge": NEXT_TILE},
                                      crop_size={"height": NEXT_TILE, "width": NEXT_TILE},
                                      image_grid_pinpoints=NEXT_PINPOINTS)
