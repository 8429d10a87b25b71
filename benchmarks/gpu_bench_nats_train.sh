#!/usr/bin/env bash
# benchmarks/bench_nats_train.py on a GPU machine: nats-train (fig3_dense, fig3_nats) beside the isolated step, on the
# PG-19 subset (PG19=<folder of its archives>, default ../shared/data/pg19-subset), tokenised first (nats-prepare)
# outside the timed runs. About 8-10 minutes on one H100 with a cold Triton cache.
#   bash benchmarks/gpu_bench_nats_train.sh [DEST] [bench_nats_train.py args, e.g. --steps 150]
# Results: DEST/bench_nats_train_<gpu>.{md,json}; the run folders in DEST/runs/ (default DEST:
# logs/bench/<date>). WHEELS=<folder of wheels> for a machine without a package index (benchmarks/gpu_site.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-logs/bench/$(date +%F)}
[ $# -gt 0 ] && shift
source benchmarks/gpu_site.sh
t0=$(date +%s)
prepare_pg19_subset 3
echo "prepare: $(( $(date +%s) - t0 )) s"
python3 benchmarks/bench_nats_train.py --out "$DEST" --workdir "$DEST/runs" --extra "data.path=$PG19" "$@" 2>&1 \
  | tail -40
