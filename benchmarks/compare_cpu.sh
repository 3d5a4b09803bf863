#!/usr/bin/env bash
# CPU side-by-side: jaxserve vs llama-cpp-python's server vs HF transformers generate, one run.
#
#   bash benchmarks/compare_cpu.sh [flags for benchmarks.compare_cpu, e.g. --out-dir DIR]
#
# Builds llama-cpp-python[server] into $LLAMACPP_VENV (default /tmp/llamacpp-venv) the first time:
# it compiles llama.cpp from source, ~10-20 min on 2 cores, kept at low priority. Then runs
# `python -m benchmarks.compare_cpu` from the repository's .venv (make test or make install first;
# plots need the bench extra: .venv/bin/pip install -e '.[bench]').
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMACPP_VENV=${LLAMACPP_VENV:-/tmp/llamacpp-venv}
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "error: $PY not found: run 'make install' (or 'make test') first" >&2
  exit 1
fi
if ! "$LLAMACPP_VENV/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
  echo "building llama-cpp-python[server] into $LLAMACPP_VENV (compiles llama.cpp; ~10-20 min on 2 cores)" >&2
  "$(scripts/find-python.sh)" -m venv "$LLAMACPP_VENV"
  "$LLAMACPP_VENV/bin/pip" install --quiet --upgrade pip
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} nice -n 15 \
    "$LLAMACPP_VENV/bin/pip" install --quiet 'llama-cpp-python[server]'
fi
exec "$PY" -m benchmarks.compare_cpu --llamacpp-python "$LLAMACPP_VENV/bin/python" "$@"
