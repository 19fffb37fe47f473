"""The README's option list is the code's: generated from the settings classes and checked here."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_dsa_connector.commands.options import markdown, sections
from vllm_dsa_connector.options import all_options

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BEGIN = re.compile(r"<!-- options:begin[^>]*-->\n")
END = "<!-- options:end -->"


def _block() -> str:
    m = BEGIN.search(README)
    assert m and END in README, "README.md lost its <!-- options:begin/end --> markers"
    return README[m.end():README.index(END)]


def test_readme_option_tables_are_generated_from_the_code() -> None:
    """Every option (key, env, default, meaning) in the code is in the README, and nothing else is."""
    assert _block() == markdown(), "README options are stale: paste `vllm-dsa options --markdown` between the markers"


def test_every_declared_option_row_is_in_the_readme() -> None:
    """The same, option by option (a readable failure naming the option)."""
    block = _block()
    rows = {line.split("|")[2].strip().strip("`") for line in block.splitlines() if line.startswith("| ")}
    for _, settings_cls in sections():
        for o in all_options(settings_cls):
            assert o.env in rows, f"{o.key} ({o.env}) missing from README.md's options"
            key = "(environment only)" if o.env_only else f"`{o.key}`"
            assert f"| {key} | `{o.env}` |" in block, o.key


def test_every_readme_env_variable_exists_in_the_code() -> None:
    """A ``VLLM_DSA_*`` name in the README is declared by an option or read by the package's code."""
    declared = {o.env for _, cls in sections() for o in all_options(cls)}
    source = "\n".join(p.read_text() for p in (ROOT / "vllm_dsa_connector").rglob("*.py"))
    named = set(re.findall(r"VLLM_DSA_[A-Z0-9_]*[A-Z0-9]", README))  # families like VLLM_DSA_TOKCACHE_{..}
    missing = sorted(n for n in named if n not in declared and n not in source)
    assert not missing, f"README.md names variables the code does not read: {missing}"
