#!/usr/bin/env bash
# The NAtS kernels' GPU times under both grid orders (NATS_KERNELS_GRID=heads | blocks, see
# kernels/nats_attention/_env.py), at fig3's training shape (B=32, W=16; micro-batch 32 of GPT-2-small) and at the
# kernel benchmark's shape (B=16, W=64), for the type mix fig3_nats learns and the benchmark's mixes. Autotuned
# afresh in every process (NATS_KERNELS_AUTOTUNE_CACHE=0), so each table holds what its own run chose.
# Tables: DEST/kernel_breakdown_B{B}_W{W}_{order}.md. About 5 minutes on one H100.
#   bash benchmarks/gpu_kernel_grid.sh [DEST]        (from the repository root; default logs/bench/<date>)
# WHEELS=<folder of wheels> for a machine without a package index (benchmarks/gpu_site.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-logs/bench/$(date +%F)}
source benchmarks/gpu_site.sh
export NATS_KERNELS_AUTOTUNE_CACHE=0
rc=0
for spec in "32 16 fig3 sparse uniform" "16 64 sparse uniform fig3"; do
  read -r B W MIXES <<<"$spec"
  for order in heads blocks; do
    echo "== B=$B W=$W grid=$order"
    log="$DEST/kb_B${B}_W${W}_${order}.log"
    NATS_KERNELS_GRID=$order timeout 240 python3 benchmarks/kernel_breakdown.py --shape "$B" 12 1024 64 --window "$W" \
      --mixes $MIXES --name "kernel_breakdown_B${B}_W${W}_${order}" --out "$DEST" >"$log" 2>&1 \
      || { rc=1; tail -20 "$log"; }
    grep -E "^\| (fig3|sparse|uniform) " "$DEST/kernel_breakdown_B${B}_W${W}_${order}.md" 2>/dev/null
  done
done
exit $rc
