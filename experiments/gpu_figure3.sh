#!/usr/bin/env bash
# The Figure 3 study (docs/figure3.md) on one GPU machine: the token cache, the two multiruns (each run evaluates
# itself at its end), the report. The same nats-train lines run on a cluster with hydra/launcher=submitit_slurm.
#   bash experiments/gpu_figure3.sh OUT [OVERRIDE...]
# OUT: the study's folder (run folders in OUT/runs/{dense,nats}/, the table and plots in OUT/report/).
# OVERRIDE: Hydra overrides for every run, e.g. data.path=/data/pg19-subset-src, or hydra/launcher=joblib
# hydra.launcher.n_jobs=3 for three runs at a time on the one GPU (then also
# callbacks.eval_after.common.batch_size=32: a dense model's evaluation takes ~70 GB at 128).
# SEEDS (default 1) and LAMBDAS (default 0,0.01,0.03,0.05,0.1,0.3,1,3) choose the points. The same OUT again
# resumes: unfinished runs continue from their last.ckpt, finished ones keep their evaluations (other SEEDS or
# LAMBDAS need another OUT: the job folders are numbered in sweep order).
set -euo pipefail
dest=${1:?usage: bash experiments/gpu_figure3.sh OUT [OVERRIDE...]}
shift
seeds=${SEEDS:-1}
lambdas=${LAMBDAS:-0,0.01,0.03,0.05,0.1,0.3,1,3}
source "$(dirname "$0")/prepare_data.sh"
prepare_data "$@" # the token cache of the runs' data, once
nats-train -m experiment=study_fig3_dense seed="$seeds" hydra.sweep.dir="$dest/runs/dense" "$@"
nats-train -m experiment=study_fig3_nats model.attention.sparsity_lambda="$lambdas" seed="$seeds" \
  hydra.sweep.dir="$dest/runs/nats" "$@"
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
python experiments/figure3.py "$dest/runs" --out "$dest/report" ${device:+--device "one $device"}
