#!/usr/bin/env bash
# One GPU call of benchmarks/bench_nats_train.py (issue 16): nats-train (fig3_dense, fig3_nats) beside the
# isolated step. Run from the repo root on a lent GPU machine, with the wheels in .whl/ and the PG-19 subset
# archives in data/pg19-subset-src/ (or the folder $PG19) carried (as experiments/gpu_figure3.sh); the subset is
# tokenised first (nats-prepare), outside the timed runs.
#   bash benchmarks/gpu_bench_nats_train.sh                 # everything (~8-10 min cold)
#   bash benchmarks/gpu_bench_nats_train.sh train           # the two nats-train runs only
#   bash benchmarks/gpu_bench_nats_train.sh report          # then: the isolated steps + the table (--reuse)
# The carry limit (64 MiB with the tracked tree, 21 MB at session 14) leaves no room for the whole subset (49 MB):
#   bash benchmarks/gpu_bench_nats_train.sh pack [SUBSET]  # here: data/pg19-bench/ (39 MB), the subset (default
#                                                          # ../shared/data/pg19-subset) with the first 320 training books
# then carry data/pg19-bench with PG19=data/pg19-bench (what session 14 ran).
# Extra arguments go to bench_nats_train.py (e.g. --steps 150). Results: $OUT/bench_nats_train_<gpu>.md/.json
# and the run folders' small files in $OUT/bench_nats_train_runs.tar.gz.
set -uo pipefail
export PYTHONUNBUFFERED=1 PROJECT_ROOT=$PWD
OUT=${OUT:-/tmp/out}
if [ "${1:-}" = pack ]; then  # runs here, not on the GPU machine: no wheels, no GPU
  src=${2:-../shared/data/pg19-subset}; dst=data/pg19-bench; tmp=$(mktemp -d)
  mkdir -p $dst && cp "$src"/README.md "$src"/books.csv "$src"/validation.tar.xz $dst/ &&
    tar -xJf "$src"/train.tar.xz -C $tmp && tar -xJf "$src"/test.tar.xz -C $tmp &&
    (cd $tmp && ls train | sort | head -320 | sed 's#^#train/#' > keep && XZ_OPT='-6 -T2' tar -cJf train.tar.xz -T keep &&
     tar -cJf test.tar.xz "test/$(ls -S test | tail -1)") &&  # the test split is not read: its smallest book
    mv $tmp/train.tar.xz $tmp/test.tar.xz $dst/ && rm -rf $tmp && du -sh $dst; exit $?
fi
source benchmarks/gpu_site.sh  # $OUT, the wheels of .whl/ into $SITE, nats from the checkout, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
phase=all
case "${1:-}" in all|train|report) phase=$1; shift ;; esac
# tokenise the PG-19 subset once (minutes on a fresh machine) before the timed runs, so that no run's startup
# includes it (a no-op when the cache data/pg19-subset-<hash>-gpt2/ is there)
if [ "$phase" != report ]; then
  t0=$(date +%s)
  python3 -m nats.prepare data=pg19_subset "data.path=$PWD/${PG19:-data/pg19-subset-src}" 2>&1 | tail -3
  echo "prepare: $(( $(date +%s) - t0 )) s"
fi
WORK=$PWD/logs/bench_nats_train_runs   # ignored by git, kept on a warm machine between calls
DATA="data.path=$PWD/${PG19:-data/pg19-subset-src}"
B="python3 benchmarks/bench_nats_train.py --out $OUT --workdir $WORK"
case $phase in
  all)    $B --extra "$DATA" "$@" 2>&1 | tail -40 ;;
  train)  $B --extra "$DATA" --no-isolated --no-table "$@" 2>&1 | tail -20 ;;
  report) $B --extra "$DATA" --reuse "$@" 2>&1 | tail -40 ;;
esac
tar czf "$OUT/bench_nats_train_runs.tar.gz" -C "$WORK" --exclude=checkpoints --exclude='*.ckpt' \
  --exclude='events.out.tfevents*' . 2>/dev/null || true
