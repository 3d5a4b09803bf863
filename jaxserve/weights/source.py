"""Resolve `--model` to a checkpoint: a Hugging Face directory or a GGUF file (or a directory
holding exactly one), with its HF-style config dict and lazily loaded tensors under HF names."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.weights import gguf_file, safetensors_dir
from jaxserve.weights.lora_adapter import FUSED_TARGETS
from jaxserve.weights.safetensors_dir import TensorSource, WeightsError


@dataclasses.dataclass
class ModelSource:
    """A checkpoint on disk. Its config and tensor index are read on first use: parsing a GGUF
    header (tens of thousands of vocabulary strings) takes seconds, which a start-up that restores
    from the orbax cache never needs to spend."""

    path: Path  # directory or .gguf file
    kind: str  # "hf" | "gguf"
    files: list[Path]
    # Keys replacing the checkpoint's own config (vLLM's --hf-overrides), e.g. to serve a causal LM
    # as a reranker; they are part of the orbax cache key, as they change the model.
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def _reader(self) -> Any:
        return gguf_file.open_gguf(self.path)

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        if self.kind == "gguf":
            return {**gguf_file.hf_config(self._reader, self.path), **self.overrides}
        return {**json.loads((self.path / "config.json").read_text()), **self.overrides}

    @functools.cached_property
    def tensors(self) -> dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]]:
        if self.kind == "gguf":
            tensors = gguf_file.open_tensors(self._reader, self.config, self.path)
        else:
            tensors = safetensors_dir.open_tensors(self.files)
        return stack_experts(split_fused(tensors, self.config))

    @functools.cached_property
    def tensor_types(self) -> dict[str, str]:
        """HF name -> stored type: a GGUF's block type (Q4_1, ...) or F32/F16/BF16; {} for safetensors."""
        types = gguf_file.tensor_types(self._reader) if self.kind == "gguf" else {}
        return {part: kind for name, kind in types.items() for part, _ in _parts(name, self.config) or [(name, None)]}

    @functools.cached_property
    def blocks(self) -> dict[str, tuple[str, Callable[[], tuple]]]:
        """A GGUF's tensors stored in blocks the products read as they are (gguf_file.open_blocks),
        fused projections split as `tensors` splits them (every block array is [rows, ...])."""
        blocks = gguf_file.open_blocks(self._reader, self.config, self.path) if self.kind == "gguf" else {}
        out = {}
        for name, (kind, load) in blocks.items():
            for part, rows in _parts(name, self.config) or [(name, None)]:
                out[part] = (kind, load if rows is None else
                             lambda load=load, a=rows[0], b=rows[1]: tuple(x if x is None else x[a:b] for x in load()))
        return out

    def stored_name(self, hf: str) -> str:
        """The file's own name for HF tensor `hf` (a GGUF's blk.0.attn_q.weight), for messages."""
        return gguf_file.gguf_name(hf, self._reader) if self.kind == "gguf" else hf

    @property
    def tokenizer_dir(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path

    @property
    def gguf_name(self) -> str | None:
        return self.path.name if self.kind == "gguf" else None

    def fingerprint(self) -> str:
        """Changes whenever any weight file changes (path, size, mtime); keys the orbax cache."""
        h = hashlib.sha256()
        for f in self.files:
            st = f.stat()
            h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        if self.overrides:
            h.update(json.dumps(self.overrides, sort_keys=True).encode())
        return h.hexdigest()[:24]


# Fused projections (Phi-3 / Phi-4) -> the projections whose rows they stack, in order: the
# checkpoint's module paths of lora_adapter.FUSED_TARGETS.
_FUSED = {f"{module}.{fused}": tuple(f"{module}.{part}" for part in parts)
          for fused, (module, parts) in FUSED_TARGETS.items()}


def fused_rows(config: dict[str, Any], fused: str) -> tuple[int, ...]:
    """How many rows of fused projection `fused` each of its parts takes (HF's [out, in] layout)."""
    if fused == "mlp.gate_up_proj":
        return (int(config["intermediate_size"]),) * 2
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return heads * head_dim, kv * head_dim, kv * head_dim


def _parts(name: str, config: dict[str, Any]) -> list[tuple[str, tuple[int, int]]] | None:
    """Fused tensor `name` -> each part's name and its rows [a, b); None for any other tensor."""
    prefix, _, leaf = name.rpartition(".")
    _, _, fused = prefix.rpartition(".layers.")[2].partition(".")
    if fused not in _FUSED or leaf not in ("weight", "bias"):
        return None
    head = prefix[: len(prefix) - len(fused)]
    out, start = [], 0
    for part, n in zip(_FUSED[fused], fused_rows(config, fused)):
        out.append((f"{head}{part}.{leaf}", (start, start + n)))
        start += n
    return out


def split_fused(tensors: dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]],
                config: dict[str, Any]) -> dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]]:
    """`tensors` with each fused projection (qkv_proj, gate_up_proj) replaced by its parts, each a
    lazy row slice of the fused tensor (a view: a memory-mapped file stays unread until a device
    shard of the part is read). The model keeps separate q/k/v and gate/up weights, so loading,
    tensor parallelism, quantization and LoRA see the Llama layout."""
    out = dict(tensors)
    for name, (load, shape, dtype) in tensors.items():
        parts = _parts(name, config)
        if parts is None:
            continue
        if shape[0] != parts[-1][1][1]:
            raise WeightsError(f"tensor {name} has {shape[0]} rows; the config implies {parts[-1][1][1]} "
                               f"({', '.join(str(b - a) for _, (a, b) in parts)})")
        del out[name]
        for part, (a, b) in parts:
            out[part] = (lambda load=load, a=a, b=b: load()[a:b], (b - a, *shape[1:]), dtype)
    return out


