#!/usr/bin/env bash
# Gathers the project's accelerator figures on the host it runs on, as JSON under OUT_DIR, in
# about 8 minutes: `rlax doctor`, the tests marked `accelerator`, and benchmarks/accelerator.py
# (decode tokens/s at 64 and 256 slots against the HBM roofline, the train step's MFU, with
# Qwen2.5-1.5B shapes and random bfloat16 weights). On a host where JAX finds only the CPU it runs
# the CPU form (the same code on a small model) and says what it skipped; CI runs that form.
#   bash scripts/device_check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/device_check.sh OUT_DIR}
mkdir -p "$out"
py=.venv/bin/python
export JAX_PLATFORMS="${RLAX_DEVICE_CHECK_PLATFORMS-}"  # unset: JAX picks the accelerator
export XLA_FLAGS=""
started=$(date +%s)
platform=$($py -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo none)
echo "[device_check] JAX platform: $platform; figures under $out"
skipped=()

step() {  # step NAME SECONDS COMMAND...: runs it with a time limit, its output in OUT_DIR/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "[device_check] $name: exit $rc after $(( $(date +%s) - t0 ))s ($out/$name.log)"
  printf '{"step": "%s", "exit": %d, "seconds": %d}\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" \
    >> "$out/steps.jsonl"
  return 0
}

: > "$out/steps.jsonl"
step doctor 120 $py -m rlax_tasks.cli doctor
step accelerator-tests 150 $py -m pytest -n 0 -p no:cacheprovider -q -m accelerator \
  --junitxml "$out/accelerator-tests.xml" tests/accelerator
if [[ "$platform" == gpu || "$platform" == tpu ]]; then
  step benchmark 300 $py benchmarks/accelerator.py --json-out "$out/accelerator.json"
else
  skipped+=("the accelerator tests (they skip themselves on $platform)")
  skipped+=("Qwen2.5-1.5B shapes: benchmarks/accelerator.py runs its small shape on $platform")
  step benchmark 300 $py benchmarks/accelerator.py --shape small --slots 4,8 --prompt-len 16 \
    --new-tokens 8 --train-batch 4 --train-seq-len 32 --micro-batch 2 --repeats 1 \
    --json-out "$out/accelerator.json"
fi
$py - "$out" "$platform" "$(( $(date +%s) - started ))" "${skipped[@]}" <<'PY'
import json, os, sys
out, platform, seconds, skipped = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
with open(os.path.join(out, "steps.jsonl")) as f:
    steps = [json.loads(line) for line in f if line.strip()]
summary = {"platform": platform, "seconds": seconds, "steps": steps, "skipped": skipped}
bench = os.path.join(out, "accelerator.json")
if os.path.exists(bench):
    with open(bench) as f:
        summary["accelerator"] = json.load(f)
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
for line in skipped:
    print(f"[device_check] skipped: {line}")
failed = [s["step"] for s in steps if s["exit"] != 0]
print(f"[device_check] {'failed: ' + ', '.join(failed) if failed else 'every step passed'}; "
      f"{seconds}s; {os.path.join(out, 'summary.json')}")
sys.exit(1 if failed else 0)
PY
