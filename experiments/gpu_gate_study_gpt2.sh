#!/usr/bin/env bash
# One GPU call of the gate study at GPT-2-small scale (issue 19, experiments/gate_study_gpt2.py,
# docs/gate_study_gpt2.md), run from the repo root on a lent GPU machine that lacks hydra/omegaconf/submitit/datasets:
# their wheels in .whl/ (benchmarks/README.md says how) and the PG-19 subset archives in data/pg19-subset-src/ are
# carried with the call. Every call ends by packing the small result files into $OUT/gate_study_gpt2.tar.gz and
# writing the report of what has finished so far into $OUT (flat, 7 files at most: the archive, the call's log,
# gate_study_gpt2.md/.json and three plots), so a machine that goes back loses only unfinished models.
#   bash experiments/gpu_gate_study_gpt2.sh trainval BUDGET_S [RUN...] [-- SEEDS...]  # train, evaluate each as it ends
#   bash experiments/gpu_gate_study_gpt2.sh train BUDGET_S [RUN...] [-- SEEDS...]
#   bash experiments/gpu_gate_study_gpt2.sh eval BUDGET_S [RUN...] [-- SEEDS...]
#   bash experiments/gpu_gate_study_gpt2.sh status
# RUN: dense dense_headwise dense_elementwise nats nats_headwise (default: all five); SEEDS default 0.
# On a GPU with >= 100 GB (H200): 5 trainings and 6 evaluations at a time; else (H100, 80 GB) 3 and 3, and the
# dense models' nats-eval batch 64 instead of 128 (its full-cache logits alone are batch x 1024 x 50304 floats).
# The dense models' nats-eval runs alone (not beside a training or another one: ~70 GB each on the H200);
# MAX_EVAL=N limits the evaluations at a time further.
# The runs live in logs/gate_study_gpt2/ of the machine and go on between calls while it stays warm; repeat the
# same call until the report has every row.
set -uo pipefail
export PYTHONUNBUFFERED=1 PROJECT_ROOT=$PWD
OUT=${OUT:-/tmp/out}
source benchmarks/gpu_site.sh  # $OUT, the wheels of .whl/ into $SITE, nats from the checkout, PYTHONPATH
GS="python3 experiments/gate_study_gpt2.py"
ROOT=$PWD/logs/gate_study_gpt2
DATA="data.path=$PWD/data/pg19-subset-src"
LOG=$OUT/gate_study_gpt2_call.log
phase=${1:-status}; [ $# -gt 0 ] && shift
{
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  case $phase in
    train|eval|trainval)
      budget=$1; shift
      runs=(); seeds=(0)
      while [ $# -gt 0 ]; do
        if [ "$1" = "--" ]; then shift; seeds=("$@"); break; fi
        runs+=("$1"); shift
      done
      [ ${#runs[@]} -eq 0 ] && runs=(dense dense_headwise dense_elementwise nats nats_headwise)
      mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      limits=(--max-eval 3 --batch-size-dense 64); max_train=3
      [ "${mem:-0}" -ge 100000 ] && limits=(--max-eval 6 --batch-size-dense 128) && max_train=5
      # MAX_EVAL: fewer evaluations at a time (an evaluation that starts while trainings still run can run out of memory)
      [ -n "${MAX_EVAL:-}" ] && limits[1]=$MAX_EVAL
      python3 -m nats.prepare data=pg19_subset "$DATA" 2>&1 | tail -3  # the token cache, once per machine
      if [ "$phase" = eval ]; then
        $GS eval --root "$ROOT" --runs "${runs[@]}" --seeds "${seeds[@]}" --budget-s "$budget" "${limits[@]}" \
          --extra "$DATA"
      else
        $GS train --root "$ROOT" --runs "${runs[@]}" --seeds "${seeds[@]}" --budget-s "$budget" --no-prepare \
          --max-train $max_train "${limits[@]}" --extra "$DATA" $([ "$phase" = trainval ] && echo --eval)
      fi
      nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
      ;;
    status) $GS status --root "$ROOT" ;;
    *) echo "unknown phase $phase (trainval | train | eval | status)"; exit 2 ;;
  esac
} 2>&1 | tee "$LOG"
[ -d "$ROOT" ] || exit 0
$GS pack --root "$ROOT" --out "$OUT/gate_study_gpt2.tar.gz" >/dev/null 2>&1 || true
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
$GS report --root "$ROOT" --out "$OUT" --device "one $device" >/dev/null 2>>"$LOG" || echo "no report yet (see $LOG)"
ls "$OUT"
