#!/usr/bin/env bash
# Release check: build the sdist and wheel, `twine check` them, install the wheel into a clean
# venv (no vLLM there) and check what it ships: version, entry points, example data, LICENSE, and that the
# dev package's commands are absent with a clear message (tests/test_wheel_contents.py checks the file list).
# Uses the build/twine of the venv made by ci/setup.sh. Output in dist/.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$PWD/$VENV/bin/python"
start=$SECONDS
rm -rf dist
"$PY" -m build --sdist --wheel --outdir dist . >/dev/null
"$PY" -m twine check --strict dist/*
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q dist/*.whl
(cd "$tmp" && "$tmp/venv/bin/python" - "$("$PY" -c 'import vllm_dsa_connector as p; print(p.__version__)')" <<'PY'
import importlib.metadata as md
import importlib.resources as res
import sys

import vllm_dsa_connector

want = sys.argv[1]
dist = md.distribution("vllm-dsa-connector")
assert dist.version == vllm_dsa_connector.__version__ == want, (dist.version, want)
eps = {(e.group, e.name): e.value for e in dist.entry_points}
assert eps[("vllm.general_plugins", "vllm_dsa_connector")] == "vllm_dsa_connector:register", eps
assert eps[("console_scripts", "vllm-dsa")] == "vllm_dsa_connector.cli:main", eps
assert res.files("vllm_dsa_connector").joinpath("examples/glm5_2_shape.json").is_file()
assert res.files("vllm_dsa_connector").joinpath("py.typed").is_file()
assert any(str(f).endswith("LICENSE") for f in dist.files), "LICENSE not in the wheel"
extras = dist.metadata.get_all("Provides-Extra")
assert {"cpu", "gpu", "test", "lint"} <= set(extras), extras
reqs = " ".join(dist.requires or [])
assert "vllm<0.35,>=0.32" in reqs.replace(" ", "") or "vllm>=0.32,<0.35" in reqs.replace(" ", ""), reqs
import subprocess

bench = subprocess.run([sys.executable, "-m", "vllm_dsa_connector.cli", "bench", "transfer"], capture_output=True,
                       text=True, timeout=120)
assert bench.returncode == 2 and "pip install -e dev/" in bench.stderr, (bench.returncode, bench.stderr[-2000:])
print(f"[wheel] vllm-dsa-connector {dist.version}: entry points, data, LICENSE, extras ok; dev commands absent")
PY
)
ls -l dist
echo "[wheel] $((SECONDS - start)) s"
