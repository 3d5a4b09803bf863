"""Tiny random-init classification and reward models, one per supported architecture, saved as
safetensors next to the HF (PyTorch) model that is their reference.

Every parameter (norms and biases included) is randomised, so a weight loaded into the wrong place
or ignored changes the logits. Qwen2ForRewardModel is not in transformers (its checkpoints ship it
as remote code); `Qwen2RewardReference` rebuilds it from transformers' Qwen2Model and the head
Qwen2.5-Math-RM defines: score.0 (hidden -> hidden), ReLU, score.2 (hidden -> 1), read at the
last non-padding token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from tiny_models import _BASE, TINY_CONFIGS

_ENCODER_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    max_position_embeddings=80, type_vocab_size=2, pad_token_id=0, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
SENTIMENT = {0: "negative", 1: "neutral", 2: "positive"}

# name -> (HF config class, model class, overrides)
TINY_CLASSIFIERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-cls": ("LlamaConfig", "LlamaForSequenceClassification",
                  {**TINY_CONFIGS["llama3"][1], "id2label": SENTIMENT}),
    "llama-reward": ("LlamaConfig", "LlamaForSequenceClassification",
                     {**TINY_CONFIGS["llama-mha-tied-bias"][1], "num_labels": 1}),
    "mistral-cls": ("MistralConfig", "MistralForSequenceClassification",
                    {**TINY_CONFIGS["mistral"][1], "num_labels": 2}),
    "qwen2-cls": ("Qwen2Config", "Qwen2ForSequenceClassification", {"num_labels": 2}),
    "qwen3-cls": ("Qwen3Config", "Qwen3ForSequenceClassification",
                  {**TINY_CONFIGS["qwen3"][1], "id2label": {0: "a", 1: "b", 2: "c", 3: "d"}}),
    "gemma2-cls": ("Gemma2Config", "Gemma2ForSequenceClassification",
                   {**TINY_CONFIGS["gemma2"][1], "id2label": SENTIMENT}),
    "gemma3-cls": ("Gemma3TextConfig", "Gemma3TextForSequenceClassification",
                   {**TINY_CONFIGS["gemma3"][1], "num_labels": 2}),
    "phi3-cls": ("Phi3Config", "Phi3ForSequenceClassification", {**TINY_CONFIGS["phi3-longrope"][1], "num_labels": 3}),
    "qwen2-reward": ("Qwen2Config", "Qwen2ForRewardModel", {"num_labels": 1}),
    "bert-cls": ("BertConfig", "BertForSequenceClassification", {"id2label": SENTIMENT}),
    "roberta-cls": ("RobertaConfig", "RobertaForSequenceClassification",
                    {"num_labels": 2, "pad_token_id": 1, "max_position_embeddings": 82, "type_vocab_size": 1}),
    # problem_type "regression": what HF's Trainer writes after fitting one label (its loss is MSE)
    "xlm-roberta-reward": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification",
                           {"num_labels": 1, "pad_token_id": 1, "max_position_embeddings": 82, "type_vocab_size": 1,
                            "problem_type": "regression"}),
    # One label: a sentence-transformers CrossEncoder's shape, what /v1/score and /v1/rerank run.
    "bert-cross-encoder": ("BertConfig", "BertForSequenceClassification", {"num_labels": 1}),
}
ENCODERS = {"bert-cls", "roberta-cls", "xlm-roberta-reward", "bert-cross-encoder"}


class Qwen2RewardReference(torch.nn.Module):
    """Qwen2ForRewardModel as Qwen2.5-Math-RM's remote code defines it."""

    def __init__(self, config: transformers.Qwen2Config):
        super().__init__()
        self.config = config
        self.model = transformers.Qwen2Model(config)
        h = config.hidden_size
        self.score = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        hidden = self.model(input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.score(hidden)
        non_pad = (input_ids != self.config.pad_token_id).int()
        last = (torch.arange(input_ids.shape[1]) * non_pad).argmax(-1)
        return transformers.modeling_outputs.SequenceClassifierOutput(logits=logits[torch.arange(len(last)), last])


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random (norms around 1), so a weight loaded into the wrong place or ignored
    changes the output."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.lower().endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def make_tiny_classifier(name: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """Build, randomise and save (safetensors + config.json) the tiny classifier `name`; returns
    the float32 PyTorch reference."""
    cfg_cls, model_cls, overrides = TINY_CLASSIFIERS[name]
    base = _ENCODER_BASE if name in ENCODERS else _BASE
    config = getattr(transformers, cfg_cls)(**{**base, **overrides})
    torch.manual_seed(seed)
    if model_cls == "Qwen2ForRewardModel":
        model = Qwen2RewardReference(config)
    else:
        config.architectures = [model_cls]
        model = getattr(transformers, model_cls)._from_config(config, attn_implementation="eager")
    model = randomize(model.float().eval())
    directory.mkdir(parents=True, exist_ok=True)
    if model_cls == "Qwen2ForRewardModel":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": [model_cls]}))
    else:
        model.save_pretrained(directory, safe_serialization=True)
    return model


def edit_config(directory: Path, **changes: Any) -> None:
    """Rewrite keys of a saved config.json (None deletes the key)."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def padded_batch(inputs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids right-padded with pad_id into one batch, and its attention mask."""
    width = max(map(len, inputs))
    ids = torch.full((len(inputs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(inputs), width), dtype=torch.long)
    for i, x in enumerate(inputs):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    return ids, mask


def hf_logits(model: torch.nn.Module, inputs: list[list[int]], pad_id: int) -> torch.Tensor:
    """The reference forward over a right-padded batch with an attention mask, as HF users run it."""
    ids, mask = padded_batch(inputs, pad_id)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def save_word_tokenizer(directory: Path, vocab_size: int = 256, bert: bool = False) -> None:
    """A word-level tokenizer over "w0".."w{n}"; BERT's adds [CLS] .. [SEP] around every input."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bert:
        # Pairs as BERT's tokenizer builds them: [CLS] a [SEP] b [SEP], token types 0 then 1.
        tok.post_processor = processors.TemplateProcessing(single="w101 $A w102", pair="w101 $A w102 $B:1 w102:1",
                                                           special_tokens=[("w101", 101), ("w102", 102)])
        PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="w101", sep_token="w102", pad_token="w0",
                                unk_token="w3").save_pretrained(directory)
    else:
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0",
                                unk_token="w3").save_pretrained(directory)
