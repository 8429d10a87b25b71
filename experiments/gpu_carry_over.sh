#!/usr/bin/env bash
# A change that should not move the numbers, shown by them on one GPU machine (docs/results/engine_carry_over_h200.md):
# the same evaluations and decode benchmarks through the code before the change and the current code.
#   bash experiments/gpu_carry_over.sh OUT BASE [STAGE...]
# BASE: a checkout of the earlier code (its nats/, kernels/, conf/: git archive <commit> nats kernels conf | tar -x -C
# BASE). STAGE (default: fig3 speed):
#   fig3   the reduced Figure 3 pair (docs/figure3.md): fig3_dense and fig3_nats (lambda 0.05), seed 1, trained side by
#          side (one GPU each where there are two), then nats-eval of each through both versions
#          (experiments/carry_over.py): test split, the first 512 windows; the dense model with the full cache,
#          StreamingLLM and H2O at B = N/16, the NAtS model with its cache
#   speed  Llama-3.1-8B's shape (random bf16 weights), 32k prompt, batch 1 and 8, 128 new tokens: the full cache and
#          NAtS at 25% kept through nats-generate's loop (benchmarks/bench_hf_decode.py), the library of each version
#          (the same benchmark script), one version after the other on an idle GPU
#   decode GPT-2-small's shape (random bf16 weights), 32k prompt, batch 8: the GPT path's decode step (the full cache
#          and NAtS, CUDA graphs) through each version's own benchmarks/bench_decode.py and library (the script
#          reads the cache's internals, which the change renamed; BASE needs its benchmarks/ too)
# WHEELS=<folder>: offline wheels (benchmarks/gpu_site.sh). PG19: the PG-19 subset (default ../shared/data/pg19-subset).
# SPEED_METHODS (default: full nats), SPEED_BATCH (default: 1 8), SPEED_LIMIT (s per version, default 280);
# DECODE_LIMIT (s per version, default 150).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:?usage: bash experiments/gpu_carry_over.sh OUT BASE [STAGE...]}
BASE=$(cd "${2:?usage: bash experiments/gpu_carry_over.sh OUT BASE [STAGE...]}" && pwd)
shift 2
stages=${*:-fig3 speed}
source benchmarks/gpu_site.sh
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$ngpu" -ge 1 ] || ngpu=1
runs=${RUNS_DIR:-logs/carry_over}

# in_version VERSION LIMIT LOG SCRIPT ARGS...: python3 SCRIPT ARGS with the library of VERSION (base: BASE, head: this
# checkout) first on the path, stopped after LIMIT seconds, its output in LOG
in_version() {
  local tree=$PWD links
  [ "$1" = base ] && tree=$BASE
  links=$(mktemp -d)
  ln -s "$tree/kernels" "$links/nats_kernels"
  local rc=0
  PYTHONPATH=$tree:$links${PYTHONPATH:+:$PYTHONPATH} timeout "$2" python3 "${@:4}" >"$3" 2>&1 || rc=$?
  local why="exit $rc"
  [ "$rc" = 124 ] && why="past its $2 s"
  [ "$rc" = 0 ] || echo "($(basename "$3" .log) stopped: $why)"
}
for stage in $stages; do
  t0=$(date +%s)
  case $stage in
    fig3)
      PG19=$(realpath -m "${PG19:-../shared/data/pg19-subset}") # absolute: the base version runs from BASE
      prepare_pg19_subset
      i=0
      for exp in dense nats; do # side by side: one GPU each where there are two, else both on the one
        CUDA_VISIBLE_DEVICES=$((i % ngpu)) python3 -m nats.train experiment=fig3_$exp seed=1 ckpt_path=auto \
          "data.path=$PG19" "hydra.run.dir=$runs/$exp" callbacks.progress_bar.refresh_rate=200 \
          >"$DEST/train_$exp.log" 2>&1 &
        i=$((i + 1))
      done
      wait
      for exp in dense nats; do
        grep -E "val/ppl|Error|error" "$DEST/train_$exp.log" | tail -3
      done
      evals=(
        "dense:methods=[full,streaming_llm,h2o]"
        "nats:methods=[nats]"
      )
      i=0
      for e in "${evals[@]}"; do
        exp=${e%%:*}
        CUDA_VISIBLE_DEVICES=$((i % ngpu)) python3 experiments/carry_over.py --base "$BASE" --out "$DEST/fig3_$exp" \
          gpt "$runs/$exp/checkpoints/last.ckpt" -- split=test max_windows=512 windows=first data=pg19_subset \
          "data.path=$PG19" "${e#*:}" 'budgets=[64]' batch_size=64 >"$DEST/eval_$exp.log" 2>&1 &
        i=$((i + 1))
      done
      wait
      cat "$DEST"/fig3_*/carry_over_gpt.md 2>/dev/null || tail -20 "$DEST"/eval_*.log
      ;;
    speed)
      for version in base head; do
        # shellcheck disable=SC2086 # the lists are word-split on purpose
        in_version "$version" "${SPEED_LIMIT:-280}" "$DEST/speed_$version.log" benchmarks/bench_hf_decode.py \
          --out "$DEST/speed_$version" --model-shape llama-3.1-8b --prompt 32768 --batch ${SPEED_BATCH:-1 8} \
          --kept 0.25 --new 128 --repeats 2 --methods ${SPEED_METHODS:-full nats}
        echo "== speed, $version"
        grep -E '^\||^Bandwidth' "$DEST/speed_$version.log" | tail -12
      done
      ;;
    decode) # each version's own script: it reads the cache's internals, which the change renamed
      for version in base head; do
        script=benchmarks/bench_decode.py
        [ "$version" = base ] && script=$BASE/$script
        in_version "$version" "${DECODE_LIMIT:-150}" "$DEST/decode_$version.log" "$script" \
          --out "$DEST/decode_$version" --lengths 32768 --batch 8 --policies full,nats --modes graph
        echo "== GPT decode, $version"
        grep -E '^\||^Bandwidth|re-captures' "$DEST/decode_$version.log" | tail -8
      done
      ;;
    *) echo "unknown stage $stage (fig3 speed decode)" && exit 2 ;;
  esac
  echo "($stage: $(($(date +%s) - t0)) s)"
done
