# Sourced by the benchmarks/gpu_*.sh and experiments/gpu_*.sh scripts from the repository root, after they set
# DEST (their first argument; default logs/bench/<date>):
#   - creates DEST;
#   - WHEELS=<folder> (optional): a folder of wheels for a machine without a package index; they are installed
#     (no index, no dependencies) into NATS_SITE_DIR (default build/site) when hydra is not importable, and put on
#     PYTHONPATH;
#   - installs nats and nats_kernels from the checkout (editable, no dependencies) when they are not importable.
# Exits the calling script if an install fails. Defines prepare_pg19_subset [LINES]: the PG-19 subset at PG19 (default
# ../shared/data/pg19-subset) tokenised by nats-prepare, outside the timed runs; the last LINES (3) of its output.
export PYTHONUNBUFFERED=1 PROJECT_ROOT=$PWD
mkdir -p "$DEST"
if [ -n "${WHEELS:-}" ] && ! python3 -c "import hydra" 2>/dev/null; then
  SITE=${NATS_SITE_DIR:-$PWD/build/site}
  mkdir -p "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import nats_kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

prepare_pg19_subset() {
  PG19=${PG19:-../shared/data/pg19-subset}
  python3 -m nats.prepare data=pg19_subset "data.path=$PG19" 2>&1 | tail -"${1:-3}"
}
