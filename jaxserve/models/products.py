"""How the decoder multiplies activations by its weights.

By default XLA's dot. The engine can trace its steps with another implementation (`use`), the way
`jax.default_matmul_precision` scopes a setting to the code traced inside it: on the CPU that is
the native small-batch kernel (`pallas_kernels.cpu_matmul`, backend "cpu"), which streams bfloat16
weights much faster than XLA:CPU's dot at decode batch sizes. The setting is read while tracing, so
it belongs around tracing / lowering, not around calls of an already compiled function.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

BACKENDS = ("xla", "cpu")


class Products(NamedTuple):
    linear: Callable[[Array, Array], Array]  # x [..., K] @ w [K, N] -> [..., N]
    head: Callable[[Array, Array], Array]  # x [..., K] @ w.T for w [N, K] (HF's head / embedding orientation)


def _xla_head(x: Array, w: Array) -> Array:
    return jnp.einsum("...h,vh->...v", x, w)


XLA = Products(linear=lambda x, w: x @ w, head=_xla_head)

_current: contextvars.ContextVar[Products] = contextvars.ContextVar("jaxserve_products", default=XLA)


def current() -> Products:
    return _current.get()


@contextlib.contextmanager
def use(products: Products) -> Iterator[None]:
    """Trace the enclosed code with `products`."""
    token = _current.set(products)
    try:
        yield
    finally:
        _current.reset(token)


def for_backend(name: str) -> Products:
    """"xla" or "cpu" (the native kernel where it covers the product, XLA's dot elsewhere)."""
    if name == "xla":
        return XLA
    if name == "cpu":
        from pallas_kernels import cpu_matmul

        return Products(linear=cpu_matmul.matmul, head=cpu_matmul.matmul_transposed)
    raise ValueError(f"unknown matmul backend {name!r}; expected one of {BACKENDS}")


def describe_backend(name: str) -> str:
    """One line for the start-up log."""
    if name == "cpu":
        from pallas_kernels import cpu_matmul

        return (f"cpu (native kernel, pallas_kernels/cpu_matmul.cc: bfloat16, up to {cpu_matmul.MAX_ROWS} rows; "
                "XLA's dot above)")
    return "xla (XLA's dot)"


def resolve_backend(name: str, dtype: object, platform: str | None = None, tensor_parallel: int = 1) -> str:
    """The concrete backend ("xla" or "cpu") of a --matmul-backend choice for a model of `dtype` on
    `platform` (default: jax's default backend). "cpu" is built here, so a missing compiler or
    instruction set fails at start-up, not at the first step."""
    platform = platform or jax.default_backend()
    if name == "xla":
        return name
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"--matmul-backend cpu runs on the CPU only, not on {platform}")
        if tensor_parallel > 1:
            raise ValueError(f"--matmul-backend cpu does not shard over devices; use xla with "
                             f"--tensor-parallel-size {tensor_parallel}")
        if jnp.dtype(dtype) != jnp.bfloat16:
            raise ValueError(f"--matmul-backend cpu multiplies bfloat16 weights; this model runs in "
                             f"{jnp.dtype(dtype).name} (use --dtype bfloat16, or xla)")
        from pallas_kernels import cpu_matmul

        if not cpu_matmul.ensure_built():
            raise ValueError("--matmul-backend cpu needs AVX512-BF16 (Zen 4, Sapphire Rapids or later); "
                             "this CPU lacks it")
        return name
    if name == "auto":
        # The kernel computes bfloat16 only, and (like the CPU attention kernel) has no sharding rule.
        if platform != "cpu" or tensor_parallel > 1 or jnp.dtype(dtype) != jnp.bfloat16:
            return "xla"
        from pallas_kernels import cpu_matmul

        return "cpu" if cpu_matmul.available() else "xla"
    raise ValueError(f"matmul backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
