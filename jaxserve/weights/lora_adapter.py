"""LoRA adapters in PEFT's format (what `peft`'s `save_pretrained` writes, and what vLLM's
`--lora-modules` and SGLang's `--lora-paths` load): a directory with adapter_config.json and
adapter_model.safetensors. Read on the host (numpy, no jax); jaxserve.models.lora puts them on
the device.

A LoRA module adds `scale * B @ A` to a projection's weight, A [r, in] and B [out, r], with
scale = lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA). Here each module is kept as the two
factors in the model's [in, out] orientation with the scale folded into B, so the step computes
`x @ a @ b` beside the base product and never forms the [in, out] delta (jaxserve.models.lora).

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

# Fused projections (Phi-3 / Phi-4's qkv_proj and gate_up_proj, which the model holds as their
# parts; jaxserve.weights.source splits the checkpoint's by this table): an adapter on one is an
# adapter on each part with the same A and B's rows of that part.
FUSED_TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
}

# A PEFT factor's tensor name: "base_model.model." + the base model's module name (PEFT's
# `current_key`, which rank_pattern and alpha_pattern match) + ".lora_A.weight".
_KEY = re.compile(r"^(?:base_model\.model\.)?((?:model\.)?(?:language_model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+))\.lora_([AB])(?:\.\w+)?\.weight$")

# adapter_config.json fields of LoRA variants whose forward is not x @ W + scale * x @ A^T @ B^T
# (or that train more than the factors): refused when set, never applied as plain LoRA.
_VARIANTS = {
    "use_dora": "DoRA", "lora_bias": "LoRA biases", "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA", "layer_replication": "layer replication", "use_bdlora": "block-diagonal LoRA",
    "trainable_token_indices": "trainable token embeddings", "target_parameters": "LoRA on parameters",
    "arrow_config": "Arrow routing", "monteclora_config": "MonteCLoRA", "kasa_config": "KaSA",
    "modules_to_save": "modules_to_save (fully trained modules)", "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D)",
}


@dataclasses.dataclass(frozen=True)
class LoraModuleSpec:
    """One adapter the server serves: the name requests select it by, its directory, (vLLM's
    base_model_name) the model /v1/models names as its parent (None: the served model), and
    (SGLang's) whether it is pinned to an adapter slot (jaxserve.engine.lora_slots)."""

    name: str
    path: Path
    base_model_name: str | None = None
    pinned: bool = False

    @staticmethod
    def parse(value: str | dict[str, Any], flag: str = "--lora-modules") -> "LoraModuleSpec":
        """vLLM's `--lora-modules` forms, `name=path` or JSON `{"name": ..., "path": ...,
        "base_model_name": ...}`, and SGLang's `--lora-paths` ones, JSON `{"lora_name": ...,
        "lora_path": ..., "pinned": ...}` or (`flag` --lora-paths) a bare path, which is then
        the name too. JSON as text, or as a mapping from a YAML --config."""
        spec: Any = value
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag}: {value!r} is not valid JSON ({e})") from None
        base, pinned = None, False
        if isinstance(spec, dict):
            unknown = set(spec) - {"name", "path", "base_model_name", "lora_name", "lora_path", "pinned"}
            if unknown:
                raise ValueError(f"{flag}: unknown keys {sorted(unknown)} (name, path and base_model_name, or "
                                 "lora_name, lora_path and pinned)")
            name, path = spec.get("name", spec.get("lora_name")), spec.get("path", spec.get("lora_path"))
            base, pinned = spec.get("base_model_name"), spec.get("pinned", False)
            if ("name" in spec and "lora_name" in spec) or ("path" in spec and "lora_path" in spec):
                raise ValueError(f"{flag}: {value!r} gives the name or the path twice")
            if not isinstance(name, str) or not isinstance(path, str) or not isinstance(base, (str, type(None))) \
                    or not isinstance(pinned, bool):
                raise ValueError(f"{flag}: {value!r} needs a string name and path (and a boolean pinned)")
        elif isinstance(spec, str):
            name, sep, path = spec.partition("=")
            if not sep and flag == "--lora-paths":
                name = path = spec
            elif not sep:
                raise ValueError(f"{flag}: {value!r} is not name=path")
        else:
            raise ValueError(f"{flag}: {value!r} is neither name=path nor a name/path mapping")
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ValueError(f"{flag}: {value!r} needs a name and a path")
        return LoraModuleSpec(name, Path(path).expanduser(), base, pinned)


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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key matching the end of the
    module's name in the base model (e.g. "model.layers.0.self_attn.q_proj")."""
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
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{where}: adapter_config.json cannot be read ({e})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{where}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise WeightsError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for field, what in _VARIANTS.items():
        if config.get(field):
            raise WeightsError(f"{where}: {what} ({field}) is not supported")
    if config.get("bias", "none") != "none":
        raise WeightsError(f"{where}: LoRA biases (bias {config.get('bias')!r}) are not supported")
    alpha, rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora"))
    alphas = config.get("alpha_pattern") or {}
    if not _is_number(alpha) or not isinstance(alphas, dict) or not all(_is_number(a) for a in alphas.values()):
        raise WeightsError(f"{where}: lora_alpha and alpha_pattern must be numbers")
    weights_path = spec.path / "adapter_model.safetensors"
    if not weights_path.is_file():
        pickles = [p.name for p in spec.path.glob("adapter_model.*")]
        raise WeightsError(f"{where}: no adapter_model.safetensors" + (
            f" ({', '.join(pickles)} is a pickle file, which jaxserve never loads; convert it to safetensors)"
            if pickles else ""))
    tensors = open_tensors([weights_path])
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    modules: dict[tuple[int, str], str] = {}
    known = {**TARGETS, **{fused: (part, None) for fused, (part, _) in FUSED_TARGETS.items()}}
    for key, (load, _, _) in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(4) not in known or known[m.group(4)][0] != m.group(3):
            raise WeightsError(f"{where}: tensor {key} is not a LoRA factor of a decoder projection "
                               f"({', '.join([*TARGETS, *FUSED_TARGETS])}); embedding, LM-head and other adapters "
                               "are not supported")
        layer, proj = int(m.group(2)), m.group(4)
        if layer >= num_layers:
            raise WeightsError(f"{where}: tensor {key} is for layer {layer}, and the model has {num_layers}")
        pairs.setdefault((layer, proj), {})[m.group(5)] = np.asarray(load(), np.float32)
        modules[(layer, proj)] = m.group(1)
    if not pairs:
        raise WeightsError(f"{where}: adapter_model.safetensors holds no LoRA factors")
    factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    rank = 0
    for (layer, proj), ab in sorted(pairs.items()):
        name = modules[(layer, proj)]
        if set(ab) != {"A", "B"}:
            raise WeightsError(f"{where}: {name} has lora_{''.join(ab)} without its other factor")
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        parts = FUSED_TARGETS[proj][1] if proj in FUSED_TARGETS else (proj,)
        d_in, d_out = shapes[parts[0]][0], sum(shapes[part][1] for part in parts)
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != d_in or b.shape != (d_out, r):
            raise WeightsError(f"{where}: {name} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; the model's "
                               f"{proj} needs [r, {d_in}] and [{d_out}, r]")
        module_alpha = _pattern_value(alphas, name, alpha)
        scale = module_alpha / (math.sqrt(r) if rslora else r)
        start = 0
        for part in parts:
            rows = b[start:start + shapes[part][1]]
            start += shapes[part][1]
            if (layer, part) in factors:
                raise WeightsError(f"{where}: layer {layer}'s {part} is adapted twice (by {proj} and on its own)")
            factors[(layer, part)] = (np.ascontiguousarray(a.T), np.ascontiguousarray((rows * scale).T))
        rank = max(rank, r)
    return LoraAdapter(spec.name, rank, factors)
