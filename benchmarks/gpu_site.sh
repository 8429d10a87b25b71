# Sourced (`source benchmarks/gpu_site.sh`) by the one-call GPU scripts, from the repository root, once $OUT is set:
# creates $OUT, installs the wheels of .whl/ into $SITE (scratch outside the checkout, see benchmarks/README.md;
# once per machine), nats and nats_kernels from the checkout (editable), and exports PYTHONPATH. Exits the calling
# script if an install fails.
SITE=${NATS_SITE_DIR:-/tmp/site}
mkdir -p "$OUT" "$SITE"
if [ ! -d "$SITE/hydra" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl || exit 1
fi
python3 -c "import nats_kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export PYTHONPATH=$SITE:$PWD
