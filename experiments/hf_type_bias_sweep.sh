#!/usr/bin/env bash
# Issue 18: the NAtS type-logit offsets (nats-eval-hf type_bias, a post-hoc KV-budget knob; docs/hf_eval.md) chosen on
# validation examples, then the chosen one on the test examples. CPU, about 7 minutes per NAtS run of 64 examples on
# 2 cores (full + NAtS ~10); each run is resumable in its folder.
#   bash experiments/hf_type_bias_sweep.sh validation          # full, NAtS and each offset in $BIASES, split validation
#   bash experiments/hf_type_bias_sweep.sh test '[0,0.1,0]'    # NAtS with that offset on the test examples
# Env: SCORERS (default build/scorers_noise_l0.3/scorers.pt), N (examples per task, 16), DEVICE (cpu), OUT
# (experiments/results), BIASES (space-separated label=offsets). Tables: experiments/hf_study_table.py (printed).
set -euo pipefail
cd "$(dirname "$0")/.."
S=${SCORERS:-build/scorers_noise_l0.3/scorers.pt}
N=${N:-16}
OUT=${OUT:-experiments/results}
EVAL=${NATS_EVAL_HF:-nats-eval-hf}
common=(scorers="$S" data.num_examples="$N" device="${DEVICE:-cpu}" progress=false 'budgets=[]')
case "${1:-}" in
validation)
  val=(data.split=validation data.seed=20241123)
  R=$OUT/hf_eval_smollm2_cpu_val16_l0.3
  $EVAL "${common[@]}" "${val[@]}" 'methods=[full,nats]' paths.output_dir="${R}_w256"
  for spec in ${BIASES:-"g-0.1=[-0.1,0,0] g-0.2=[-0.2,0,0] l+0.1=[0,0.1,0] l+0.2=[0,0.2,0]"}; do
    $EVAL "${common[@]}" "${val[@]}" 'methods=[nats]' "type_bias=${spec#*=}" paths.output_dir="${R}_${spec%%=*}"
  done
  echo "table: python experiments/hf_study_table.py ${R}_w256/results.jsonl --nats 'bias 0=${R}_w256/results.jsonl'" \
    "--nats 'LABEL=${R}_LABEL/results.jsonl' ... --out docs/results --name hf_type_bias_validation"
  ;;
test)
  bias=${2:?give the offsets chosen on validation, e.g. [0,0.1,0]}
  $EVAL "${common[@]}" 'methods=[nats]' "type_bias=$bias" paths.output_dir="$OUT/hf_eval_smollm2_cpu_n16_noise_l0.3_bias${bias//[^0-9.,-]/}"
  ;;
*)
  echo "usage: $0 validation | test '[g,l,s]'" >&2
  exit 2
  ;;
esac
