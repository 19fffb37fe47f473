"""Build a pure-Python source tree of a vLLM release, for import-level compatibility tests.

    python ci/vllm_tree.py 0.33.0            # prints the tree's path: .cache/vllm-compat/vllm-0.33.0

Downloads the release's wheel from PyPI once per machine (``pip download --no-deps vllm==VERSION``;
it is the GPU build, 336 MB for 0.33.0) into ``$VLLM_DSA_WHEEL_CACHE`` (default
``~/.cache/vllm-dsa-connector/wheels``, outside the clone, so fresh CI clones reuse it), unpacks its ``.py`` files and its ``dist-info`` metadata, and leaves out the compiled
extensions (``.so``), CUDA headers and everything else. Put the tree first on ``sys.path``
(``PYTHONPATH``) over a CPU torch and ``VLLM_TARGET_DEVICE=cpu``: vLLM's Python modules import
(``vllm._C`` is missing, which vLLM logs and tolerates), so imports, configs, KV cache planning,
attention metadata classes and connector classes can be checked. No engine can run.

The tree is built in a temporary directory and renamed into place, so an interrupted run never
leaves a half tree; a finished tree has a ``.complete`` marker and is reused.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = ROOT / ".cache" / "vllm-compat"
DEFAULT_WHEELS = Path(
    os.environ.get("VLLM_DSA_WHEEL_CACHE")
    or Path.home() / ".cache" / "vllm-dsa-connector" / "wheels"
)
KEEP_METADATA = ("METADATA", "entry_points.txt", "top_level.txt")


def _log(msg: str) -> None:
    print(f"[vllm-tree] {msg}", file=sys.stderr, flush=True)


def wheel_path(version: str, wheels: Path = DEFAULT_WHEELS) -> Path:
    """The cached wheel of ``vllm==version``, downloaded once."""
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[-1]
    wheels.mkdir(parents=True, exist_ok=True)
    _log(f"downloading vllm=={version} (wheel only, no dependencies)")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         f"vllm=={version}", "-d", str(wheels)],
        check=True,
    )  # fmt: skip
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"pip download left no vllm-{version} wheel in {wheels}")
    return found[-1]


def _keep(name: str) -> bool:
    if name.endswith("/"):
        return False
    top = name.split("/", 1)[0]
    if top == "vllm":
        return name.endswith(".py")
    if top.endswith(".dist-info"):
        return name.rsplit("/", 1)[-1] in KEEP_METADATA
    return False


def build_tree(version: str, cache: Path = DEFAULT_CACHE, wheels: Path = DEFAULT_WHEELS) -> Path:
    """The path of the pure-Python tree of ``vllm==version`` (built once)."""
    tree = cache / f"vllm-{version}"
    if (tree / ".complete").exists():
        return tree
    wheel = wheel_path(version, wheels)
    _log(f"unpacking the Python sources of {wheel.name}")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".vllm-{version}-", dir=cache))
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if _keep(n)]
            for name in names:
                zf.extract(name, tmp)
        if not (tmp / "vllm" / "__init__.py").exists():
            raise SystemExit(f"{wheel.name} has no vllm/__init__.py")
        (tmp / ".complete").write_text(f"{wheel.name}\n{len(names)} files\n")
        if tree.exists():
            shutil.rmtree(tree)
        os.replace(tmp, tree)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"{len(names)} files in {tree}")
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="vLLM release, e.g. 0.33.0")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where trees go")
    parser.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS, help="wheel cache")
    args = parser.parse_args(argv)
    print(build_tree(args.version, args.cache.resolve(), args.wheels.expanduser().resolve()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
