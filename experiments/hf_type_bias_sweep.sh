#!/usr/bin/env bash
# KV-budget knobs of trained NAtS scorers at inference (nats-eval-hf `type_bias` offsets and a smaller `window`;
# docs/hf_eval.md, "KV-budget knobs at inference") chosen on validation examples, then the chosen one on the test
# examples. CPU, about 7 minutes per NAtS run of 64 examples on 2 cores (full + NAtS ~10); each run resumes in its
# folder. The runs behind docs/results/hf_eval_smollm2_val16_budget_knobs.md:
#   bash experiments/hf_type_bias_sweep.sh validation        # full, NAtS as trained, and each knob of $KNOBS
#   bash experiments/hf_type_bias_sweep.sh test w64 window=64
# Env: SCORERS (default build/scorers_noise_l0.3/scorers.pt: the lambda = 0.3 noise-schedule fine-tune,
# docs/hf_finetune.md), N (examples per task, 16), DEVICE (cpu), DEST (logs/eval_hf), KNOBS (space-separated
# LABEL:OVERRIDE). Folders: DEST/hf_eval_smollm2_cpu_val16_l0.3_LABEL and
# DEST/hf_eval_smollm2_cpu_n16_noise_l0.3_LABEL; the table: experiments/hf_study_table.py (command printed).
set -euo pipefail
cd "$(dirname "$0")/.."
S=${SCORERS:-build/scorers_noise_l0.3/scorers.pt}
DEST=${DEST:-logs/eval_hf}
EVAL=${NATS_EVAL_HF:-nats-eval-hf}
common=(scorers="$S" data.num_examples="${N:-16}" device="${DEVICE:-cpu}" progress=false 'budgets=[]')
case "${1:-}" in
validation)
  val=(data.split=validation data.seed=20241123)
  R=$DEST/hf_eval_smollm2_cpu_val16_l0.3
  $EVAL "${common[@]}" "${val[@]}" 'methods=[full,nats]' paths.output_dir="${R}_w256"
  table=("python experiments/hf_study_table.py ${R}_w256/results.jsonl --nats 'as trained=${R}_w256/results.jsonl'")
  knobs=${KNOBS:-"g-0.1:type_bias=[-0.1,0,0] g-0.2:type_bias=[-0.2,0,0] l+0.1:type_bias=[0,0.1,0] l+0.2:type_bias=[0,0.2,0] w64:window=64"}
  for knob in $knobs; do
    $EVAL "${common[@]}" "${val[@]}" 'methods=[nats]' "${knob#*:}" paths.output_dir="${R}_${knob%%:*}"
    table+=("--nats '${knob#*:}=${R}_${knob%%:*}/results.jsonl'")
  done
  echo "table: ${table[*]} --out docs/results --name hf_eval_smollm2_val16_budget_knobs"
  ;;
test)
  label=${2:?give the label and the override chosen on validation, e.g. test w64 window=64}
  override=${3:?give the override chosen on validation, e.g. window=64}
  $EVAL "${common[@]}" 'methods=[nats]' "$override" paths.output_dir="$DEST/hf_eval_smollm2_cpu_n16_noise_l0.3_${label}"
  ;;
*)
  echo "usage: $0 validation | test LABEL OVERRIDE (e.g. test w64 window=64)" >&2
  exit 2
  ;;
esac
