"""Tensors of a Hugging Face directory: config.json plus single or sharded *.safetensors.

The files are memory-mapped and each tensor is a zero-copy numpy view, so loading a shard of a
parameter touches only the bytes of that shard. Pickle checkpoints are refused: loading one runs
arbitrary code from the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

TensorSource = Callable[[], np.ndarray]


class WeightsError(ValueError):
    """The checkpoint cannot be loaded; the message names the file and the reason."""


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where tensor data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightsError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 2**20:
            raise WeightsError(f"{path}: safetensors header of {size} bytes is implausible")
        header = json.loads(f.read(size))
    return header, 8 + size


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            wanted = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [w for w in wanted if not (model_dir / w).exists()]
            if missing:
                raise WeightsError(f"{model_dir}: shards named in the index are missing: {missing}")
            return [model_dir / w for w in wanted]
        return files
    pickles = [p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES]
    if pickles:
        raise WeightsError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickles)}); jaxserve never loads "
            "pickle (it can run arbitrary code). Convert them to safetensors first."
        )
    raise WeightsError(f"{model_dir}: no *.safetensors files found")


def open_tensors(files: list[Path]) -> dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]]:
    """name -> (lazy loader of a memory-mapped view, shape, dtype) over every file."""
    out: dict[str, tuple[TensorSource, tuple[int, ...], np.dtype]] = {}
    for path in files:
        header, start = read_header(path)
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise WeightsError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])

            def load(mm=mm, a=start + begin, b=start + end, dtype=dtype, shape=shape) -> np.ndarray:
                return mm[a:b].view(dtype).reshape(shape)

            out[name] = (load, shape, np.dtype(dtype))
    return out
