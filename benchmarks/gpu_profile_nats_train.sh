#!/usr/bin/env bash
# benchmarks/profile_nats_train.py on a GPU machine: torch.profiler over optimizer steps 40..50 of nats-train for
# fig3_dense and fig3_nats (micro-batch = global batch 32, compiled, bf16, the PG-19 subset at PG19, default
# ../shared/data/pg19-subset), with the GPU kernels grouped (attention, matmul, inductor, optimizer, other).
#   bash benchmarks/gpu_profile_nats_train.sh [DEST] [experiment ...]     (default: both experiments)
# Results: DEST/profile_<experiment>_<gpu>.txt (default DEST: logs/bench/<date>). STEPS, PROFILE and EXTRA
# (more overrides) as the variables below; WHEELS=<folder of wheels> as benchmarks/gpu_site.sh says.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-logs/bench/$(date +%F)}
[ $# -gt 0 ] && shift
source benchmarks/gpu_site.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE '[A-Z][0-9]{2,4}' | head -1 | tr A-Z a-z)
prepare_pg19_subset 1
exps=("$@")
[ ${#exps[@]} -eq 0 ] && exps=(fig3_dense fig3_nats)
for exp in "${exps[@]}"; do
  t0=$(date +%s)
  file="$DEST/profile_${exp}_${gpu}.txt"
  python3 benchmarks/profile_nats_train.py --steps ${STEPS:-60} --profile ${PROFILE:-40 50} \
    "experiment=$exp" trainer=gpu compile=true data=pg19_subset "data.path=$PG19" \
    data.micro_batch_size=32 global_batch_size=32 ${EXTRA:-} > "$file" 2>&1
  echo "$exp: rc $? in $(( $(date +%s) - t0 )) s"
  grep -A12 "profiled steps" "$file" | head -14
  sed -n '/GPU kernels by group/,/^| kernel/p' "$file"
done
