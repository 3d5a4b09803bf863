#!/usr/bin/env bash
# Usage: scripts/retry.sh ATTEMPTS COMMAND...
# Run COMMAND until it succeeds, at most ATTEMPTS times, waiting longer after each failure.
# The installs download several GB (torch's CUDA wheels); one CI run failed when a 555 MB wheel's
# connection kept dropping 13 MB from the end and pip's own resumes got no further bytes. A fresh
# attempt opens new connections, so the whole install is retried rather than the run failed.
set -u
attempts=$1; shift
for ((i = 1; ; i++)); do
  "$@" && exit 0
  rc=$?
  if ((i >= attempts)); then
    echo "retry.sh: failed $i times (exit $rc): $*" >&2
    exit "$rc"
  fi
  echo "retry.sh: attempt $i of $attempts failed (exit $rc); retrying in $((30 * i)) s: $*" >&2
  sleep $((30 * i))
done
