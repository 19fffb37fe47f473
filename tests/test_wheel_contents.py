"""The wheel ships only what a deployment runs: no harness, bench, tiny model, tokenizer test asset, KV probe or
anything of the dev package (dev/, installed by ci/setup.sh from the clone), and a package top level one can take in
at a glance. The wheel is built for real (``python -m build --wheel``, as ci/wheel.sh builds it) and its file list
read."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Entries (modules, packages, data) directly under vllm_dsa_connector/ in the wheel.
MAX_TOP_LEVEL = 15
#: What belongs to the workshop, by file path inside the wheel.
DEV_ONLY = re.compile(r"(^|/)(harness|bench|bench_[^/]*\.py|tiny_models?\.py|assets\.py|workloads\.py|kv_probe\.py"
                      r"|demo\.py|make_model\.py|vllm_dsa_dev)(/|$)")


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    src = tmp_path_factory.mktemp("src")
    # a copy of what the sdist would hold, so the build writes nothing into the checkout
    for name in ("pyproject.toml", "README.md", "LICENSE", "vllm_dsa_connector"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                        if (ROOT / name).is_dir() else {}))
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("*.whl")
    return zipfile.ZipFile(whl).namelist()


def test_the_wheel_holds_no_dev_module(wheel_files: list[str]) -> None:
    ours = [f for f in wheel_files if not f.startswith("vllm_dsa_connector-")]
    assert all(f.startswith("vllm_dsa_connector/") for f in ours), ours
    dev = [f for f in ours if DEV_ONLY.search(f)]
    assert not dev, f"dev-only files in the wheel: {dev}"
    for must in ("vllm_dsa_connector/plugin.py", "vllm_dsa_connector/core/handoff/producer.py",
                 "vllm_dsa_connector/proxy/app.py", "vllm_dsa_connector/examples/glm5_2_shape.json"):
        assert must in ours, must


def test_the_package_top_level_is_small(wheel_files: list[str]) -> None:
    top = sorted({f.split("/")[1] for f in wheel_files if f.startswith("vllm_dsa_connector/")})
    assert len(top) <= MAX_TOP_LEVEL, top
