#!/usr/bin/env bash
# Generation on one GPU machine, in order of what it shows: the fused NAtS decode kernels against their
# references, transformers' generate (bench_hf_decode.py: compiled StaticCache against the fixed-capacity caches),
# the GPT path (bench_decode.py), then the remaining GPU tests of both paths.
#   bash benchmarks/gpu_generation.sh OUT_DIR [STAGE...]
# STAGE (default: all of them, in this order):
#   kernels  the decode kernels' tests
#   hf8k     8k prompt, batch 1 / 8 / 32 / 64, ~25% and ~10% kept, then the equal-KV-memory rows (2 GiB)
#   hf32k    32k prompt, batch 1 / 8, ~25% kept
#   profile  kernel tables of the 8k batch-1 prefill and decode steps (StaticCache and NAtS)
#   gpt      the GPT path at 8k / 32k, batch 8, CUDA graphs
#   tests    the gpu-marked tests of both paths
# WHEELS=<folder> installs offline wheels (hydra, omegaconf, ...) first where the machine has no index
# (benchmarks/gpu_site.sh). Each stage's time limit: HF_LIMIT (s, default 420), GPT_LIMIT (150), TEST_LIMIT (200).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-logs/bench/generation}
shift || true
stages=${*:-kernels hf8k hf32k profile gpt tests}
DEST=$out
source benchmarks/gpu_site.sh
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
hf() { # name, bench_hf_decode.py arguments
  local name=$1
  shift
  echo "== $name"
  timeout "${HF_LIMIT:-420}" python3 benchmarks/bench_hf_decode.py --out "$out/$name" "$@" 2>&1 | grep -v Warn |
    grep -E '^\||^#' | tail -30
}
for stage in $stages; do
  t0=$(date +%s)
  case $stage in
    kernels) python3 -m pytest -q -p no:cacheprovider tests/test_cache.py -k "nats_step or triton_pool" 2>&1 | tail -2 |
      tee "$out/kernel_tests.log" ;;
    hf8k) hf hf8k --prompt 8192 --batch 1 8 32 64 --kept 0.25 0.1 --methods static nats --equal-memory-gib 2 ;;
    hf32k) hf hf32k --prompt 32768 --batch 1 8 --kept 0.25 --methods static nats ;;
    profile) hf profile --prompt 8192 --batch 1 --kept 0.25 --methods static nats --profile ;;
    gpt) timeout "${GPT_LIMIT:-150}" python3 benchmarks/bench_decode.py --lengths 8192,32768 --batch 8 \
      --policies full,nats,streaming_llm --modes graph --out "$out/gpt" 2>&1 | tail -12 ;;
    tests) timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_hf_static_cache.py \
      tests/test_decode_path.py tests/test_generate.py 2>&1 | tail -4 | tee "$out/gpu_tests.log" ;;
    *) echo "unknown stage $stage (kernels hf8k hf32k profile gpt tests)" && exit 2 ;;
  esac
  echo "-- $stage: $(($(date +%s) - t0)) s"
done
