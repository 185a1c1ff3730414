#!/bin/bash
# Startup script of an RLAX Cloud TPU node (set as the node's "startup-script" metadata by the
# cloud_tpu backend, rlax_tasks/compute/cloud_tpu.py). It runs on every host of the slice, at
# every boot: pulls the runtime image and runs the RLAX node agent in it. The agent watches the
# slice's control directory (gs://...) for job specs and runs `rlax <argv>` for each one through
# the job runner, which writes heartbeats and exit codes next to the spec (see
# rlax_tasks/compute/agent.py and jobstatus.py).
#
# Node metadata read here (written by the backend):
#   rlax-image        the runtime image (e.g. us-docker.pkg.dev/PROJECT/rlax/rlax-tasks:TAG)
#   rlax-slice-root   gs://.../<run_id>/slices/<name>/<instance id>
#   rlax-entrypoint   JSON list, the rlax command inside the image (default ["rlax"])
#   rlax-agent-poll-s seconds between polls of the control directory
set -euo pipefail

MD=http://metadata.google.internal/computeMetadata/v1/instance/attributes
md() { curl -sf -H "Metadata-Flavor: Google" "$MD/$1" || echo "${2:-}"; }

IMAGE="$(md rlax-image)"
SLICE_ROOT="$(md rlax-slice-root)"
ENTRYPOINT="$(md rlax-entrypoint '["rlax"]')"
POLL="$(md rlax-agent-poll-s 2)"
# every TPU VM host has its index in the slice as metadata
WORKER="$(md agent-worker-number 0)"

if [[ -z "$IMAGE" || -z "$SLICE_ROOT" ]]; then
  echo "rlax startup: rlax-image and rlax-slice-root metadata are required" >&2
  exit 1
fi

# Artifact Registry credentials for docker (the node's service account)
REGISTRY="${IMAGE%%/*}"
if [[ "$REGISTRY" == *pkg.dev || "$REGISTRY" == *gcr.io ]]; then
  gcloud auth configure-docker "$REGISTRY" --quiet
fi

for attempt in 1 2 3 4 5; do
  docker pull "$IMAGE" && break
  echo "rlax startup: docker pull failed (attempt $attempt), retrying" >&2
  sleep $((attempt * 10))
done

# one agent per host; --restart keeps it up if it crashes (it never starts a job twice)
docker rm -f rlax-agent >/dev/null 2>&1 || true
docker run -d --name rlax-agent --restart=on-failure \
  --net=host --privileged \
  --ulimit memlock=-1 --shm-size=16g \
  -v /dev:/dev -v /tmp:/tmp \
  -e RLAX_WORKER_ID="$WORKER" \
  "$IMAGE" \
  python -m rlax_tasks.compute.agent \
    --slice-root "$SLICE_ROOT" --worker "$WORKER" \
    --entrypoint "$ENTRYPOINT" --poll "$POLL"
