#!/usr/bin/env bash
# One GPU call of benchmarks/profile_nats_train.py (issue 16): torch.profiler over optimizer steps 40..50 of
# nats-train for fig3_dense and fig3_nats (micro-batch = global batch 32, compiled, bf16, PG-19 subset), with the
# GPU kernels grouped (attention, matmul, inductor, optimizer, other). Needs .whl/ and the PG-19 subset ($PG19,
# default data/pg19-subset-src/; a copy without the test books fits the carry limit) carried, as
# benchmarks/gpu_bench_nats_train.sh.
#   bash benchmarks/gpu_profile_nats_train.sh                 # both experiments
#   bash benchmarks/gpu_profile_nats_train.sh fig3_nats       # one
# Results: $OUT/profile_<experiment>_<gpu>.txt
set -uo pipefail
export PYTHONUNBUFFERED=1 PROJECT_ROOT=$PWD
OUT=${OUT:-/tmp/out}
source benchmarks/gpu_site.sh  # $OUT, the wheels of .whl/ into $SITE, nats from the checkout, PYTHONPATH
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE '[A-Z][0-9]{2,4}' | head -1 | tr A-Z a-z)
python3 -m nats.prepare data=pg19_subset "data.path=$PWD/${PG19:-data/pg19-subset-src}" 2>&1 | tail -1
exps=("$@")
[ ${#exps[@]} -eq 0 ] && exps=(fig3_dense fig3_nats)
for exp in "${exps[@]}"; do
  t0=$(date +%s)
  python3 benchmarks/profile_nats_train.py --steps ${STEPS:-60} --profile ${PROFILE:-40 50} \
    "experiment=$exp" trainer=gpu compile=true data=pg19_subset "data.path=$PWD/${PG19:-data/pg19-subset-src}" \
    data.micro_batch_size=32 global_batch_size=32 ${EXTRA:-} > "$OUT/profile_${exp}_${gpu}.txt" 2>&1
  echo "$exp: rc $? in $(( $(date +%s) - t0 )) s"
  grep -A12 "profiled steps" "$OUT/profile_${exp}_${gpu}.txt" | head -14
  sed -n '/GPU kernels by group/,/^| kernel/p' "$OUT/profile_${exp}_${gpu}.txt"
done
