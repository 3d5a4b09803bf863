"""Tiny random-weight chat models of the Qwen3 and Llama-3.1 families, with their real chat templates.

End-to-end tests of tool calling and reasoning need what a real checkpoint ships and a toy one
lacks: the family's own chat template (Qwen3's `<tool_call>` / `<think>` / `enable_thinking`,
Llama-3.1's JSON tool calls, `ipython` role and `<|eom_id|>`) and a tokenizer in which the
family's markers are single tokens, with the family's special/non-special split (Qwen3's tool and
think tags are plain added tokens that structured output sees as text; Llama-3.1's are special
control tokens). Real checkpoints are far too large for the tests, so this builds the same shape
in miniature: SmolLM2's byte-level BPE tokenizer (already cached by the test suite) plus the
family's added tokens and verbatim template (tests/data/chat_templates/), and a 2-layer,
64-wide model with random weights. Building one takes a few seconds and is deterministic.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import transformers
from tiny_classifiers import randomize

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FAMILIES = ("qwen3", "llama3.1")

# SmolLM2's vocabulary: 49152 ids, <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2 (all special).
_BASE_VOCAB = 49152
_ENDOFTEXT, _IM_START, _IM_END = 0, 1, 2

# Tokens added to SmolLM2's, in order (ids from _BASE_VOCAB on), and whether they are special.
# Qwen3's real tokenizer has <tool_call>, <think>, ... as added tokens with special=False;
# Llama-3.1's header, turn and tool tokens are special.
_ADDED: dict[str, tuple[tuple[str, bool], ...]] = {
    "qwen3": tuple((t, False) for t in ("<tool_call>", "</tool_call>", "<think>", "</think>",
                                        "<tool_response>", "</tool_response>")),
    "llama3.1": tuple((t, True) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                          "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")),
}

# Every added token with its id (make_tiny_chat_model checks these against the saved tokenizer),
# plus Qwen3's turn tokens, which SmolLM2 already has.
MARKERS: dict[str, dict[str, int]] = {
    "qwen3": {"<|im_start|>": _IM_START, "<|im_end|>": _IM_END,
              **{t: _BASE_VOCAB + i for i, (t, _) in enumerate(_ADDED["qwen3"])}},
    "llama3.1": {t: _BASE_VOCAB + i for i, (t, _) in enumerate(_ADDED["llama3.1"])},
}

# Token roles, as the real checkpoints set them. Qwen3: no BOS in the tokenizer, EOS <|im_end|>,
# PAD <|endoftext|>; config.json's bos is <|endoftext|>, generation stops at <|im_end|> or
# <|endoftext|>. Llama-3.1: BOS <|begin_of_text|>, EOS <|eot_id|>; generation_config.json stops at
# <|end_of_text|>, <|eom_id|> or <|eot_id|>.
_TOKENS: dict[str, dict[str, str | None]] = {
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3.1": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": None},
}
_LLAMA = MARKERS["llama3.1"]
_IDS: dict[str, dict[str, int | list[int] | None]] = {
    "qwen3": {"bos_token_id": _ENDOFTEXT, "eos_token_id": _IM_END, "pad_token_id": _ENDOFTEXT,
              "generation_eos": [_IM_END, _ENDOFTEXT]},
    "llama3.1": {"bos_token_id": _LLAMA["<|begin_of_text|>"], "eos_token_id": _LLAMA["<|eot_id|>"],
                 "pad_token_id": None,
                 "generation_eos": [_LLAMA["<|end_of_text|>"], _LLAMA["<|eom_id|>"], _LLAMA["<|eot_id|>"]]},
}

_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "tie_word_embeddings": True}
_CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "qwen3": ("Qwen3Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # Llama-3.1's own rope scaling (its factors, with the original context scaled to the tiny one).
    "llama3.1": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512}}),
}


def chat_template(family: str) -> str:
    """The family's real chat template (tests/data/chat_templates/<family>.jinja), verbatim."""
    return (TEMPLATES / f"{family}.jinja").read_text()


def make_tiny_chat_model(family: str, directory: Path, cache_dir: Path, seed: int = 0) -> Path:
    """Write a loadable HF model directory for `family` ("qwen3" or "llama3.1") into `directory`:
    config.json, model.safetensors (float32 random weights), generation_config.json and the
    tokenizer (SmolLM2's plus the family's markers, MARKERS[family], with its chat template).
    cache_dir is jaxserve's cache, where SmolLM2's converted tokenizer is kept. Returns directory."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _make_tokenizer(family, cache_dir)
    tokenizer.save_pretrained(directory)
    _check_markers(family, directory)
    _make_model(family, len(tokenizer), seed).save_pretrained(directory, safe_serialization=True)
    generation = {k: v for k, v in _IDS[family].items() if k in ("bos_token_id", "pad_token_id") and v is not None}
    generation["eos_token_id"] = _IDS[family]["generation_eos"]
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return directory


def _make_tokenizer(family: str, cache_dir: Path) -> transformers.PreTrainedTokenizerBase:
    from smollm2 import GGUF_NAME, smollm2_dir
    from tokenizers import AddedToken, processors

    from jaxserve.tokenizer import load_tokenizer

    shared = load_tokenizer(smollm2_dir(), GGUF_NAME, cache_dir=cache_dir).hf
    if len(shared) != _BASE_VOCAB:
        raise RuntimeError(f"SmolLM2's tokenizer has {len(shared)} tokens, expected {_BASE_VOCAB}")
    with tempfile.TemporaryDirectory() as tmp:  # a private copy: the shared tokenizer stays as it is
        shared.save_pretrained(tmp)
        tokenizer = transformers.AutoTokenizer.from_pretrained(tmp)
    plain = [AddedToken(t, special=False, normalized=False) for t, special in _ADDED[family] if not special]
    special = [AddedToken(t, special=True, normalized=False) for t, is_special in _ADDED[family] if is_special]
    if plain:
        tokenizer.add_tokens(plain)
    if special:
        tokenizer.add_tokens(special, special_tokens=True)
    for role, token in _TOKENS[family].items():
        setattr(tokenizer, role, token)
    if family == "llama3.1":
        # Meta's tokenizer puts <|begin_of_text|> before a raw prompt (the chat template writes its own).
        bos = _LLAMA["<|begin_of_text|>"]
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
    tokenizer.chat_template = chat_template(family)
    return tokenizer


def _check_markers(family: str, directory: Path) -> None:
    """The saved tokenizer has each marker as one token with MARKERS' id and the family's specialness."""
    saved = transformers.AutoTokenizer.from_pretrained(directory)
    special = {t for t, is_special in _ADDED[family] if is_special} | {"<|im_start|>", "<|im_end|>"}
    decoder = saved.added_tokens_decoder
    for token, token_id in MARKERS[family].items():
        encoded = saved.encode(token, add_special_tokens=False)
        if saved.convert_tokens_to_ids(token) != token_id or encoded != [token_id]:
            raise RuntimeError(f"{family}: {token!r} is not the single token {token_id}")
        if decoder[token_id].special != (token in special):
            raise RuntimeError(f"{family}: {token!r} has special={decoder[token_id].special}")


def _make_model(family: str, vocab: int, seed: int) -> transformers.PreTrainedModel:
    cls_name, overrides = _CONFIGS[family]
    ids = {k: v for k, v in _IDS[family].items() if k != "generation_eos"}
    config = getattr(transformers, cls_name)(
        **_MODEL, **overrides, **ids, vocab_size=-(-vocab // 64) * 64, dtype="float32")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    return randomize(model)
