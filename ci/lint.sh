#!/usr/bin/env bash
# The pre-commit hooks (.pre-commit-config.yaml: ruff check, ruff format on the listed files,
# codespell, mypy, file checks) on every tracked file, with the venv made by ci/setup.sh.
# Extra arguments go to `pre-commit run` (e.g. `bash ci/lint.sh mypy` runs one hook).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
export PATH="$PWD/$VENV/bin:$PATH"
start=$SECONDS
pre-commit run --all-files --show-diff-on-failure "$@"
echo "[lint] pre-commit: $((SECONDS - start)) s"
