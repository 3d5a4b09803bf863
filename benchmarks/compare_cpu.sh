#!/usr/bin/env bash
# CPU side-by-side: jaxserve vs llama.cpp's own llama-server (parallel slots), interleaved rounds.
#
#   bash benchmarks/compare_cpu.sh [flags for benchmarks.compare_cpu, e.g. --rounds 3 --out-dir DIR]
#
# The peer is the llama-server binary at $LLAMA_SERVER (default ~/.cache/jaxserve-peers/llama-server).
# Only when it is missing is it built, once, by ../shared/peers/build-llama-server.sh (about 12 min
# on 2 cores; $LLAMA_SERVER_BUILD names another build script); a binary already there is never
# rebuilt. Then runs `python -m benchmarks.compare_cpu` from the repository's .venv (make install
# or make test first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "error: $PY not found: run 'make install' (or 'make test') first" >&2
  exit 1
fi
LLAMA_SERVER=${LLAMA_SERVER:-$HOME/.cache/jaxserve-peers/llama-server}
if [ ! -x "$LLAMA_SERVER" ]; then
  BUILD=${LLAMA_SERVER_BUILD:-../shared/peers/build-llama-server.sh}
  if [ ! -f "$BUILD" ]; then
    echo "error: no llama-server at $LLAMA_SERVER and no build script at $BUILD (set LLAMA_SERVER or LLAMA_SERVER_BUILD)" >&2
    exit 1
  fi
  echo "building llama-server into $(dirname "$LLAMA_SERVER") with $BUILD (~12 min on 2 cores)" >&2
  # The script prints the binary's path last on stdout; its build output goes to stderr.
  LLAMA_SERVER=$(bash "$BUILD" "$(dirname "$LLAMA_SERVER")" | tail -n 1)
fi
exec "$PY" -m benchmarks.compare_cpu --llama-server "$LLAMA_SERVER" "$@"
