"""LoRA adapters in PEFT's format (what `peft`'s `save_pretrained` writes, and what vLLM's
`--lora-modules` and SGLang's `--lora-paths` load): a directory with adapter_config.json and
adapter_model.safetensors. Read on the host (numpy, no jax); jaxserve.models.lora puts them on
the device.

A LoRA module adds `scale * B @ A` to a projection's weight, A [r, in] and B [out, r], with
scale = lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA). Here each module is kept as the two
factors in the model's [in, out] orientation with the scale folded into B, so the step computes
`x @ a @ b` beside the base product and never forms the [in, out] delta.

Only what adds exactly that is taken; anything else an adapter can carry (DoRA, LoRA biases,
fully trained `modules_to_save`, embedding or LM-head adapters, GPT-2's transposed Conv1D layout,
pickle files) is refused with the reason, never loaded partly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.weights.safetensors_dir import WeightsError, open_tensors

# The decoder projections an adapter may target, by PEFT's module name -> the decoder's path
# below ("layers", i). jaxserve.models.decoder names its Linears after HF's.
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attn", "q_proj"), "k_proj": ("self_attn", "k_proj"), "v_proj": ("self_attn", "v_proj"),
    "o_proj": ("self_attn", "o_proj"), "gate_proj": ("mlp", "gate_proj"), "up_proj": ("mlp", "up_proj"),
    "down_proj": ("mlp", "down_proj"),
}

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraModuleSpec:
    """One adapter the server serves: the name requests select it by, and its directory."""

    name: str
    path: Path

    @staticmethod
    def parse(text: str) -> "LoraModuleSpec":
        """vLLM's `--lora-modules` forms: `name=path`, or JSON `{"name": ..., "path": ...}`."""
        text = text.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({e})") from None
            unknown = set(spec) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(f"--lora-modules: unknown keys {sorted(unknown)} (name, path, base_model_name)")
            if not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise ValueError(f"--lora-modules: {text!r} needs string 'name' and 'path'")
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {text!r} is not name=path")
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ValueError(f"--lora-modules: {text!r} needs a name and a path")
        return LoraModuleSpec(name, Path(path).expanduser())


@dataclasses.dataclass
class LoraAdapter:
    """One adapter's factors: (layer, projection) -> (a [in, r], b [r, out] with the scale folded
    in), float32."""

    name: str
    rank: int
    factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def targets(self) -> list[str]:
        return sorted({proj for _, proj in self.factors})


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key matching the module's
    dotted name at its end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(spec: LoraModuleSpec, num_layers: int, shapes: dict[str, tuple[int, int]]) -> LoraAdapter:
    """Read and check one PEFT LoRA adapter against the model: `shapes` is each target
    projection's (in, out). Raises WeightsError naming the adapter and what is wrong."""
    where = f"LoRA adapter {spec.name!r} ({spec.path})"
    config_path = spec.path / "adapter_config.json"
    if not config_path.is_file():
        raise WeightsError(f"{where}: no adapter_config.json (a PEFT LoRA adapter directory is expected)")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise WeightsError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    refusals = [
        (config.get("use_dora"), "DoRA (use_dora) is not supported"),
        (config.get("bias", "none") != "none" or config.get("lora_bias"), "LoRA biases are not supported"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')} (fully trained "
                                        "modules) are not supported"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out (GPT-2's Conv1D layout) is not supported"),
    ]
    for refused, reason in refusals:
        if refused:
            raise WeightsError(f"{where}: {reason}")
    weights_path = spec.path / "adapter_model.safetensors"
    if not weights_path.is_file():
        pickles = [p.name for p in spec.path.glob("adapter_model.*")]
        raise WeightsError(f"{where}: no adapter_model.safetensors" + (
            f" ({', '.join(pickles)} is a pickle file, which jaxserve never loads; convert it to safetensors)"
            if pickles else ""))
    tensors = open_tensors([weights_path])
    alpha, rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora"))
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, (load, _, _) in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in TARGETS or TARGETS[m.group(3)][0] != m.group(2):
            raise WeightsError(f"{where}: tensor {key} is not a LoRA factor of a decoder projection "
                               f"({', '.join(TARGETS)}); embedding, LM-head and other adapters are not supported")
        layer = int(m.group(1))
        if layer >= num_layers:
            raise WeightsError(f"{where}: tensor {key} is for layer {layer}, and the model has {num_layers}")
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = np.asarray(load(), np.float32)
    if not pairs:
        raise WeightsError(f"{where}: adapter_model.safetensors holds no LoRA factors")
    factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    rank = 0
    for (layer, proj), ab in sorted(pairs.items()):
        name = f"layers.{layer}.{TARGETS[proj][0]}.{proj}"
        if set(ab) != {"A", "B"}:
            raise WeightsError(f"{where}: {name} has lora_{''.join(ab)} without its other factor")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        d_in, d_out = shapes[proj]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != d_in or b.shape != (d_out, r):
            raise WeightsError(f"{where}: {name} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; the model's "
                               f"{proj} needs [r, {d_in}] and [{d_out}, r]")
        module_alpha = _pattern_value(config.get("alpha_pattern") or {}, name, alpha)
        scale = module_alpha / (math.sqrt(r) if rslora else r)
        factors[(layer, proj)] = (np.ascontiguousarray(a.T), np.ascontiguousarray((b * scale).T))
        rank = max(rank, r)
    return LoraAdapter(spec.name, rank, factors)


def stack_adapters(adapters: list[LoraAdapter], rank: int, num_layers: int,
                   shapes: dict[str, tuple[int, int]]) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """Every adapter's factors side by side, each padded with zeros to `rank`: (layer, projection)
    -> (a [in, S * rank], b [S * rank, out]), adapter s in columns / rows s * rank ... Zero
    padding adds exactly nothing, so adapters of smaller ranks, and projections an adapter does
    not target, cost compute but change no value. A projection some adapter targets appears in
    every layer (zeros where none does), so every layer has the same structure and the step
    traces one layer body."""
    for adapter in adapters:
        if adapter.rank > rank:
            raise WeightsError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above --max-lora-rank {rank}")
    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    s = len(adapters)
    projections = sorted({proj for adapter in adapters for _, proj in adapter.factors})
    for layer, proj in ((layer, proj) for layer in range(num_layers) for proj in projections):
        d_in, d_out = shapes[proj]
        a = np.zeros((d_in, s * rank), np.float32)
        b = np.zeros((s * rank, d_out), np.float32)
        for i, adapter in enumerate(adapters):
            if (layer, proj) in adapter.factors:
                fa, fb = adapter.factors[(layer, proj)]
                a[:, i * rank: i * rank + fa.shape[1]] = fa
                b[i * rank: i * rank + fb.shape[0]] = fb
        out[(layer, proj)] = (a, b)
    return out
