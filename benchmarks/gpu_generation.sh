#!/usr/bin/env bash
# Generation on one GPU machine, in order of what it shows: the fused NAtS decode kernels against their
# references, transformers' generate (bench_hf_decode.py: compiled StaticCache against the fixed-capacity caches,
# with kernel profiles), the GPT path (bench_decode.py), then the remaining GPU tests of both paths.
#   bash benchmarks/gpu_generation.sh OUT_DIR
# WHEELS=<folder> installs offline wheels (hydra, omegaconf, ...) first where the machine has no index.
set -uo pipefail
out=${1:-logs/bench/generation}
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nats-site "$WHEELS"/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/nats-site:$PWD
fi
python3 -c "import nats_kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e .
export PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
python3 -m pytest -q -p no:cacheprovider tests/test_cache.py -k "nats_step or triton_pool" 2>&1 | tail -2 | tee "$out/kernel_tests.log"
timeout "${HF_LIMIT:-240}" python3 benchmarks/bench_hf_decode.py --out "$out/hf" --prompt 8192 --batch 1 8 --kept 0.25 \
  --methods static nats --profile 2>&1 | grep -v Warn | tail -12
timeout "${GPT_LIMIT:-120}" python3 benchmarks/bench_decode.py --lengths 8192,32768 --batch 8 \
  --policies full,nats,streaming_llm --modes graph --out "$out/gpt" 2>&1 | tail -12
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_hf_static_cache.py \
  tests/test_decode_path.py tests/test_generate.py 2>&1 | tail -4 | tee "$out/gpu_tests.log"
