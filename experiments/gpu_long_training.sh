#!/usr/bin/env bash
# Longer training (docs/figure3.md, "Longer training"): the dense model and NAtS lambda = 0.05 of the Figure 3
# study for STEPS optimizer steps (default 10000, 5x the study's tokens; the cosine and the tau schedule stretch
# with it), side by side: one GPU each where the machine has two or more, else both on GPU 0. Each run evaluates
# at its end its final checkpoint and its best by validation loss (10k steps are ~8 passes over the subset: the
# dense model overfits after ~5000; the full cache for dense, the learned types for NAtS; the first 512 windows of
# each split), then the reports put their curves and evaluations beside each other.
#   bash experiments/gpu_long_training.sh OUT [OVERRIDE...]
# OUT: run folders OUT/runs/{dense,nats}/, the tables and plots in OUT/report/ (final checkpoints) and
# OUT/report_best/ (best checkpoints). The same OUT again resumes both runs
# from their checkpoints/last.ckpt (written every eval_every = 500 steps), so the training may come in pieces
# (e.g. under a time limit: `timeout 9m bash experiments/gpu_long_training.sh OUT`, then the same line again).
# OVERRIDE: Hydra overrides for both runs, e.g. data.path=/data/pg19-subset-src.
# MODELS (default "dense nats") chooses the runs, e.g. MODELS=nats to start or resume that one alone; the k-th run
# takes the k-th GPU of CUDA_VISIBLE_DEVICES (default: all GPUs), cycling when there are fewer GPUs than runs.
set -euo pipefail
dest=${1:?usage: bash experiments/gpu_long_training.sh OUT [OVERRIDE...]}
shift
steps=${STEPS:-10000}
models=${MODELS:-dense nats}
for name in $models; do
  case $name in dense | nats) ;; *) echo "MODELS: unknown run '$name' (dense, nats)" >&2 && exit 2 ;; esac
done
source "$(dirname "$0")/prepare_data.sh"
prepare_data "$@" # the token cache of the runs' data, once
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -ra gpu_ids <<<"$CUDA_VISIBLE_DEVICES"
else
  mapfile -t gpu_ids < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true)
fi
[ ${#gpu_ids[@]} -gt 0 ] || gpu_ids=(0)
pids=()
train() { # name experiment gpu overrides...
  local name=$1 exp=$2 gpu=$3
  shift 3
  mkdir -p "$dest/runs/$name"
  CUDA_VISIBLE_DEVICES=$gpu nats-train "experiment=$exp" "trainer.max_steps=$steps" "hydra.run.dir=$dest/runs/$name" \
    "$@" >>"$dest/runs/$name/driver.log" 2>&1 &
  pids+=($!)
}
k=0
for name in $models; do
  gpu=${gpu_ids[k % ${#gpu_ids[@]}]}
  k=$((k + 1))
  case $name in
    # the dense model's evaluation: its full cache only (the baselines at this length are not the question here);
    # each model also at its best checkpoint by validation loss (where a long run on the subset overfits)
    dense) train dense study_fig3_dense "$gpu" "callbacks.eval_after.evals.test.methods=[full]" \
      "++callbacks.eval_after.evals.validation_best={split:validation,methods:[full],checkpoint:best}" \
      "++callbacks.eval_after.evals.test_best={split:test,methods:[full],checkpoint:best}" "$@" ;;
    nats) train nats study_fig3_nats "$gpu" \
      "++callbacks.eval_after.evals.validation_best={split:validation,methods:[nats],checkpoint:best}" \
      "++callbacks.eval_after.evals.test_best={split:test,methods:[nats],checkpoint:best}" "$@" ;;
  esac
done
# a SIGTERM (e.g. from `timeout`) reaches both trainings: each saves its state and stops (nats-train's own handling)
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
status=0
for p in "${pids[@]}"; do
  while ! wait "$p"; do # wait returns early when the trap runs: wait again for the run to save and stop
    kill -0 "$p" 2>/dev/null || { status=1 && break; }
  done
done
tail -n 3 "$dest"/runs/*/driver.log
[ $status = 0 ] || { echo "a run failed or stopped: the same command resumes it" && exit 1; }
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
python experiments/figure3.py "$dest/runs" --out "$dest/report" --along-training ${device:+--device "one $device per run"}
python experiments/figure3.py "$dest/runs" --out "$dest/report_best" --checkpoint best --along-training ${device:+--device "one $device per run"}
