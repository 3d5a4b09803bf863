import os
import sys

# Tests run on the CPU in float32 with exact matmuls, whatever machine they run on.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import pytest  # noqa: E402

# Files that take minutes, longest first. `make test` runs files whole on two workers, handed out
# in collection order (--no-loadscope-reorder); started last, one of these would run alone at the
# end while the other worker idles. Measured on the 2-core CI box (benchmarks/RESULTS.md).
LONGEST_FILES = (
    "tests/tpu_aot/test_tpu_steps.py",
    "tests/parallel/test_tensor_parallel.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Run the LONGEST_FILES first (a stable sort: everything else keeps its order)."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One jaxserve cache (converted tokenizers, weights, compiled steps) shared by the whole test run.

    Under pytest-xdist each worker has its own, but their `xla` directories (JAX's persistent
    compilation cache) are one: the workers build many of the same step programs (the live
    server's engine, the SmolLM2 engines of equal configurations), and a program one worker
    compiled the other reads back. JAX writes an entry in place, so a worker may read one still
    being written: it then warns and compiles it itself, which is all a miss costs."""
    directory = tmp_path_factory.mktemp("jaxserve-cache")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "xla-shared-by-workers"
        shared.mkdir(exist_ok=True)
        (directory / "xla").symlink_to(shared, target_is_directory=True)
    return directory


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(cache_dir):
    """JAX's persistent compilation cache for the run, as the server enables it: tests that build
    the same step shapes read them back instead of compiling them again. A run of host-only tests
    (tests/unit) never imports jax, so it is left alone then."""
    if sys.modules.get("jax") is not None:
        from jaxserve.engine.build import enable_compilation_cache

        enable_compilation_cache(cache_dir / "xla")


@pytest.fixture(scope="session")
def hf_smollm2():
    """HF transformers' SmolLM2, dequantized by HF from the same GGUF: the reference of the engine
    and model tests. Loaded once per run (HF's GGUF dequantization takes ~18 s on two cores)."""
    import torch
    from smollm2 import GGUF_NAME, smollm2_dir
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(cache_dir):
    from jaxserve.tokenizer import load_tokenizer
    from smollm2 import GGUF_NAME, smollm2_dir

    return load_tokenizer(smollm2_dir(), GGUF_NAME, cache_dir=cache_dir)
