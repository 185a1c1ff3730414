#!/usr/bin/env bash
# A device run: every accelerator figure under one deadline (default 480 s), the most valuable
# first (decode tokens/s at 256 and 64 slots, the train step's MFU, a profile of a decode chunk
# and a train step, the accelerator tests, rlax doctor, tiny-arith end to end on a GPU), its
# summary rewritten after every part. OUT_DIR ends with at most 4 files: summary.json,
# figures.json, logs.tar.gz. On a host where JAX finds only the CPU it runs the CPU form; CI
# runs that form through this script.
#   bash scripts/device_check.sh OUT_DIR [--deadline-s 480] [--parts decode,train]
# The interpreter: RLAX_PYTHON, else .venv/bin/python, else the image's python3. Wheels carried
# in .device-wheels/ (bash scripts/device_wheels.sh fetches them here) are installed first,
# offline, into an interpreter other than .venv's (which has them).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/device_check.sh OUT_DIR [--deadline-s S] [--parts A,B]}
shift
if [[ -n "${RLAX_PYTHON:-}" ]]; then py=$RLAX_PYTHON
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3
fi
export JAX_PLATFORMS="${RLAX_DEVICE_CHECK_PLATFORMS-}"  # unset: JAX picks the accelerator
export XLA_FLAGS=""
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$py" != .venv/bin/python ]] && compgen -G ".device-wheels/*.whl" > /dev/null; then
  echo "[device_check] installing $(ls .device-wheels/*.whl | wc -l) carried wheel(s) into $py"
  "$py" -m pip install --quiet --no-index --no-deps --disable-pip-version-check \
    .device-wheels/*.whl || echo "[device_check] the carried wheels did not install (above)"
fi
exec "$py" benchmarks/device_run.py "$out" --python "$py" "$@"
