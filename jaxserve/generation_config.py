"""A model's recommended sampling, from its generation_config.json, as vLLM applies it
(`--generation-config auto`, vLLM's default since 0.7): a request that leaves temperature, top_p,
top_k, min_p, repetition_penalty or its token limit unset gets the model creator's value instead of
the API's neutral one. Qwen2.5-Instruct's file, for one, asks for temperature 0.7, top_p 0.8,
top_k 20 and repetition_penalty 1.05; a server that ignored it would sample differently from vLLM
and SGLang on the same request. Host-only: reads JSON.

Like vLLM, only the values that differ from HF GenerationConfig's own defaults count (HF's
`to_diff_dict`): a file that spells out `top_k: 50` or `temperature: 1.0` changes nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jaxserve.engine.request import SamplingParams
from jaxserve.errors import InvalidRequestError

# generation_config.json key -> (SamplingParams field, HF GenerationConfig's default).
KEYS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}
MODES = ("auto", "vllm")  # besides a folder (or file) path


def sampling_defaults(model: str | Path, mode: str = "auto",
                      overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The default sampling a served `model` gets, as SamplingParams fields (max_new_tokens is
    max_tokens). mode: "auto" reads generation_config.json beside the model (in an HF directory,
    or the folder of a GGUF file), "vllm" none (the API's neutral defaults), anything else is a
    folder holding one (or the file itself). `overrides` (vLLM's --override-generation-config)
    sets or replaces keys; with "vllm" they are the only defaults. Raises ValueError naming the
    file or key that is wrong."""
    config: dict[str, Any] = {}
    source = "--override-generation-config"
    if mode != "vllm":
        if mode == "auto":
            folder = Path(model).expanduser()
            path = (folder if folder.is_dir() else folder.parent) / "generation_config.json"
            found = path.is_file()
        else:
            path = Path(mode).expanduser()
            path = path / "generation_config.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"--generation-config {mode}: no generation_config.json there (give auto, vllm, "
                                 "or a folder holding one)")
            found = True
        if found:
            source = str(path)
            try:
                config = json.loads(path.read_text())
            except ValueError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
            if not isinstance(config, dict):
                raise ValueError(f"{path}: expected a JSON object")
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key in KEYS and value is not None and value != KEYS[key][1]:
            out[KEYS[key][0]] = _checked(key, value, source)
    for key, value in (overrides or {}).items():
        if key not in KEYS:
            raise ValueError(f"--override-generation-config: unknown key {key!r} (the sampling keys are "
                             f"{', '.join(KEYS)})")
        out[KEYS[key][0]] = _checked(key, value, "--override-generation-config")
    return out


def for_server(model: str | Path, mode: str = "auto",
               overrides: dict[str, Any] | None = None) -> tuple[dict[str, Any], str | None]:
    """sampling_defaults for a server whose task is not known yet: (defaults, None), or, when the
    generation_config.json that "auto" found beside the model is what is wrong, ({}, the error).
    Only a generation model reads that file (a classifier's or embedder's is left alone, however
    broken), so the error is raised when a generation engine starts (ModelConfig's
    generation_config_error). A file or override the user named is refused at once."""
    try:
        return sampling_defaults(model, mode, overrides), None
    except ValueError as e:
        if mode != "auto":
            raise
        sampling_defaults(model, "vllm", overrides)  # the overrides alone: refused now when wrong
        return {}, f"{e} (--generation-config vllm, or LLM(generation_config=\"vllm\"), serves without the file)"


def _checked(key: str, value: Any, source: str) -> Any:
    """The value when the key can take it (the engine's own ranges: a default no request could
    send would fail every request), else ValueError naming both."""
    integer = isinstance(value, int) and not isinstance(value, bool)
    number = (integer or isinstance(value, float)) and math.isfinite(value)
    field = KEYS[key][0]
    ok = integer if key in ("top_k", "max_new_tokens") else number
    if ok:
        converted = value if key in ("top_k", "max_new_tokens") else float(value)
        try:
            SamplingParams(**{field: converted}).validate(vocab_size=1)
        except InvalidRequestError as e:
            raise ValueError(f"{source}: {key} {value!r} is not a value it can take ({e})") from None
        return converted
    raise ValueError(f"{source}: {key} {value!r} is not a value it can take (expected "
                     f"{'an integer' if key in ('top_k', 'max_new_tokens') else 'a number'})")


def describe(defaults: dict[str, Any]) -> str:
    """One log line's worth: "temperature=0.7, top_p=0.8"."""
    return ", ".join(f"{k}={v}" for k, v in defaults.items())
