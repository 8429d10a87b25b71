#!/usr/bin/env bash
# The one command to run the NAtS kernel checks on a GPU machine (about 7 minutes on one H100):
#   1. tests/test_kernels.py (on the GPU: + bf16, N up to 8k, D=128) and tests/test_compile.py (autotuning off to save
#      compile time, so each kernel runs its first config),
#   2. benchmarks/bench_attention.py (autotuned), writing bench_attention.{md,json,png} into $OUT
#      (default experiments/results/), with a time budget so the whole script stays under ~8 minutes.
# Usage: bash benchmarks/gpu_kernels.sh            (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-experiments/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
TOTAL_S="${NATS_GPU_TOTAL_S:-420}"
# the project installed like everywhere else (`pip install -e .`; `make setup` does it)
$PY -c "import nats_kernels" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e . || exit 1
start=$(date +%s)

echo "== nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"

echo "== gpu tests"
NATS_KERNELS_AUTOTUNE=0 timeout 240 $PY -m pytest tests/test_kernels.py tests/test_compile.py -q -rA --durations=15 -p no:cacheprovider \
  2>&1 | tee "$OUT/gpu_tests.log"
test_rc=${PIPESTATUS[0]}
echo "gpu tests exit code: $test_rc"

elapsed=$(( $(date +%s) - start ))
budget=$(( TOTAL_S - elapsed - 60 ))
if [ "$budget" -lt 60 ]; then budget=60; fi
echo "== benchmark (budget ${budget}s after ${elapsed}s of tests)"
timeout $(( budget + 90 )) $PY benchmarks/bench_attention.py --out "$OUT" --budget-s "$budget" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark exit code: $bench_rc; total $(( $(date +%s) - start ))s; results in $OUT"
exit $(( test_rc != 0 || bench_rc != 0 ))
