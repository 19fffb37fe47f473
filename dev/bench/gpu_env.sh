# Sourced by the GPU session scripts (gpu_spans.sh, gpu_session.sh): the checkout root as REPO, the payload's
# site dir, the checkout and its dev/ package on PYTHONPATH, and an entry point for that PYTHONPATH copy of
# dev/, through which `vllm-dsa make-model` and `bench` find their commands (run.sh's install gives the
# plugin its own; the payload installs neither package).
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYLIB=${PYLIB:-$REPO/.gpu/pylib}; [ -d "$PYLIB" ] || PYLIB=$REPO/../.gpu/pylib
export PYTHONPATH=/tmp/site:$REPO:$REPO/dev:$PYLIB PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
DEV_DIST=/tmp/site/vllm_dsa_dev-0.1.0.dist-info
if [ -d /tmp/site ] && [ ! -f "$DEV_DIST/entry_points.txt" ]; then
  mkdir -p "$DEV_DIST"
  printf 'Metadata-Version: 2.1\nName: vllm-dsa-dev\nVersion: 0.1.0\n' >"$DEV_DIST/METADATA"
  printf '[vllm_dsa.dev]\ncommands = vllm_dsa_dev.commands\n' >"$DEV_DIST/entry_points.txt"
fi
cd "$REPO"
