"""Fixtures the SmolLM2 engine tests share."""

from __future__ import annotations

import pytest
from smollm2 import smollm2_gguf

from jaxserve.weights import load_model


@pytest.fixture(scope="module")
def model(cache_dir):
    """SmolLM2 dequantized to float32, loaded once per test module (a module may define its own)."""
    return load_model(smollm2_gguf(), "float32", cache_dir=cache_dir).model
