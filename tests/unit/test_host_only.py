"""Host bookkeeping never imports jax: the engine's host modules (the loop, the scheduler, the
step's inputs, the endings, the rows of the device batch) and every test in this folder import
and run with jax made unimportable, so they stay fast and testable anywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HOST_MODULES = [
    "jaxserve.engine.core", "jaxserve.engine.scheduler", "jaxserve.engine.step_inputs",
    "jaxserve.engine.postprocess", "jaxserve.engine.rows", "jaxserve.engine.info", "jaxserve.engine.pages",
    "jaxserve.engine.buckets", "jaxserve.engine.request", "jaxserve.engine.output", "jaxserve.engine.async_engine",
    "jaxserve.engine.ngram",
    "jaxserve.engine.beam",
    "jaxserve.engine.classify_batcher", "jaxserve.errors",
]
BLOCK = "import sys; sys.modules['jax'] = None; sys.modules['jaxlib'] = None; sys.modules['flax'] = None\n"


def test_the_engine_host_modules_import_without_jax():
    code = BLOCK + "".join(f"import {m}\n" for m in HOST_MODULES) + "print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_unit_tests_run_without_jax():
    here = Path(__file__).resolve().parent
    tests = sorted(str(p) for p in here.glob("test_*.py") if p.name != Path(__file__).name)
    # Less the test that loads the model in a fresh process of its own (14 s): it proves nothing more
    # here, as that process does not inherit the block.
    own_process = "--deselect=tests/unit/test_tokenizer.py::test_serving_needs_no_pytorch"
    code = BLOCK + "import pytest\nsys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))"
    done = subprocess.run([sys.executable, "-c", code, own_process, *tests], capture_output=True, text=True,
                          cwd=here.parents[1], timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
