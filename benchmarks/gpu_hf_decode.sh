#!/usr/bin/env bash
# Fast generation on a GPU machine: the GPU tests of the fixed-capacity cache, then bench_hf_decode.py.
#   bash benchmarks/gpu_hf_decode.sh OUT_DIR [bench_hf_decode.py arguments]
# WHEELS=<folder> installs offline wheels (hydra, omegaconf, ...) first where the machine has no index.
set -euo pipefail
out=${1:-logs/bench/hf_decode}; shift || true
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nats-site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/nats-site:$PWD
fi
python3 -c "import nats_kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e .
export PYTHONUNBUFFERED=1
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_hf_static_cache.py tests/test_cache.py -k "gpu or triton" 2>&1 | tee "$out/gpu_tests.log"
fi
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
python3 benchmarks/bench_hf_decode.py --out "$out" "$@" 2>&1 | tee "$out/bench.log"
