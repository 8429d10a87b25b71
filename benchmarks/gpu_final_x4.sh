#!/usr/bin/env bash
# One call on a 4-GPU machine: 4-GPU vs 1-GPU DDP scaling (issue 6), GPT-2-small training throughput with NAtS
# vs dense (issue 4) and the decode benchmark (issue 5). Key outputs are copied to $OUT (8 files at most).
set -uo pipefail
export PYTHONUNBUFFERED=1 PROJECT_ROOT=$PWD
python3 -c "import nats_kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1  # nats, nats_kernels
R=${NATS_SCRATCH_DIR:-/tmp/res}; mkdir -p $R   # scratch for the full outputs (outside the checkout)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 300 python3 benchmarks/ddp_scaling.py --out $R/ddp --budget-s 270 > $R/ddp.log 2>&1
tail -25 $R/ddp.log
timeout 130 python3 benchmarks/bench_train.py --attention dense nats --batch 32 --steps 10 --warmup 4 \
  --nats-lambda 0.1 --out $R/train > $R/train.log 2>&1
grep -E "^\||failed" $R/train.log
CUDA_VISIBLE_DEVICES=1 timeout 140 python3 benchmarks/bench_decode.py --out $R/decode --steps 32 --modes graph > $R/decode.log 2>&1
tail -30 $R/decode.log
cp $R/ddp/ddp_scaling.md $R/ddp/ddp_scaling.json $R/ddp/ddp_scaling_loss.png $R/train/bench_train.md \
   $R/decode/bench_decode.md $R/decode/bench_decode.json "$OUT"/ 2>/dev/null
tail -c 200000 $R/ddp.log > "$OUT/ddp.log"; tail -c 100000 $R/decode.log > "$OUT/decode.log"
