#!/usr/bin/env bash
# Sets up the project on a fresh machine: Debian packages it needs (when missing), then .venv with
# every Python package pinned by constraints.txt. `--test` adds the test extras (pytest, ruff,
# torch CPU for the transformers parity tests, wandb; Debian g++ and chromium); `--bench` adds
# those and the benchmark extras (TRL for benchmarks/vs_trl.py). `--gpu` adds JAX's CUDA 12 plugin
# (NVIDIA GPU hosts), `--tpu` jax[tpu] with its libtpu (TPU VMs); either combines with the others.
# Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: bash scripts/setup.sh [--test | --bench] [--gguf] [--gpu | --tpu]"
wanted=()
for arg in "$@"; do
  case "$arg" in
    --test) wanted+=(test) ;;
    --bench) wanted+=(test bench) ;;  # benchmarks/vs_trl.py needs TRL (and torch, as the tests)
    --gguf) wanted+=(gguf) ;;  # `rlax import gguf`: the gguf reader and CPU torch
    --gpu) wanted+=(gpu) ;;
    --tpu) wanted+=(tpu) ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
if [[ " ${wanted[*]-} " == *" gpu "* && " ${wanted[*]-} " == *" tpu "* ]]; then
  echo "setup.sh: --gpu and --tpu: choose the accelerator of this host ($usage)" >&2; exit 2
fi
extras=""  # e.g. "[test,gpu]": each extra once, in the order given
for extra in ${wanted[@]+"${wanted[@]}"}; do
  [[ ",${extras}," == *",${extra},"* ]] || extras="${extras:+$extras,}$extra"
done
extras="${extras:+[$extras]}"

# Debian packages the project needs at run time: bubblewrap sandboxes generated code, which runs
# under Debian's python3 (g++ is optional: C++ judging is enabled when it is present).
apt_packages=(bubblewrap python3)
# the tests also drive the Airflow UI in headless Chromium (tests/dags/test_browser.py, Selenium),
# validate docker-compose.yaml with `docker-compose config` (no Docker engine needed) and judge
# C++ solutions (g++)
if [[ "$extras" == *test* ]]; then apt_packages+=(chromium chromium-driver docker-compose g++); fi
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "[setup] installing Debian packages: ${missing[*]}"
  sudo_cmd=""; [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

python=${PYTHON:-}
if [[ -z "$python" ]]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null; then python=$candidate; break; fi
  done
fi
if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv with $($python --version)"
  "$python" -m venv .venv
fi

# torch (tests only) is pinned to the CPU build; on this kind of machine it is a local wheel.
find_links=()
if [[ -d /opt/wheels ]]; then find_links=(--find-links /opt/wheels); fi

echo "[setup] installing pinned packages (constraints.txt)${extras:+ with $extras}"
.venv/bin/python -m pip install -q --disable-pip-version-check pip==26.3 setuptools==84.2.1 wheel==0.48.0
# bytecode compiled afterwards on every core (pip compiles on one), this checkout's packages too
# (where PYTHONDONTWRITEBYTECODE is set, every process would compile them again); a file of a
# package that does not compile (Python 2 test data, templates) is skipped, as pip skips it
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check "${find_links[@]}" \
  --no-build-isolation -c constraints.txt -e ".${extras}"
.venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages rlax_tasks dags plugins tests \
  >/dev/null 2>&1 || true
echo "[setup] done: $(.venv/bin/python -c 'import jax, flax; print(f"jax {jax.__version__}, flax {flax.__version__}")')"
if [[ "$extras" == *gpu* || "$extras" == *tpu* ]]; then  # what JAX finds here now
  echo "[setup] JAX sees: $(.venv/bin/python -c 'import jax; print(jax.default_backend(), jax.device_count(), "device(s)")')"
fi
