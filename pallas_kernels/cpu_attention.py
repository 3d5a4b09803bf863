"""Paged attention on the CPU through a native kernel (`cpu_attention.cc`, an XLA FFI custom call).

The CPU counterpart of the Pallas kernels: same signatures and semantics as
`ragged_paged_attention_reference` / `paged_decode_attention_reference` (it is tested against
them), backend name "cpu". XLA:CPU runs the pure-jnp references' page gathers as per-element loops
and writes the gathered keys and values out, widened to float32, before the products read them:
on SmolLM2 with 16 sequences that was ~20 ms of a ~50 ms decode step. The kernel reads each
page row once, straight from the cache, for a whole group of query heads and a block of query rows.

The source is compiled on first use with the system C++ compiler (`$CXX`, else g++ / c++ /
clang++) for this machine (-march=native) into a cache directory keyed by the source, the
compiler, jaxlib and the CPU, so later processes only load it. `available()` says whether that
worked; without a compiler the engine's "auto" backend stays on the reference (with a warning),
and `--attention-backend cpu` fails with the compiler's message.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import stacked_cache
from pallas_kernels.paged_attention import paged_decode_attention_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

log = logging.getLogger("jaxserve.kernels")

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "jaxserve_cpu_paged_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fopenmp-simd", "-w")
# What the kernel computes; anything else goes to the pure-jnp reference (same results, slower).
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 192, 256)
DTYPES = (jnp.float32, jnp.bfloat16)


class BuildError(RuntimeError):
    """The native CPU kernel could not be compiled or loaded."""


def cache_dir() -> Path:
    """Where built kernels live: $JAXSERVE_KERNEL_CACHE, else ~/.cache/jaxserve/kernels."""
    env = os.environ.get("JAXSERVE_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "jaxserve" / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise BuildError("no C++ compiler found (set $CXX, or install g++) to build the native CPU attention kernel")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _build() -> Path:
    cxx = _compiler()
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join(
        [SOURCE.read_text(), cxx, version, " ".join(FLAGS), jax.lib.__version__, _cpu_signature()]).encode()).hexdigest()
    out = cache_dir() / f"cpu_attention-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the native CPU attention kernel (%s, once per machine) ...", cxx)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([cxx, *FLAGS, "-I", include, str(SOURCE), "-o", str(tmp_out)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"building {SOURCE.name} with {cxx} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders each write their own temp file
    return out


@functools.cache
def _register() -> None:
    """Build (or find) the kernel and register it with XLA once per process; raises BuildError."""
    try:
        path = _build()
    except OSError as e:  # e.g. a read-only cache directory
        raise BuildError(f"building the native CPU attention kernel failed: {e}") from e
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        raise BuildError(f"loading the native CPU attention kernel {path} failed: {e}") from e
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxservePagedAttention), platform="cpu")


def ensure_built() -> None:
    """Build and register the kernel now; raises BuildError (with the compiler's message) if it can't."""
    _register()


@functools.cache
def available() -> bool:
    """Whether the native kernel builds and loads here (logs why not, once)."""
    try:
        _register()
        return True
    except BuildError as e:
        log.warning("native CPU attention unavailable, using the pure-jnp reference: %s", e)
        return False


def supports(head_dim: int, dtype: Any, q_dtype: Any = None) -> bool:
    """Whether the kernel computes this head_dim and cache dtype, with queries of that same dtype
    (else the reference does: it keeps float32 queries over a bfloat16 cache in float32)."""
    if q_dtype is not None and jnp.dtype(q_dtype) != jnp.dtype(dtype):
        return False
    return head_dim in HEAD_DIMS and any(jnp.dtype(dtype) == jnp.dtype(d) for d in DTYPES)


def _call(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array, cu_q_lens: jax.Array,
          kv_lens: jax.Array, num_seqs: Any, *, scale: float, softcap: float | None, window: Any,
          layer: Any) -> jax.Array:
    _register()
    k_pages, v_pages, layer = stacked_cache(k_pages, v_pages, layer)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k_pages, v_pages, i32(page_tables), i32(cu_q_lens), i32(kv_lens), i32(num_seqs).reshape(()),
        i32(layer).reshape(()), i32(window).reshape(()),
        scale=np.float32(scale), softcap=np.float32(softcap or 0.0))


def ragged_paged_attention_cpu(
    q: jax.Array,  # [total_tokens, q_heads, head_dim]
    k_pages: jax.Array,  # [layers,] kv_heads, num_pages, page_size, head_dim
    v_pages: jax.Array,
    page_tables: jax.Array,  # [max_seqs, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    kv_lens: jax.Array,  # [max_seqs] int32
    num_seqs: jax.Array | int,
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    layer: jax.Array | int | None = None,
) -> jax.Array:  # [total_tokens, q_heads, head_dim]
    """`ragged_paged_attention_reference`, computed by the native kernel (by the reference itself
    for a head_dim or dtype the kernel does not cover)."""
    if not supports(q.shape[-1], k_pages.dtype, q.dtype):
        return ragged_paged_attention_reference(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, num_seqs,
                                                scale=scale, softcap=softcap, window=window, layer=layer)
    return _call(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, num_seqs,
                 scale=scale, softcap=softcap, window=window, layer=layer)


def paged_decode_attention_cpu(
    q: jax.Array,  # [batch, q_heads, head_dim]
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,  # [batch, max_pages_per_seq] int32
    lengths: jax.Array,  # [batch] int32, including the current token
    *,
    scale: float,
    softcap: float | None = None,
    window: jax.Array | int = 0,
    layer: jax.Array | int | None = None,
) -> jax.Array:  # [batch, q_heads, head_dim]
    """`paged_decode_attention_reference`, computed by the native kernel: a ragged batch of one
    token per sequence (a length-0 row is padding and returns zeros)."""
    if not supports(q.shape[-1], k_pages.dtype, q.dtype):
        return paged_decode_attention_reference(q, k_pages, v_pages, page_tables, lengths,
                                                scale=scale, softcap=softcap, window=window, layer=layer)
    batch = q.shape[0]
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    return _call(q, k_pages, v_pages, page_tables, cu, lengths, batch,
                 scale=scale, softcap=softcap, window=window, layer=layer)
