#!/usr/bin/env bash
# One GPU call of the Figure 3 study (issue 13, experiments/figure3.py), run from the repo root on a lent GPU
# machine that lacks hydra/omegaconf/submitit/datasets: their wheels in .whl/ (benchmarks/README.md says how) and
# the PG-19 subset archives in data/pg19-subset-src/ are carried with the call. Every call ends by packing the
# small result files into $OUT/figure3.tar.gz, so a machine that goes back loses only unfinished models.
#   bash experiments/gpu_figure3.sh tests                       # GPU tests of the mask_grad kernels
#   bash experiments/gpu_figure3.sh bench                       # bench_attention training part, both estimators
#   bash experiments/gpu_figure3.sh train BUDGET_S RUN... [-- SEEDS...]
#   bash experiments/gpu_figure3.sh eval BUDGET_S RUN... [-- SEEDS...]
#   bash experiments/gpu_figure3.sh trainval BUDGET_S RUN... [-- SEEDS...]   # train, then eval what finished
set -uo pipefail
export PYTHONUNBUFFERED=1 PROJECT_ROOT=$PWD
OUT=${OUT:-/tmp/out}
source benchmarks/gpu_site.sh  # $OUT, the wheels of .whl/ into $SITE, nats from the checkout, PYTHONPATH
F3="python3 experiments/figure3.py"
DATA="data.path=$PWD/data/pg19-subset-src"
phase=$1; shift
case $phase in
  tests)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # one tile config per kernel (no autotuning): the tests check values, and compile in a fraction of the time
    NATS_KERNELS_AUTOTUNE=0 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_compile.py \
      2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    ;;
  bench)
    python3 benchmarks/bench_attention.py --skip prefill --out "$OUT" 2>&1 | tail -22
    ;;
  train|eval|trainval)
    budget=$1; shift
    runs=(); seeds=(1)
    while [ $# -gt 0 ]; do
      if [ "$1" = "--" ]; then shift; seeds=("$@"); break; fi
      runs+=("$1"); shift
    done
    t0=$(date +%s)
    if [ "$phase" != eval ]; then
      $F3 train --runs "${runs[@]}" --seeds "${seeds[@]}" --budget-s "$budget" --extra "$DATA" \
        $([ "$phase" = trainval ] && echo --eval)
    fi
    if [ "$phase" != train ]; then
      left=$(( budget - ($(date +%s) - t0) ))
      [ $left -gt 30 ] && $F3 eval --runs "${runs[@]}" --seeds "${seeds[@]}" --budget-s $left --extra "$DATA"
    fi
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
$F3 pack --out "$OUT/figure3.tar.gz" >/dev/null 2>&1 || true
