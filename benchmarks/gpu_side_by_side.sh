#!/usr/bin/env bash
# Groups of gpu_generation.sh stages side by side on one machine of several GPUs, one GPU per group (each run is
# alone on its GPU; its ratios are of rows measured on that GPU in the same run):
#   bash benchmarks/gpu_side_by_side.sh OUT_DIR "STAGE [STAGE...]" "STAGE..." ...
# A group's words of the form NAME=VALUE are set in its environment for the stages after them, in order (e.g.
# "HF_LIMIT=300 limit8b LIMIT_METHODS=nats profile8b": limit8b with the default methods, profile8b with NAtS' only).
# Group i runs on GPU i (CUDA_VISIBLE_DEVICES), writes OUT_DIR/gpu<i>/ and its summary OUT_DIR/gpu<i>.out, printed
# here at the end, then the decoding-at-the-limit targets over every bench_hf_decode result
# (benchmarks/limit_targets.py, OUT_DIR/targets.md).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:?usage: gpu_side_by_side.sh OUT_DIR "STAGES" ...}
shift
source benchmarks/gpu_site.sh # installs once, before the groups start
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$#" -le "$gpus" ] || { echo "$# groups but $gpus GPUs: give at most one group per GPU"; exit 2; }
i=0
for group in "$@"; do
  (
    : >"$DEST/gpu$i.out"
    for w in $group; do # each stage runs with the assignments before it
      if [[ $w == *=* ]]; then
        export "${w?}"
      else
        CUDA_VISIBLE_DEVICES=$i bash benchmarks/gpu_generation.sh "$DEST/gpu$i" "$w" >>"$DEST/gpu$i.out" 2>&1
      fi
    done
  ) &
  i=$((i + 1))
done
wait
for ((j = 0; j < i; j++)); do
  echo "=== GPU $j"
  cat "$DEST/gpu$j.out"
done
mapfile -t results < <(find "$DEST" -name bench_hf_decode.json | sort)
if [ "${#results[@]}" -gt 0 ]; then # the decoding-at-the-limit targets over every bench_hf_decode result
  echo "=== targets"
  python3 benchmarks/limit_targets.py "${results[@]}" --out "$DEST/targets.md"
fi
