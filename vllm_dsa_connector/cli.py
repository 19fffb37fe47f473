"""The ``vllm-dsa`` command.

Each sub-command lives in its own module under ``vllm_dsa_connector.commands`` exposing
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only when their command runs,
so ``vllm-dsa --help`` stays fast and a heavy import (vLLM, torch, NIXL) is paid only where needed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from vllm_dsa_connector.commands import DEV_HINT, dev_packages

# name -> (module, one-line help). ``bench`` takes a second-level name. The dev package adds its commands
# (demo, make-model, bench ...) through the ``vllm_dsa.dev`` entry point (vllm_dsa_connector.commands).
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("vllm_dsa_connector.commands.inspect", "print the KV page tables of a model"),
    "options": ("vllm_dsa_connector.commands.options", "list every option: key, environment variable, default"),
    "explain": ("vllm_dsa_connector.commands.explain", "why D did not load a request from P (a reason), and the fix"),
}
BENCHES: dict[str, tuple[str, str]] = {}
for _dev in dev_packages():
    COMMANDS.update(_dev.COMMANDS)
    BENCHES.update(_dev.BENCHES)
#: Commands only the dev package has: asked for without it, ``vllm-dsa`` says how to install it.
DEV_COMMANDS = ("demo", "make-model", "bench")


def _available(table: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    return {k: v for k, v in table.items() if importlib.util.find_spec(v[0]) is not None}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (sub-commands whose modules are installed)."""
    parser = argparse.ArgumentParser(prog="vllm-dsa", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in _available(COMMANDS).items():
        p = sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    benches = _available(BENCHES)
    if benches:
        bench = sub.add_parser("bench", help="benchmarks (print ratios measured side by side)")
        bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
        for name, (module, help_text) in benches.items():
            p = bsub.add_parser(name, help=help_text)
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vllm-dsa`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DEV_COMMANDS and argv[0] not in COMMANDS and not (argv[0] == "bench" and BENCHES):
        print(f"vllm-dsa {argv[0]}: {DEV_HINT}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        print("vllm-dsa: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
