"""Build and load the native CPU kernels (`cpu_attention.cc`, `cpu_kv_write.cc`, `cpu_matmul.cc`,
...): XLA FFI custom calls compiled on first use with the system C++ compiler (`$CXX`, else g++ /
c++ / clang++) for this machine (-march=native), into a cache directory keyed by the source, the
headers next to it (`cpu_parallel.h`, `cpu_avx2.h`), the compiler, jaxlib and the CPU, so later
processes only load them. A build may add preprocessor defines (`defines`): the product kernels'
"avx2" tier is the same source built with -DJAXSERVE_FORCE_AVX2, a library of its own.
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
from collections.abc import Callable
from pathlib import Path

import jax

log = logging.getLogger("jaxserve.kernels")

FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fopenmp-simd", "-w")


class BuildError(RuntimeError):
    """A native CPU kernel could not be compiled or loaded."""


def cache_dir() -> Path:
    """Where built kernels live: $JAXSERVE_KERNEL_CACHE, else ~/.cache/jaxserve/kernels."""
    env = os.environ.get("JAXSERVE_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "jaxserve" / "kernels"


def compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise BuildError("no C++ compiler found (set $CXX, or install g++) to build the native CPU kernels")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def build(source: Path, defines: tuple[str, ...] = ()) -> Path:
    """Compile `source` (with the -D flags `defines`) into a shared library in the cache (or find it
    there); raises BuildError."""
    try:
        return _build(source, defines)
    except OSError as e:  # e.g. an unreadable source, a read-only cache directory
        raise BuildError(f"building {source.name} failed: {e}") from e


def _build(source: Path, defines: tuple[str, ...]) -> Path:
    cxx = compiler()
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the sources include
    flags = (*FLAGS, *defines)
    key = hashlib.sha256("\n".join(
        [source.read_text(), *headers, cxx, version, " ".join(flags), jax.lib.__version__, _cpu_signature()]
    ).encode()).hexdigest()
    out = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the native CPU kernel %s (%s, once per machine) ...", source.name, cxx)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([cxx, *flags, "-I", include, str(source), "-o", str(tmp_out)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"building {source.name} with {cxx} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders each write their own temp file
    return out


def register(source: Path, supported: str, targets: dict[str, str], defines: tuple[str, ...] = ()) -> bool:
    """Build (or find) `source` (with `defines`), ask its `supported` function whether this CPU has
    the kernel's instructions, and if so register each XLA FFI target name -> handler symbol of
    `targets`. False when the instructions are missing; raises BuildError."""
    lib = load(source, defines)
    if not getattr(lib, supported)():
        return False
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True


def usable(register: Callable[[], bool], what: str, fallback: str,
           needs: str = "AVX512-BF16") -> bool:
    """Whether a kernel's `register` (build, load, register with XLA; False when the CPU lacks the
    instructions) succeeds, logging why not: `what` is the kernel, `fallback` what runs instead,
    `needs` the instructions it takes."""
    try:
        ok = register()
    except BuildError as e:
        log.warning("%s unavailable, %s: %s", what, fallback, e)
        return False
    if not ok:
        log.info("%s need %s, which this CPU lacks; %s", what, needs, fallback)
    return ok


@functools.cache
def load(source: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or find) `source` (with `defines`) and load it, once per process; raises BuildError."""
    path = build(source, defines)
    try:
        return ctypes.cdll.LoadLibrary(str(path))
    except OSError as e:
        raise BuildError(f"loading the native CPU kernel {path} failed: {e}") from e
