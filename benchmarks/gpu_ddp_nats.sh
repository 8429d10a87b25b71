#!/usr/bin/env bash
# NAtS through `nats-train trainer=ddp` on 2 GPUs against 1 GPU at equal global batch (benchmarks/ddp_scaling.py), on
# the PG-19 subset (PG19=<folder of its archives>, default ../shared/data/pg19-subset), compiled, bf16. Needs a
# machine with 2 GPUs. Results: DEST/ddp_scaling.{md,json}, ddp_scaling_loss.png, the runs in DEST/runs/.
#   bash benchmarks/gpu_ddp_nats.sh [DEST]                          # fig3_nats, micro-batch 32 per GPU, batch 64
#   bash benchmarks/gpu_ddp_nats.sh logs/bench/ddp --experiment fig3_dense
# Default DEST: logs/bench/<date>; WHEELS=<folder of wheels> as benchmarks/gpu_site.sh says.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-logs/bench/$(date +%F)}
[ $# -gt 0 ] && shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
source benchmarks/gpu_site.sh
prepare_pg19_subset 2
python3 benchmarks/ddp_scaling.py --out "$DEST" --devices 2 --experiment fig3_nats --data pg19_subset \
  --micro 32 --global-batch 64 --steps 150 --min-single-steps 150 --warmup 20 --eval-every 50 --compile \
  --no-preflight --target 1.9 --budget-s 480 --extra "data.path=$PG19" "$@"
