#!/usr/bin/env bash
# Issue 16 part 5: NAtS through `nats-train trainer=ddp` on 2 GPUs against 1 GPU at equal global batch
# (benchmarks/ddp_scaling.py), on the PG-19 subset, compiled, bf16. Run from the repo root on a lent machine of
# 2 GPUs with .whl/ and data/pg19-subset-src/ carried. Results: $OUT/ddp_scaling.{md,json}, ddp_scaling_loss.png.
#   bash benchmarks/gpu_ddp_nats.sh                  # fig3_nats, micro-batch 32 per GPU, global batch 64
#   bash benchmarks/gpu_ddp_nats.sh --experiment fig3_dense
set -uo pipefail
export PYTHONUNBUFFERED=1 PROJECT_ROOT=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # leave NVLink multicast off
OUT=${OUT:-/tmp/out}
source benchmarks/gpu_site.sh  # $OUT, the wheels of .whl/ into $SITE, nats from the checkout, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
python3 -m nats.prepare data=pg19_subset "data.path=$PWD/data/pg19-subset-src" 2>&1 | tail -2
echo "prepare: $(( $(date +%s) - t0 )) s"
python3 benchmarks/ddp_scaling.py --out "$OUT" --devices 2 --experiment fig3_nats --data pg19_subset \
  --micro 32 --global-batch 64 --steps 150 --min-single-steps 150 --warmup 20 --eval-every 50 --compile \
  --no-preflight --target 1.9 --budget-s 480 --extra "data.path=$PWD/data/pg19-subset-src" "$@"
# the runs' metric CSVs, flat (files deeper than 2 folders under $OUT do not come back from a lent machine)
for r in ddp2 gpu1; do f=$(find "$OUT/runs/$r" -name metrics.csv 2>/dev/null | head -1); [ -n "$f" ] && cp "$f" "$OUT/${r}_metrics.csv"; done
exit 0
