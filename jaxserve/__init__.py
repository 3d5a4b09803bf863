"""jaxserve: a JAX/XLA inference server for large language models.

`jaxserve.LLM(model=...).generate(prompts, jaxserve.SamplingParams(...))` for offline batches;
`python -m jaxserve --model ...` for the server.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "LoRARequest", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import jaxserve` (the CLI's --help, host-only modules) must not pull in jax.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "LoRARequest":
        from jaxserve.llm import LoRARequest

        return LoRARequest
    if name == "BeamSearchParams":
        from jaxserve.llm import BeamSearchParams

        return BeamSearchParams
    if name == "SamplingParams":
        from jaxserve.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
