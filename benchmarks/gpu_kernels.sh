#!/usr/bin/env bash
# The NAtS kernel checks on a GPU machine (about 7 minutes on one H100):
#   1. tests/test_kernels.py (on the GPU: + bf16, N up to 8k, D=128) and tests/test_compile.py (autotuning off to
#      save compile time, so each kernel runs its first config), log in DEST/gpu_tests.log;
#   2. benchmarks/bench_attention.py (autotuned), writing bench_attention.{md,json,png} into DEST, with a time
#      budget so the whole script stays under ~8 minutes (NATS_GPU_TOTAL_S, default 420).
# Usage, from the repository root:  bash benchmarks/gpu_kernels.sh [DEST]     (default logs/bench/<date>)
# WHEELS=<folder of wheels> for a machine without a package index (benchmarks/gpu_site.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-logs/bench/$(date +%F)}
source benchmarks/gpu_site.sh
TOTAL_S="${NATS_GPU_TOTAL_S:-420}"
start=$(date +%s)
echo "== gpu tests"
NATS_KERNELS_AUTOTUNE=0 timeout 240 python3 -m pytest tests/test_kernels.py tests/test_compile.py -q -rA --durations=15 \
  -p no:cacheprovider 2>&1 | tee "$DEST/gpu_tests.log"
test_rc=${PIPESTATUS[0]}
echo "gpu tests exit code: $test_rc"
elapsed=$(( $(date +%s) - start ))
budget=$(( TOTAL_S - elapsed - 60 ))
if [ "$budget" -lt 60 ]; then budget=60; fi
echo "== benchmark (budget ${budget}s after ${elapsed}s of tests)"
timeout $(( budget + 90 )) python3 benchmarks/bench_attention.py --out "$DEST" --budget-s "$budget" 2>&1 \
  | tee "$DEST/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark exit code: $bench_rc; total $(( $(date +%s) - start ))s; results in $DEST"
exit $(( test_rc != 0 || bench_rc != 0 ))