# Mixtral's names for its sparse MLP -> the Qwen-MoE names the model uses (mlp.gate, mlp.experts.N.*_proj).
_MIXTRAL_NAMES = {"w1.": "gate_proj.", "w3.": "up_proj.", "w2.": "down_proj."}
_EXPERT = re.compile(r"^(.*\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+_proj\.(?:weight|bias))$")


class StackedExperts:
    """Every expert's tensor of one projection as one lazy array [experts, out, in]: indexing reads
    only the experts (and rows, columns) a device shard needs from the memory-mapped files."""

    def __init__(self, parts: list[TensorSource]):
        self.parts = parts

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        return np.stack([np.asarray(self.parts[e]()[rest]) for e in range(len(self.parts))[first]])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[(slice(None),)]
        return out if dtype is None else out.astype(dtype)


def _mixtral_name(name: str) -> str:
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.").replace(".block_sparse_moe.", ".mlp.")
    head, sep, leaf = name.rpartition(".experts.")
    if sep:
        index, _, rest = leaf.partition(".")
        for old, new in _MIXTRAL_NAMES.items():
            if rest.startswith(old):
                rest = new + rest[len(old):]
        name = f"{head}.experts.{index}.{rest}"
    return name


def stack_experts(tensors: dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]]
                  ) -> dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]]:
    """`tensors` with a mixture-of-experts checkpoint's per-expert projections
    (model.layers.L.mlp.experts.E.gate_proj.weight, Mixtral's block_sparse_moe.experts.E.w1.weight)
    replaced by one stacked tensor per layer and projection (model.layers.L.mlp.experts.gate_proj.weight
    [experts, out, in]), as the model holds them; a GGUF's are stacked in the file already."""
    out: dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]] = {}
    groups: dict[str, dict[int, tuple[TensorSource, tuple[int, ...], np.dtype]]] = {}
    for name, entry in tensors.items():
        name = _mixtral_name(name)
        m = _EXPERT.match(name)
        if m is None:
            out[name] = entry
        else:
            groups.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = entry
    for name, experts in groups.items():
        count = max(experts) + 1
        missing = sorted(set(range(count)) - set(experts))
        if missing:
            head, _, proj = name.rpartition(".experts.")
            raise WeightsError(f"tensor {head}.experts.{missing[0]}.{proj} is missing from the checkpoint "
                               f"(it has experts up to {count - 1})")
        shapes = {entry[1] for entry in experts.values()}
        if len(shapes) != 1:
            raise WeightsError(f"the experts of {name} differ in shape: {sorted(shapes)}")
        parts = [experts[e][0] for e in range(count)]
        out[name] = (lambda parts=parts: StackedExperts(parts), (count, *shapes.pop()), experts[0][2])
    return out


def resolve(model: str | Path, weights: bool = True, overrides: dict[str, Any] | None = None) -> ModelSource:
    """The checkpoint at `model`, its config updated with `overrides`. With weights=False (random
    weights) an HF directory needs only its config.json: no safetensors are looked for."""
    path = Path(model).expanduser()
    if not path.exists():
        raise WeightsError(
            f"model path {str(model)!r} does not exist (jaxserve loads local checkpoints only: a Hugging "
            "Face directory with config.json and *.safetensors, or a .gguf file)"
        )
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        elif ggufs:
            raise WeightsError(f"{path} holds {len(ggufs)} .gguf files; pass one of them: {[g.name for g in ggufs]}")
        else:
            raise WeightsError(f"{path} has neither config.json nor a .gguf file")
    if path.is_file():
        if path.suffix != ".gguf":
            raise WeightsError(f"{path}: a model file must be .gguf (or pass a Hugging Face directory)")
        return ModelSource(path, "gguf", [path], dict(overrides or {}))
    return ModelSource(path, "hf", safetensors_dir.safetensors_files(path) if weights else [], dict(overrides or {}))
