#!/usr/bin/env bash
# The test command: ruff, then the whole pytest suite, inside the venv made by ci/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
export PATH="$PWD/$VENV/bin:$PATH"
echo "[test] ruff check"
ruff check .
echo "[test] pytest"
python -m pytest -p no:cacheprovider --durations=30 "$@"
