"""The builds of the native CPU kernels that this machine can test (pallas_kernels.cpu_matmul.TIERS,
cpu_attention.TIERS): "native", the serving build (AVX512-BF16 where the CPU has it, else AVX2 +
FMA), and on an AVX512-BF16 machine also "avx2", the AVX2 code that CPUs without AVX512-BF16 run. A
machine with neither has no product kernel, and the product tests are skipped with the reason; the
attention kernel's generic code runs anywhere."""

from __future__ import annotations

import pytest

from pallas_kernels import cpu_attention, cpu_matmul, cpu_qmatmul

NO_KERNEL = f"needs a C++ compiler and a CPU with {cpu_matmul.NEEDS}"


def _tiers(available) -> list[str]:
    tiers = ["native"] if available("native") else []
    if cpu_matmul.isa("native") == "AVX512-BF16" and available("avx2"):
        tiers.append("avx2")  # a separate build of the AVX2 code (native is AVX2 itself elsewhere)
    return tiers


def _params(tiers: list[str]) -> list:
    return tiers or [pytest.param("native", marks=pytest.mark.skip(reason=NO_KERNEL))]


PRODUCT_TIERS = _params(_tiers(cpu_matmul.available))  # cpu_matmul's bf16 and int8 products
BLOCK_TIERS = _params(_tiers(cpu_qmatmul.available))  # cpu_qmatmul's Q4 and Q8 products


def _attention_tiers() -> list[str]:
    if cpu_attention.isa("native") == "AVX512-BF16" and cpu_attention.isa("avx2") == "AVX2":
        return ["native", "avx2"]
    return ["native"]


ATTENTION_TIERS = _attention_tiers()  # cpu_attention's builds (its native build runs anywhere)
