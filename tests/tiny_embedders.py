"""Tiny random-init embedding models saved as sentence-transformers directories: a bare encoder
(BertModel / XLMRobertaModel) or a bare decoder body (Qwen3Model, as Qwen3-Embedding ships it),
with modules.json, the Pooling config and, optionally, Normalize; plus the reference embedding
computed from the HF (PyTorch) model exactly as sentence-transformers computes it (the pooling
reads the attention mask; Normalize is torch's F.normalize)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from tiny_classifiers import _ENCODER_BASE, padded_batch, randomize
from tiny_models import _BASE, TINY_CONFIGS

# name -> (HF config class, model class, overrides)
TINY_EMBEDDERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertConfig", "BertModel", {}),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel",
                    {"pad_token_id": 1, "max_position_embeddings": 82, "type_vocab_size": 1}),
    "qwen3": ("Qwen3Config", "Qwen3Model", dict(TINY_CONFIGS["qwen3"][1])),
    "qwen3-causal": ("Qwen3Config", "Qwen3ForCausalLM", dict(TINY_CONFIGS["qwen3"][1])),
}
ST_POOLING = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}


def make_tiny_embedder(name: str, directory: Path, pooling: str | None, normalize: bool = True,
                       max_seq_length: int | None = None, seed: int = 0, **config: Any) -> torch.nn.Module:
    """Build, randomise and save the tiny model `name`; pooling None saves no sentence-transformers
    files (the server's defaults apply). Returns the float32 PyTorch model."""
    cfg_cls, model_cls, overrides = TINY_EMBEDDERS[name]
    base = _BASE if name.startswith("qwen") else _ENCODER_BASE
    hf_config = getattr(transformers, cfg_cls)(**{**base, **overrides, **config})
    hf_config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = randomize(getattr(transformers, model_cls)._from_config(hf_config, attn_implementation="eager").float().eval())
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir(exist_ok=True)
        flags = {flag: flag == ST_POOLING[pooling] for flag in ST_POOLING.values()}
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": hf_config.hidden_size, **flags, "pooling_mode_max_tokens": False,
             "pooling_mode_mean_sqrt_len_tokens": False, "include_prompt": True}))
        if max_seq_length is not None:
            (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return model


def reference_embeddings(model: torch.nn.Module, inputs: list[list[int]], pooling: str, normalize: bool,
                         pad_id: int = 0) -> torch.Tensor:
    """sentence-transformers' embeddings of token-id inputs, batched right-padded with a mask."""
    ids, mask = padded_batch(inputs, pad_id)
    body = model.model if isinstance(model, transformers.Qwen3ForCausalLM) else model
    with torch.no_grad():
        hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    if pooling == "cls":
        out = hidden[:, 0]
    elif pooling == "last":
        out = hidden[torch.arange(len(inputs)), mask.sum(1) - 1]
    else:
        m = mask.unsqueeze(-1).float()
        out = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(out, p=2, dim=1) if normalize else out

