#!/usr/bin/env bash
# Print the path of the Python to build the venv with: 3.12 (what CI and the GPU machine run)
# wherever it is -- python3.12 on PATH, or a pyenv-installed 3.12 (pyenv's shims answer only
# for the selected version) -- and failing that any Python >= 3.12.
set -u
works() { "$1" -c 'import sys; sys.exit(not (3, 12) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null; }
exe_of() { "$1" -c 'import sys; print(sys.executable)'; }
pyenv_root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
candidates=(python3.12)
for d in $(ls -d "$pyenv_root"/versions/3.12* 2>/dev/null | sort -rV); do candidates+=("$d/bin/python3"); done
candidates+=(python3.13 python3)
for d in $(ls -d "$pyenv_root"/versions/3.13* 2>/dev/null | sort -rV); do candidates+=("$d/bin/python3"); done
for c in "${candidates[@]}"; do
  if works "$c"; then exe_of "$c"; exit 0; fi
done
echo "error: no Python 3.12 found (install python3.12, or: pyenv install 3.12)" >&2
exit 1
