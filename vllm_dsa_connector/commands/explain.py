"""``vllm-dsa explain [REASON]``: why a decode engine did not load a request's KV from P, and the fix.

The reasons are the ``reason`` label of ``vllm:dsa_kv_load_failures_total`` and the ``reason`` of D's log
line and request record (:data:`vllm_dsa_connector.core.handoff.recompute.FIXES`, the one table); without a
REASON every one is listed. Invariant: needs no vLLM (runs on an operator's laptop).
"""

from __future__ import annotations

import argparse
import sys
import textwrap


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("reason", nargs="?", help="a reason from D's log line, record or metric label (none: all)")


def explain(reason: str) -> str:
    """The text for one ``reason`` (what happened, then the fix)."""
    from vllm_dsa_connector.core.handoff.recompute import FIXES

    what, fix = FIXES[reason]
    wrap = textwrap.TextWrapper(width=100, initial_indent="  ", subsequent_indent="  ")
    return f"{reason}\n{wrap.fill('what: ' + what)}\n{wrap.fill('fix:  ' + fix)}\n"


def run(args: argparse.Namespace) -> int:
    """Print the fix of ``args.reason`` (every reason without one); 2 for an unknown reason."""
    from vllm_dsa_connector.core.handoff.recompute import REASONS

    if args.reason is None:
        print("\n".join(explain(r) for r in REASONS), end="")
        return 0
    if args.reason not in REASONS:
        print(f"vllm-dsa explain: unknown reason {args.reason!r}; known: {', '.join(REASONS)}", file=sys.stderr)
        return 2
    print(explain(args.reason), end="")
    return 0
