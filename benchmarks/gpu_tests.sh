#!/usr/bin/env bash
# Every test marked `gpu` (tests/test_kernels.py, test_density_kernel.py, test_generate.py, ...) on a GPU machine;
# the log goes to DEST/gpu_tests.log. About 6.5 minutes on one H100 (autotuned; Triton keeps its choices in its
# cache).
#   bash benchmarks/gpu_tests.sh [DEST] [pytest args]          (default DEST: logs/bench/<date>)
# WHEELS=<folder of wheels> for a machine without a package index (benchmarks/gpu_site.sh). No network is needed:
# the GPU tests that train a model make their corpus themselves (tests/conftest.py: local_corpus).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-logs/bench/$(date +%F)}
[ $# -gt 0 ] && shift
source benchmarks/gpu_site.sh
python3 -m pytest -m gpu -q -rfE --ignore tests/test_notebook.py -p no:cacheprovider "$@" 2>&1 | tee "$DEST/gpu_tests.log"
exit "${PIPESTATUS[0]}"
