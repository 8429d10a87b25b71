#!/usr/bin/env bash
# Training checks on one GPU: throughput of GPT-2-small (benchmarks/bench_train.py: default SDPA, cuDNN SDPA, learned
# positions), the default configuration on the GPU (trainer=gpu, compiled) and GPT-2-small steps through Lightning.
#   bash benchmarks/gpu_train_checks.sh [DEST]      (from the repository root; default logs/bench/<date>)
# WHEELS=<folder of wheels> for a machine without a package index (benchmarks/gpu_site.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-logs/bench/$(date +%F)}
source benchmarks/gpu_site.sh
B="python3 benchmarks/bench_train.py --steps 20 --warmup 6"
$B --batch 32 48 --out "$DEST" 2>&1 | tail -3
$B --batch 32 48 --sdpa cudnn --out "$DEST/cudnn" 2>&1 | tail -2
$B --batch 32 --pos-emb learned --sdpa cudnn --out "$DEST/learned" 2>&1 | tail -1
echo "== default config on the GPU (trainer=gpu, compile=true)"
time python3 -m nats.train trainer=gpu compile=true callbacks.progress_bar.refresh_rate=100 \
  paths.log_dir="$DEST/logs" 2>&1 | grep -E "val_ppl|unigram_ppl|val_loss|Error|error" | tail -5
echo "== GPT-2-small through Lightning (trainer=gpu, bf16, compiled), 30 steps of 64 x 1024"
time python3 -m nats.train experiment=pg19_gpt2_dense data=gutenberg trainer=gpu global_batch_size=64 \
  data.micro_batch_size=32 data.num_workers=2 trainer.max_steps=30 eval_every=30 data.max_eval_windows=64 \
  trainer.log_every_n_steps=5 logger=csv paths.log_dir="$DEST/logs" callbacks.progress_bar.refresh_rate=100 2>&1 \
  | grep -E "val_ppl|val_loss|Error|error" | tail -5
python3 - "$DEST/logs" <<'PY'
import csv, glob, sys
for f in glob.glob(sys.argv[1] + "/pg19_gpt2_dense/runs/*/csv/metrics.csv"):
    rows = list(csv.DictReader(open(f)))
    tps = [round(float(r[k])) for r in rows for k in r if k.endswith("items_per_sec") and r[k]]
    loss = [(r["step"], r["train/loss"]) for r in rows if r.get("train/loss")]
    print("lightning gpt2-small tokens/s (last):", tps[-3:], "train loss first/last:", loss[:1], loss[-1:])
PY
