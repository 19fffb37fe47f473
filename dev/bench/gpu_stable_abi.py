"""Static check: can a vLLM wheel's CUDA extensions load on an older torch through torch's stable C ABI?

    python dev/bench/gpu_stable_abi.py ~/.cache/vllm-dsa-connector/wheels/vllm-0.34.0-*.whl --host-torch 2.11

The GPU host has torch 2.11 and no package index (``shared/gpu/README.md``); vLLM 0.32 runs there because its
extensions call torch only through the stable C ABI. This script reads a wheel without installing it: for
every extension that links a torch library it lists the torch symbols it imports (``nm -D``), refuses C++
torch symbols (``c10::``, ``at::``, ``torch::``: not stable across releases), and looks up in which torch
release each stable C symbol appeared, from the ``TORCH_FEATURE_VERSION >= TORCH_VERSION_X_Y_Z`` guards of
the headers of a torch install (default: this venv's; a symbol outside any guard predates them). It exits 1
when an extension needs a C++ symbol or a symbol newer than ``--host-torch``. A pass says the extensions
link on that torch; it does not prove the Python side or every op at run time (a GPU run does).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

TORCH_LIBS = ("libtorch", "libc10")
CXX_TORCH = re.compile(r"^_ZN?K?(3c10|2at|5torch)")
STABLE = re.compile(r"^(aoti_torch_|torch_)")
GUARD = re.compile(r"#\s*if\s+TORCH_FEATURE_VERSION\s*>=\s*TORCH_VERSION_(\d+)_(\d+)_(\d+)")


def introduced_in(headers: Iterable[Path], names: set[str]) -> dict[str, str]:
    """``name -> "X.Y"`` (the version guard around its declaration) or ``"unguarded"``; absent if not found."""
    found: dict[str, str] = {}
    decl = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\s*\(") if names else None
    for path in headers:
        stack: list[str | None] = []
        for line in path.read_text(errors="replace").splitlines():
            text = line.strip()
            if m := GUARD.match(text):
                stack.append(f"{m[1]}.{m[2]}")
            elif re.match(r"#\s*if", text):
                stack.append(None)
            elif re.match(r"#\s*endif", text):
                if stack:
                    stack.pop()
            elif decl is not None:
                for m in decl.finditer(text):
                    guards = [v for v in stack if v]
                    found.setdefault(m[1], guards[-1] if guards else "unguarded")
    return found


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _dynamic(path: Path, what: str) -> list[str]:
    out = subprocess.run(["nm", "-D", what, str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.split()]


def _needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"Shared library: \[([^\]]+)\]", out)


def check(wheel: Path, include: Path, host_torch: str) -> dict[str, object]:
    """The report of ``wheel`` against a host torch of version ``host_torch``."""
    headers = [p for p in include.rglob("*.h") if "stable" in p.parts or "aoti_torch" in p.parts]
    exts: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if not name.endswith(".so"):
                continue
            path = Path(zf.extract(name, tmp))
            torch_libs = [n for n in _needed(path) if n.startswith(TORCH_LIBS)]
            if not torch_libs:
                continue
            undefined = _dynamic(path, "--undefined-only")
            exts[name] = {
                "torch_libs": torch_libs,
                "cxx_torch_symbols": sorted(s for s in undefined if CXX_TORCH.match(s)),
                "stable_symbols": sorted(s for s in undefined if STABLE.match(s)),
            }
    needed = {s for e in exts.values() for s in e["stable_symbols"]}  # type: ignore[attr-defined]
    since = introduced_in(headers, needed)
    too_new = sorted(s for s, v in since.items() if v != "unguarded" and _version(v) > _version(host_torch))
    unknown = sorted(needed - set(since))
    cxx = sorted({s for e in exts.values() for s in e["cxx_torch_symbols"]})  # type: ignore[attr-defined]
    by_version: dict[str, int] = {}
    for v in since.values():
        by_version[v] = by_version.get(v, 0) + 1
    return {
        "wheel": wheel.name,
        "host_torch": host_torch,
        "extensions": {k: {"torch_libs": v["torch_libs"], "stable": len(v["stable_symbols"]),  # type: ignore[arg-type]
                           "cxx": len(v["cxx_torch_symbols"])} for k, v in sorted(exts.items())},  # type: ignore[arg-type]
        "stable_symbols": len(needed),
        "introduced_in": dict(sorted(by_version.items())),
        "newer_than_host": too_new,
        "not_in_headers": unknown,
        "cxx_torch_symbols": cxx,
        "loads": not too_new and not cxx,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--host-torch", default="2.11", help="the host's torch release (X.Y)")
    parser.add_argument("--torch-include", type=Path, default=None,
                        help="headers of a torch at least as new as the wheel's (default: this venv's)")
    args = parser.parse_args(argv)
    include = args.torch_include
    if include is None:
        import torch

        include = Path(torch.__file__).parent / "include"
    report = check(args.wheel, include, args.host_torch)
    print(json.dumps(report, indent=1))
    return 0 if report["loads"] else 1


if __name__ == "__main__":
    sys.exit(main())
