#!/usr/bin/env bash
# Every test marked `gpu` (tests/test_kernels.py, test_density_kernel.py, test_generate.py, ...) on a GPU machine,
# with the project's wheels from .whl/ when hydra & co. are not installed (as the other gpu_*.sh scripts).
#   bash benchmarks/gpu_tests.sh [pytest args]
# Machines without network: carry the embedded corpus's token cache (data/gutenberg-*-gpt2/, 4 MB, built here by
# any CPU test run) and .whl/; tests/test_generate.py::test_cuda_matches_cpu trains from it and cannot download it.
# About 6.5 minutes on one H100 (17 tests, autotuned; the Triton choices are then kept in Triton's cache).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
if ! $PY -c "import hydra, omegaconf" 2>/dev/null; then
  SITE=${NATS_SITE_DIR:-/tmp/site}
  [ -d "$SITE/hydra" ] || $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl \
    || { echo "no hydra/omegaconf and no wheels in .whl/: run ../shared/device/prepare.sh here and carry .whl"; exit 2; }
  export PYTHONPATH=$SITE:$PWD
fi
$PY -c "import nats_kernels" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e . || exit 1
ls -d data/gutenberg-*-gpt2 >/dev/null 2>&1 || echo "note: no data/gutenberg-*-gpt2: test_cuda_matches_cpu will try to download the corpus"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$PY -m pytest -m gpu -q -rfE --ignore tests/test_notebook.py -p no:cacheprovider "$@"
