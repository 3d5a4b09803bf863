"""PEFT LoRA adapters for the tests, made by the `peft` library itself on a Hugging Face model and
saved as `save_pretrained` writes them, with random factors (PEFT starts lora_B at zero, which
would add nothing)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

# name -> LoraConfig keywords: ranks, alphas and targets differ, one uses rsLoRA and one a
# per-module alpha, so the loader's scales and the rank padding are all exercised.
ADAPTERS: dict[str, dict[str, Any]] = {
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]),
    "poet": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True,
                 alpha_pattern={"down_proj": 2}),
    # Phi-3 / Phi-4's fused projections, which the model holds as their parts.
    "phi3-fused": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}


def make_adapter(base: torch.nn.Module, name: str, directory: Path, seed: int = 1, scale: float = 0.15) -> Any:
    """Save adapter `name` of ADAPTERS for the HF model `base` (left unchanged) under directory;
    returns the PEFT model (base copy + adapter), the reference."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(lora_dropout=0.0, **ADAPTERS[name]))
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(scale * torch.randn_like(p))
    model.save_pretrained(directory)
    return model.eval()
