#!/usr/bin/env bash
# Downloads into .device-wheels/ (ignored by git) the wheels a device run needs that the device
# image lacks, for its Python 3.12 on x86-64 Linux, at the versions constraints.txt pins:
# the services' HTTP stack, the math verifier and the model cache's CRC32C. The image holds the
# rest (jax and its CUDA plugin, flax, optax, orbax, transformers, pandas, pyarrow, pytest, ...).
#   bash scripts/device_wheels.sh && <run> bash scripts/device_check.sh OUT --carry .device-wheels
set -euo pipefail
cd "$(dirname "$0")/.."
# what the image lacks, read from its package list (the device tool's KINDS.md)
packages=(google-crc32c fastapi starlette pydantic pydantic_core annotated-types
  typing-inspection uvicorn math-verify latex2sympy2_extended antlr4-python3-runtime)
pins=()
for name in "${packages[@]}"; do
  pin=$(grep -i -E "^${name//[-_]/[-_]}==" constraints.txt || true)
  [[ -n "$pin" ]] || { echo "device_wheels: $name is not pinned in constraints.txt" >&2; exit 2; }
  pins+=("$pin")
done
rm -rf .device-wheels && mkdir -p .device-wheels
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .device-wheels "${pins[@]}"
ls .device-wheels
