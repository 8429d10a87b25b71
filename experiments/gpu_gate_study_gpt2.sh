#!/usr/bin/env bash
# The gate study at GPT-2-small scale (docs/gate_study_gpt2.md) on one GPU machine: the token cache, the two
# multiruns (each run evaluates and analyses itself at its end), the report. The same nats-train lines run on a
# cluster with hydra/launcher=submitit_slurm.
#   bash experiments/gpu_gate_study_gpt2.sh OUT [OVERRIDE...]
# OUT: the study's folder (run folders in OUT/runs/{dense,nats}/, the table and plots in OUT/report/).
# OVERRIDE: Hydra overrides for every run, e.g. data.path=/data/pg19-subset-src, or hydra/launcher=joblib
# hydra.launcher.n_jobs=3 for three runs at a time on the one GPU (then also
# callbacks.eval_after.common.batch_size=32: a dense model's evaluation takes ~70 GB at 128).
# SEEDS (default 0) chooses the seeds; DENSE_GATES (default none,headwise,elementwise) and NATS_GATES (default
# none,headwise) the models, "" for none of that kind; TOGETHER=1 runs the dense and the NAtS multirun side by side
# (one process each; with the joblib launcher both share the GPU). The same OUT again resumes: unfinished runs
# continue from their last.ckpt, finished ones keep their evaluations (other SEEDS or gates need another OUT: the
# job folders are numbered in sweep order).
set -euo pipefail
dest=${1:?usage: bash experiments/gpu_gate_study_gpt2.sh OUT [OVERRIDE...]}
shift
seeds=${SEEDS:-0}
dense_gates=${DENSE_GATES-none,headwise,elementwise}
nats_gates=${NATS_GATES-none,headwise}
source "$(dirname "$0")/prepare_data.sh"
prepare_data "$@" # the token cache of the runs' data, once
jobs=()
multirun() { # kind gates: one multirun, in the background when TOGETHER=1
  local cmd=(nats-train -m "experiment=study_gate_gpt2_$1" "model.attention.output_gate=$2" "seed=$seeds"
    "hydra.sweep.dir=$dest/runs/$1" "${@:3}")
  if [ "${TOGETHER:-0}" = 1 ]; then
    "${cmd[@]}" &
    jobs+=($!)
  else
    "${cmd[@]}"
  fi
}
[ -z "$dense_gates" ] || multirun dense "$dense_gates" "$@"
[ -z "$nats_gates" ] || multirun nats "$nats_gates" "$@"
for j in "${jobs[@]}"; do wait "$j"; done
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
python experiments/gate_study_gpt2.py "$dest/runs" --out "$dest/report" ${device:+--device "one $device"}
