#!/bin/bash
# Startup script of an RLAX Cloud TPU node (set as the node's "startup-script" metadata by the
# cloud_tpu backend, rlax_tasks/compute/cloud_tpu.py). It runs on every host of the slice, at
# every boot: pulls the runtime image and runs the RLAX node agent in it. The agent publishes
# this host's address, watches the slice's control directory (gs://...) for job specs and runs
# `rlax <argv>` for the ones meant for this host through the job runner, which writes heartbeats
# and exit codes next to the spec (see rlax_tasks/compute/agent.py and jobstatus.py).
#
# Node metadata read here (written by the backend):
#   rlax-image        the runtime image (e.g. us-docker.pkg.dev/PROJECT/rlax/rlax-tasks:TAG)
#   rlax-slice-root   gs://.../<run_id>/slices/<name>/<instance id>
#   rlax-entrypoint   JSON list, the rlax command inside the image (default ["rlax"])
#   rlax-agent-poll-s seconds between polls of the control directory
# and, set by Cloud TPU on every host: agent-worker-number (the host's index in the slice) and
# the host's internal address (instance/network-interfaces/0/ip).
#
# RLAX_METADATA_URL overrides the metadata server (the fake Cloud TPU API serves one per host;
# infra/fakes/cloud_tpu.py runs this script with stand-ins for docker, tini and gcloud).
set -euo pipefail

METADATA_URL="${RLAX_METADATA_URL:-http://metadata.google.internal/computeMetadata/v1}"
metadata() { curl -sf --retry 5 --retry-connrefused -H "Metadata-Flavor: Google" "$METADATA_URL/$1"; }
md() { metadata "instance/attributes/$1" || echo "${2:-}"; }

IMAGE="$(md rlax-image)"
SLICE_ROOT="$(md rlax-slice-root)"
ENTRYPOINT="$(md rlax-entrypoint '["rlax"]')"
POLL="$(md rlax-agent-poll-s 2)"
# every TPU VM host has its index in the slice as metadata
WORKER="$(md agent-worker-number 0)"
# where the other hosts reach this one (a multi-host job's coordinator runs on its first host)
ADDRESS="$(metadata instance/network-interfaces/0/ip || true)"

if [[ -z "$IMAGE" || -z "$SLICE_ROOT" ]]; then
  echo "rlax startup: rlax-image and rlax-slice-root metadata are required" >&2
  exit 1
fi
if [[ -z "$ADDRESS" ]]; then
  echo "rlax startup: no address in the metadata (instance/network-interfaces/0/ip)" >&2
  exit 1
fi

# Artifact Registry credentials for docker (the node's service account)
REGISTRY="${IMAGE%%/*}"
if [[ "$REGISTRY" == *pkg.dev || "$REGISTRY" == *gcr.io ]]; then
  gcloud auth configure-docker "$REGISTRY" --quiet
fi

PULLED=""
for attempt in 1 2 3 4 5; do
  if docker pull "$IMAGE"; then
    PULLED=1
    break
  fi
  echo "rlax startup: docker pull $IMAGE failed (attempt $attempt of 5)" >&2
  if [[ "$attempt" -lt 5 ]]; then sleep $((attempt * 10)); fi
done
if [[ -z "$PULLED" ]]; then
  echo "rlax startup: could not pull $IMAGE; no agent on host $WORKER" >&2
  exit 1
fi

# One agent per host; --restart keeps it up if it crashes (it never starts a job twice).
# The image's ENTRYPOINT is `tini -- rlax`: the agent is not an rlax sub-command, so it replaces
# the entrypoint with tini (PID 1, reaps the job runners' children) and runs python under it.
docker rm -f rlax-agent >/dev/null 2>&1 || true
docker run -d --name rlax-agent --restart=on-failure \
  --net=host --privileged \
  --ulimit memlock=-1 --shm-size=16g \
  -v /dev:/dev -v /tmp:/tmp \
  -e RLAX_WORKER_ID="$WORKER" \
  --entrypoint tini \
  "$IMAGE" \
  -- python -m rlax_tasks.compute.agent \
    --slice-root "$SLICE_ROOT" --worker "$WORKER" --address "$ADDRESS" \
    --entrypoint "$ENTRYPOINT" --poll "$POLL"
