#!/usr/bin/env bash
# Generation on one GPU machine, in order of what it shows: the fused NAtS decode kernels against their
# references, transformers' generate (bench_hf_decode.py: compiled StaticCache against the fixed-capacity caches),
# the GPT path (bench_decode.py), then the remaining GPU tests of both paths.
#   bash benchmarks/gpu_generation.sh OUT_DIR [STAGE...]
# STAGE (default: all of them but those on request, in this order):
#   kernels  the decode kernels' tests
#   hf8k     8k prompt, batch 1 / 8, ~25% and ~10% kept: DynamicCache, StaticCache, NAtS (also with the PyTorch
#            prefill writes)
#   hf8k_eq  8k prompt, equal KV memory (2 GiB): the largest batch StaticCache and NAtS (~25% / ~10% kept) fit
#   hf32k    32k prompt, batch 1 / 8, ~25% kept
#   gpt      the GPT path at 8k / 32k, batch 8, CUDA graphs
#   tests    the gpu-marked tests of both paths
#   hf8k_large  8k prompt, batch 32 / 64, ~25% kept
#   profile  kernel tables of the 8k batch-1 prefill and decode steps (StaticCache and NAtS)
#   host     the host's work per decode step at 8k, batch 1 (bench_hf_host.py: guard check, prefill launches)
#   on request only (not in the default list), the decoding-at-the-limit rows (bench_hf_decode.py: the gpt-fast-style
#   full cache, the project's full cache and NAtS ~25% kept through nats-generate's loop, each against the bandwidth):
#   limit8b     Llama-3.1-8B's shape, 32k prompt, batch 1 and 8
#   limit8b_8k  the same at 8k
#   limit1b     Llama-3.2-1B's shape, 8k and 32k, batch 1 and 8
#               (the limit stages' batches: LIMIT_BATCH, default "1 8"; methods: LIMIT_METHODS; commas or spaces)
#   profile1b   Llama-3.2-1B's shape, 8k, batch 1 (PROFILE_BATCH): where a decode step's time goes (full and NAtS;
#               --profile)
#   profile8b   the same at Llama-3.1-8B's shape, 32k, batch 8 (methods: LIMIT_METHODS)
#   smol8k      SmolLM2-135M's shape, 8k, batch 1, transformers' StaticCache beside them (methods: SMOL_METHODS)
#   eq8b        Llama-3.1-8B's shape, 32k, equal KV memory (EQ_GIB, default 8 and 32 GiB): the largest batch each
#               cache fits
#   sweep       the pool attention's launch choices (sweep_pool_attention.py; SWEEP_SHAPES: only those shapes,
#               SWEEP_ONLY: only those choices, its --only)
#   mixed       Llama-3.2-1B's shape: 50 requests of batch 1-16 and prompts of 1k-32k in one process, the project's
#               full cache and NAtS (~25% kept; methods: MIXED_METHODS), against the same requests again
# WHEELS=<folder> installs offline wheels (hydra, omegaconf, ...) first where the machine has no index
# (benchmarks/gpu_site.sh). Each stage's time limit: HF_LIMIT (s, default 480), GPT_LIMIT (150), TEST_LIMIT (320).
# HF_ARGS: more bench_hf_decode.py arguments for every stage that runs it, e.g.
# HF_ARGS="--inductor coordinate_descent_tuning=True"; GPT_ARGS: more bench_decode.py arguments for the gpt stage
# (commas or spaces), e.g. GPT_ARGS=--profile,--inductor=combo_kernels=True. TAG: a suffix of every stage's output
# name (OUT/<stage><TAG>), to run a stage twice in one group with other settings.
# Each stage's whole output: OUT/<stage>.log. tests/test_generate.py::test_cuda_matches_cpu trains from the embedded
# corpus's token cache (data/gutenberg-*-gpt2/, written by any CPU test run): without network, bring it along.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-logs/bench/generation} # read by gpu_site.sh too
shift || true
stages=${*:-kernels hf8k hf8k_eq hf32k gpt tests hf8k_large profile host}
LIMIT_BATCH=${LIMIT_BATCH:-1 8}
LIMIT_BATCH=${LIMIT_BATCH//,/ }
LIMIT_METHODS=${LIMIT_METHODS:-flex_static full nats}
LIMIT_METHODS=${LIMIT_METHODS//,/ }
SMOL_METHODS=${SMOL_METHODS:-static flex_static full nats}
SMOL_METHODS=${SMOL_METHODS//,/ }
MIXED_METHODS=${MIXED_METHODS:-full nats}
MIXED_METHODS=${MIXED_METHODS//,/ }
MIXED_ONLY=${MIXED_ONLY:+--mixed-only} # MIXED_ONLY=1: the mixed stage without its single-shape rows
GPT_ARGS=${GPT_ARGS:-}
EQ_GIB=${EQ_GIB:-8 32}
EQ_GIB=${EQ_GIB//,/ }
source benchmarks/gpu_site.sh
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
hf() { # name, bench_hf_decode.py arguments: the whole output in OUT/<name>.log (compile and CUDA-graph warnings
  # included), the table here; the table in OUT/<name>/ is rewritten after every row, so a stage stopped by its
  # time limit keeps the rows it measured
  local name=$1${TAG:-}
  shift
  echo "== $name"
  # shellcheck disable=SC2086 # HF_ARGS: more arguments for every bench_hf_decode stage, word-split
  timeout "${HF_LIMIT:-480}" python3 benchmarks/bench_hf_decode.py --out "$DEST/$name" "$@" ${HF_ARGS:-} \
    >"$DEST/$name.log" 2>&1 ||
    echo "($name stopped: exit $?; the rows measured so far are in $DEST/$name/)"
  grep -E '^\||^#|^Bandwidth|skipping cudagraphs|failed at prompt' "$DEST/$name.log" | tail -30
}
for stage in $stages; do
  t0=$(date +%s)
  case $stage in
    kernels) python3 -m pytest -q -rfE -p no:cacheprovider tests/test_cache.py -k "nats_step or triton_pool" \
      >"$DEST/kernel_tests.log" 2>&1
      tail -n 4 "$DEST/kernel_tests.log" ;;
    hf8k) hf hf8k --prompt 8192 --batch 1 8 --kept 0.25 0.1 --methods static dynamic nats \
      nats_torch_prefill ;;
    hf8k_eq) hf hf8k_eq --prompt 8192 --batch 1 --kept 0.25 0.1 --methods static nats --equal-memory-gib 2 ;;
    hf8k_large) hf hf8k_large --prompt 8192 --batch 32 64 --kept 0.25 --methods static nats ;;
    hf32k) hf hf32k --prompt 32768 --batch 1 8 --kept 0.25 --methods static nats ;;
    limit8b) hf limit8b --model-shape llama-3.1-8b --prompt 32768 --batch $LIMIT_BATCH --kept 0.25 --new 128 \
      --repeats 2 --methods $LIMIT_METHODS ;;
    limit8b_8k) hf limit8b_8k --model-shape llama-3.1-8b --prompt 8192 --batch $LIMIT_BATCH --kept 0.25 --new 128 \
      --repeats 2 --methods $LIMIT_METHODS ;;
    limit1b) hf limit1b --model-shape llama-3.2-1b --prompt 8192 32768 --batch $LIMIT_BATCH --kept 0.25 --new 128 \
      --repeats 2 --methods $LIMIT_METHODS ;;
    profile8b) hf profile8b --model-shape llama-3.1-8b --prompt 32768 --batch 8 --kept 0.25 --new 32 --repeats 1 \
      --methods $LIMIT_METHODS --profile ;;
    profile1b) hf profile1b --model-shape llama-3.2-1b --prompt 8192 --batch "${PROFILE_BATCH:-1}" --kept 0.25 \
      --new 32 --repeats 1 --methods full nats --profile ;;
    smol8k) hf smol8k --model-shape smollm2-135m --prompt 8192 --batch 1 --kept 0.25 --new 256 --repeats 2 \
      --methods $SMOL_METHODS ;;
    eq8b) hf eq8b --model-shape llama-3.1-8b --prompt 32768 --batch 1 --kept 0.25 --new 64 --repeats 1 \
      --methods full nats --equal-memory-gib $EQ_GIB ;;
    sweep) timeout "${GPT_LIMIT:-150}" python3 benchmarks/sweep_pool_attention.py --out "$DEST/sweep" \
      --shapes "${SWEEP_SHAPES:-}" ${SWEEP_ONLY:+--only "$SWEEP_ONLY"} >"$DEST/sweep.log" 2>&1
      grep -E '^\|' "$DEST/sweep.log" | tail -50 ;;
    mixed) hf mixed --model-shape llama-3.2-1b --prompt 8192 --batch 1 --kept 0.25 --new 64 --repeats 1 \
      --methods $MIXED_METHODS --mixed 50 $MIXED_ONLY ;;
    profile) hf profile --prompt 8192 --batch 1 --kept 0.25 --methods static nats nats_torch_prefill --profile ;;
    host) timeout "${HF_LIMIT:-480}" python3 benchmarks/bench_hf_host.py --prompt 8192 --out "$DEST/host" \
      >"$DEST/host.log" 2>&1
      grep -E '^\|' "$DEST/host.log" | tail -4 ;;
    gpt) # shellcheck disable=SC2086 # GPT_ARGS: more arguments, word-split
      timeout "${GPT_LIMIT:-150}" python3 benchmarks/bench_decode.py --lengths 8192,32768 --batch 8 \
      --policies full,nats,streaming_llm --modes graph --out "$DEST/gpt${TAG:-}" ${GPT_ARGS//,/ } \
      >"$DEST/gpt${TAG:-}.log" 2>&1
      grep -E 'replayed steps' "$DEST/gpt${TAG:-}.log"
      tail -n 12 "$DEST/gpt${TAG:-}.log" ;;
    # the failures' tracebacks stay in the log (-rfE: the reason of each in the summary)
    tests) timeout "${TEST_LIMIT:-320}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu \
      tests/test_hf_static_cache.py tests/test_decode_path.py tests/test_generate.py tests/test_hf_loop.py \
      tests/test_hf_fused.py tests/test_hf_buffers.py tests/test_hf_cache.py >"$DEST/gpu_tests.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$DEST/gpu_tests.log" | tail -8 ;;
    *) echo "unknown stage $stage (kernels hf8k hf8k_eq hf32k gpt tests hf8k_large profile host limit8b" \
      "limit8b_8k limit1b profile1b profile8b smol8k eq8b sweep mixed)" && exit 2 ;;
  esac
  echo "-- $stage: $(($(date +%s) - t0)) s"
done
