"""The option list of docs/configuration.md is the code's: generated from the settings classes and checked here;
every ``VLLM_DSA_*`` variable the README and docs/ name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_dsa_connector.commands.options import markdown, sections
from vllm_dsa_connector.options import all_options

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
OPTIONS = DOC.read_text()
#: The user documents: the README and docs/ (every variable they name must exist)
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
BEGIN = re.compile(r"<!-- options:begin[^>]*-->\n")
END = "<!-- options:end -->"


def _block() -> str:
    m = BEGIN.search(OPTIONS)
    assert m and END in OPTIONS, "docs/configuration.md lost its <!-- options:begin/end --> markers"
    return OPTIONS[m.end():OPTIONS.index(END)]


def test_option_tables_are_generated_from_the_code() -> None:
    """Every option (key, env, default, meaning) in the code is in docs/configuration.md, and nothing else is."""
    assert _block() == markdown(), (
        "docs/configuration.md options are stale: paste `vllm-dsa options --markdown` between the markers")


def test_every_declared_option_row_is_in_the_docs() -> None:
    """The same, option by option (a readable failure naming the option)."""
    block = _block()
    rows = {line.split("|")[2].strip().strip("`") for line in block.splitlines() if line.startswith("| ")}
    for _, settings_cls in sections():
        for o in all_options(settings_cls):
            assert o.env in rows, f"{o.key} ({o.env}) missing from docs/configuration.md's options"
            key = "(environment only)" if o.env_only else f"`{o.key}`"
            assert f"| {key} | `{o.env}` |" in block, o.key


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_documented_env_variable_exists_in_the_code(doc: str) -> None:
    """A ``VLLM_DSA_*`` name in the README or docs/ is declared by an option or read by the package's code
    (or, for the CI's own switches, by ``tests/conftest.py`` and ``ci/``)."""
    declared = {o.env for _, cls in sections() for o in all_options(cls)}
    readers = [*(ROOT / "vllm_dsa_connector").rglob("*.py"), ROOT / "tests" / "conftest.py", *(ROOT / "ci").glob("*.sh")]
    source = "\n".join(p.read_text() for p in readers)
    named = set(re.findall(r"VLLM_DSA_[A-Z0-9_]*[A-Z0-9]", DOCS[doc]))  # families like VLLM_DSA_TOKCACHE_{..}
    missing = sorted(n for n in named if n not in declared and n not in source)
    assert not missing, f"{doc} names variables the code does not read: {missing}"
