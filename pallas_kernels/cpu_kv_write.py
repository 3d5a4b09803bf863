"""Writing new K/V tokens into the paged cache on the CPU through a native kernel (`cpu_kv_write.cc`,
an XLA FFI custom call whose outputs alias the caches, so they are updated in place).

`write_kv`'s semantics and signature (it is tested against it), for the "cpu" attention backend.
XLA:CPU has no float8 scatter: an 8-bit cache (`--kv-cache-dtype fp8*`) was widened to float16
around every layer's write, and scattering its bytes instead costs two full-cache bitcast copies
per layer. The kernel copies each token's rows as bytes, whatever the dtype, so no step holds any
array the size of the cache but the cache itself.

Built on first use like the attention kernel (`native.build`); without a compiler the XLA scatter
(`write_kv`) runs instead.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels._common import stacked_cache, to_cache_dtype
from pallas_kernels.kv_write import write_kv

log = logging.getLogger("jaxserve.kernels")

SOURCE = Path(__file__).with_name("cpu_kv_write.cc")
TARGET = "jaxserve_cpu_kv_write"


@functools.cache
def available() -> bool:
    """Whether the kernel builds, loads and registers here (logs why not, once)."""
    def register() -> bool:
        lib = native.load(SOURCE)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxserveKvWrite), platform="cpu")
        return True

    return native.usable(register, "the native CPU KV write", "using XLA's scatter")


def write_kv_cpu(
    k_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    v_pages: jax.Array,
    k_new: jax.Array,  # [tokens, kv_heads, head_dim]
    v_new: jax.Array,
    slot_mapping: jax.Array,  # [tokens] int32: page * page_size + offset, -1 = padding
    *,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`write_kv`, done by the native kernel in place (by `write_kv` itself when it is unavailable).
    The caches must be donated or loop-carried for XLA to skip copying them, as for `write_kv`."""
    if not available():
        return write_kv(k_pages, v_pages, k_new, v_new, slot_mapping, layer=layer)
    stacked, v_stacked, layer = stacked_cache(k_pages, v_pages, layer)
    k_new, v_new = to_cache_dtype(k_new, stacked.dtype), to_cache_dtype(v_new, stacked.dtype)
    out = jax.ShapeDtypeStruct(stacked.shape, stacked.dtype)
    k_out, v_out = jax.ffi.ffi_call(TARGET, (out, out), input_output_aliases={0: 0, 1: 1})(
        stacked, v_stacked, k_new, v_new, jnp.asarray(slot_mapping, jnp.int32).reshape(-1),
        jnp.asarray(layer, jnp.int32).reshape(()))
    if len(k_pages.shape) == 4:
        return k_out[0], v_out[0]
    return k_out, v_out
