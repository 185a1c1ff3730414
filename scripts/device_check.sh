#!/usr/bin/env bash
# Gathers the project's accelerator figures on the host it runs on, as JSON under OUT_DIR, in
# about 8 minutes: `rlax doctor`, the tests marked `accelerator`, and benchmarks/accelerator.py
# (decode tokens/s at 64 and 256 slots against the HBM roofline, the train step's MFU, with
# Qwen2.5-1.5B shapes and random bfloat16 weights). On a host where JAX finds only the CPU it runs
# the CPU form (the same code on a small model) and says what it skipped; CI runs that form.
#   bash scripts/device_check.sh OUT_DIR
# RLAX_PYTHON names another interpreter than .venv/bin/python (a host image's own JAX, say).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/device_check.sh OUT_DIR}
mkdir -p "$out"
py=${RLAX_PYTHON:-.venv/bin/python}
export JAX_PLATFORMS="${RLAX_DEVICE_CHECK_PLATFORMS-}"  # unset: JAX picks the accelerator
export XLA_FLAGS=""
started=$(date +%s)
platform=$($py -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo none)
versions=$($py -c '
import sys
from importlib.metadata import version
names = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers")
print(", ".join([f"python {sys.version.split()[0]}"] + [f"{n} {version(n)}" for n in names]))' \
  2>/dev/null)
echo "[device_check] JAX platform: $platform ($versions); figures under $out"
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
step accelerator-tests 150 $py -m pytest -o addopts=-ra -p no:cacheprovider -q -m accelerator \
  --junitxml "$out/accelerator-tests.xml" tests/accelerator
if [[ "$platform" == gpu || "$platform" == tpu ]]; then
  step benchmark 240 $py benchmarks/accelerator.py --json-out "$out/accelerator.json"
else
  skipped+=("the accelerator tests (they skip themselves on $platform)")
  skipped+=("Qwen2.5-1.5B shapes: benchmarks/accelerator.py runs its small shape on $platform")
  step benchmark 300 $py benchmarks/accelerator.py --shape small --slots 4,8 --prompt-len 16 \
    --new-tokens 8 --train-batch 4 --train-seq-len 32 --micro-batch 2 --repeats 1 \
    --json-out "$out/accelerator.json"
fi
if [[ "$platform" == gpu ]]; then
  # the tiny preset end to end on GPU 0: trainer and worker as two processes sharing the one GPU
  # (each XLA_PYTHON_CLIENT_MEM_FRACTION 0.45), then colocated in one process with the held-out
  # evaluation before and after, as a job of its own on the GPU (`rlax heldout`)
  runs=$(mktemp -d)
  gpu_run() {  # gpu_run NAME SETTINGS...: 4 steps of tiny-arith, its metrics and logs kept
    local name=$1; shift
    step "$name" 150 $py -m rlax_tasks.cli run --run-root "$runs" --run-id "$name" --steps 4 \
      --set placement.platform=gpu --set 'placement.trainer=[0]' "$@"
    cp "$runs/$name/metrics.jsonl" "$out/$name-metrics.jsonl" 2>/dev/null
    cp "$runs/$name/eval/heldout_scores.jsonl" "$out/$name-heldout.jsonl" 2>/dev/null
    tail -n 20 "$runs/$name"/logs/*.log > "$out/$name-jobs.log" 2>/dev/null
  }
  gpu_run e2e-shared-gpu --no-eval --set placement.mode=disaggregated \
    --set 'placement.workers=[[0]]'
  gpu_run e2e-colocated
else
  skipped+=("tiny-arith end to end on one GPU (the suite runs it on $platform)")
fi
$py - "$out" "$platform" "$versions" "$(( $(date +%s) - started ))" "${skipped[@]}" <<'PY'
import json, os, sys
out, platform, versions, seconds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
skipped = sys.argv[5:]
with open(os.path.join(out, "steps.jsonl")) as f:
    steps = [json.loads(line) for line in f if line.strip()]
summary = {"platform": platform, "versions": versions, "seconds": seconds, "steps": steps, "skipped": skipped}
bench = os.path.join(out, "accelerator.json")
if os.path.exists(bench):
    with open(bench) as f:
        summary["accelerator"] = json.load(f)
for name in ("e2e-shared-gpu", "e2e-colocated"):  # per step: seconds, train seconds, tokens/s
    path = os.path.join(out, f"{name}-metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        keys = ("step", "step_time_s", "time_train_s", "tokens_per_s", "loss", "reward_mean")
        summary[name] = [{k: r.get(k) for k in keys} for r in rows]
        print(f"[device_check] {name}: " + "; ".join(
            f"step {r['step']} {r['step_time_s']:.2f}s (train {r['time_train_s']:.2f}s)"
            for r in summary[name]))
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
for line in skipped:
    print(f"[device_check] skipped: {line}")
failed = [s["step"] for s in steps if s["exit"] != 0]
print(f"[device_check] {'failed: ' + ', '.join(failed) if failed else 'every step passed'}; "
      f"{seconds}s; {os.path.join(out, 'summary.json')}")
sys.exit(1 if failed else 0)
PY
