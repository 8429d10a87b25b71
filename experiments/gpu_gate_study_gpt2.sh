#!/usr/bin/env bash
# The gate study at GPT-2-small scale (docs/gate_study_gpt2.md) on one GPU machine: the token cache, the two
# multiruns (each run evaluates and analyses itself at its end), the report. The same nats-train lines run on a
# cluster with hydra/launcher=submitit_slurm.
#   bash experiments/gpu_gate_study_gpt2.sh OUT [OVERRIDE...]
# OUT: the study's folder (run folders in OUT/runs/{dense,nats}/, the table and plots in OUT/report/).
# OVERRIDE: Hydra overrides for every run, e.g. data.path=/data/pg19-subset-src, or hydra/launcher=joblib
# hydra.launcher.n_jobs=3 for three runs at a time on the one GPU (then also
# callbacks.eval_after.common.batch_size=32: a dense model's evaluation takes ~70 GB at 128).
# SEEDS (default 0) chooses the seeds. The same OUT again resumes: unfinished runs continue from their last.ckpt,
# finished ones keep their evaluations (other SEEDS need another OUT: the job folders are numbered in sweep order).
set -euo pipefail
out=${1:?usage: bash experiments/gpu_gate_study_gpt2.sh OUT [OVERRIDE...]}
shift
seeds=${SEEDS:-0}
data=(data=pg19_subset) # the token cache of the runs' data, once
for o in "$@"; do case $o in data=*) data[0]=$o ;; data.* | paths.*) data+=("$o") ;; esac; done
nats-prepare "${data[@]}"
nats-train -m experiment=study_gate_gpt2_dense model.attention.output_gate=none,headwise,elementwise seed="$seeds" \
  hydra.sweep.dir="$out/runs/dense" "$@"
nats-train -m experiment=study_gate_gpt2_nats model.attention.output_gate=none,headwise seed="$seeds" \
  hydra.sweep.dir="$out/runs/nats" "$@"
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
python experiments/gate_study_gpt2.py "$out/runs" --out "$out/report" ${device:+--device "one $device"}
