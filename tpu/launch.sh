#!/usr/bin/env bash
# Start jaxserve on every worker of a multi-host TPU VM slice: one process per host under
# jax.distributed, process 0 (worker 0) serving HTTP. Run it from your workstation with gcloud
# configured; it only starts processes on the TPU workers, never here.
#
#   tpu/launch.sh TPU_NAME ZONE CONFIG NUM_WORKERS [-- EXTRA_JAXSERVE_FLAGS...]
#   tpu/launch.sh my-v5e-16 us-west4-a configs/tpu-v5e-16-llama3-70b.yaml 4
#
# Environment: REMOTE_DIR (the repo on every worker, default ~/jaxserve), REMOTE_PYTHON (default
# .venv/bin/python, relative to REMOTE_DIR), COORDINATOR_PORT (default 8476).
# Logs go to REMOTE_DIR/jaxserve.log and the pid to REMOTE_DIR/jaxserve.pid on each worker.
set -euo pipefail

usage() {
  echo "usage: $0 TPU_NAME ZONE CONFIG NUM_WORKERS [-- EXTRA_JAXSERVE_FLAGS...]" >&2
  echo "  CONFIG is a path relative to the repo (e.g. configs/tpu-v5e-16-llama3-70b.yaml)" >&2
  exit 2
}

[[ $# -ge 4 ]] || usage
NAME=$1 ZONE=$2 CONFIG=$3 NUM_WORKERS=$4
shift 4
if [[ $# -gt 0 ]]; then
  [[ $1 == "--" ]] || usage
  shift
fi
[[ -n $NAME && -n $ZONE && -n $CONFIG ]] || usage
[[ $NUM_WORKERS =~ ^[1-9][0-9]*$ ]] || { echo "NUM_WORKERS must be a positive integer, got '$NUM_WORKERS'" >&2; usage; }
# The workers run the same checkout, so a config missing here is a typo there too.
REPO_ROOT=$(cd "$(dirname "$0")/.." && pwd)
[[ -f $REPO_ROOT/$CONFIG ]] || { echo "no such config in the repo: $CONFIG" >&2; exit 2; }

REMOTE_DIR=${REMOTE_DIR:-'~/jaxserve'}
REMOTE_PYTHON=${REMOTE_PYTHON:-.venv/bin/python}
COORDINATOR_PORT=${COORDINATOR_PORT:-8476}

# Worker 0's internal address: the coordinator listens there (bound to that address only, not
# all interfaces), on the slice's private VPC network.
IP=$(gcloud compute tpus tpu-vm describe "$NAME" --zone "$ZONE" --format='value(networkEndpoints[0].ipAddress)')
[[ -n $IP ]] || { echo "could not read worker 0's internal IP of $NAME in $ZONE" >&2; exit 1; }

QCONFIG=$(printf '%q' "$CONFIG")
EXTRA=""
for a in "$@"; do EXTRA+=" $(printf '%q' "$a")"; done

# Each worker reads its own index from the TPU metadata server, so one command serves all.
REMOTE="cd $REMOTE_DIR || exit 1; WORKER_ID=\$(curl -s -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number); [ -n \"\$WORKER_ID\" ] || { echo 'no agent-worker-number in the metadata' >&2; exit 1; }; nohup $REMOTE_PYTHON -m jaxserve --config $QCONFIG --coordinator-address $IP:$COORDINATOR_PORT --num-processes $NUM_WORKERS --process-id \$WORKER_ID$EXTRA > jaxserve.log 2>&1 < /dev/null & echo \$! > jaxserve.pid; echo \"worker \$WORKER_ID: started pid \$!\""

echo "coordinator: $IP:$COORDINATOR_PORT, $NUM_WORKERS processes"
gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "$REMOTE"
echo "HTTP is served by worker 0: gcloud compute tpus tpu-vm ssh $NAME --zone $ZONE --worker=0 -- -L 8000:localhost:8000"
