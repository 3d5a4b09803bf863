"""The real SmolLM2-135M-Instruct GGUF: jaxserve's greedy continuations equal HF transformers'
(HF dequantizing the same GGUF) token for token."""

from __future__ import annotations

import pytest
import torch

from jaxserve.models.reference import greedy_choices
from jaxserve.weights import load_model
from smollm2 import GGUF_NAME, smollm2_dir

pytestmark = pytest.mark.slow

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    # A raw prompt that spells the chat markup itself: its special tokens are parsed as HF does.
    "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a colour."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def prompts(tokenizer):
    raw = [tokenizer.encode_prompt(p) for p in RAW_PROMPTS]
    assert raw == [tokenizer.hf(p)["input_ids"] for p in RAW_PROMPTS]  # HF's own tokenization
    return raw + [tokenizer.encode_chat(c) for c in CHATS]


def test_greedy_continuations_match_hf(prompts, hf_smollm2):
    loaded = load_model(smollm2_dir() / GGUF_NAME, "float32", use_cache=False)
    assert loaded.config.dtype == "q4_1"  # what --dtype auto sees: quantized, so bfloat16 where native
    theirs = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf_smollm2.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        theirs.append(out[0, len(prompt):].tolist())
    # Ours picks each of HF's tokens given the ones before it: the same greedy continuation.
    assert greedy_choices(loaded.model, prompts, theirs) == theirs


def test_chat_template_from_gguf_metadata(tokenizer):
    ids = tokenizer.encode_chat(CHATS[0])
    text = tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == tokenizer.hf.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True)["input_ids"]
