"""Every command the README shows works as written: each ``vllm-dsa`` and ``python -m vllm_dsa_connector...``
invocation of its fenced shell blocks parses (a dry run of the argument parser, nothing started), the
scripts and extras it names exist, its ``--kv-transfer-config`` JSON passes the connector's option
validation, and every relative link of the README and docs/ reaches an existing file and heading."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from vllm_dsa_connector.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "vllm_dsa_connector" / "README.md"]


def shell_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined (and lines inside an open quote),
    comment-only and blank lines dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        pending = ""
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            pending = f"{pending}\n{line}" if pending else line.strip()
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on on the next line
                continue
            if words:
                commands.append(pending)
            pending = ""
        assert not pending, f"unclosed quote in a README command: {pending}"
    return commands


def _argv(command: str) -> list[str]:
    """The words of ``command`` before a trailing comment, without leading ``VAR=value`` assignments."""
    words = shlex.split(command, comments=True)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    return words


COMMANDS = shell_commands(README)


def _ours(kind: str) -> list[str]:
    out = []
    for c in COMMANDS:
        words = _argv(c)
        if kind == "cli" and words and Path(words[0]).name == "vllm-dsa":
            out.append(c)
        elif kind == "module" and words[:2] == ["python", "-m"] and words[2].startswith("vllm_dsa_connector"):
            out.append(c)
    return out


def test_the_readme_shows_the_ci_commands() -> None:
    """``.ci/run`` runs the README's set-up and test commands: they must be there as CI runs them."""
    assert "bash ci/setup.sh" in COMMANDS and "bash ci/test.sh" in COMMANDS
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash ci/setup.sh" in ci and "bash ci/test.sh" in ci
    assert _ours("cli") and _ours("module"), "the README lost its vllm-dsa / python -m commands"


@pytest.mark.parametrize("command", _ours("cli"))
def test_vllm_dsa_commands_parse(command: str) -> None:
    words = _argv(command)
    args = build_parser().parse_args(words[1:])  # SystemExit (exit code 2) on a wrong command or option
    assert args._module.startswith(("vllm_dsa_connector.commands.", "vllm_dsa_dev.commands.")), command


@pytest.mark.parametrize("command", _ours("module"))
def test_module_commands_parse(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    words = _argv(command)
    module = words[2]
    if module == "vllm_dsa_connector.cli":
        build_parser().parse_args(words[3:])
    elif module == "vllm_dsa_connector.proxy.app":
        import uvicorn

        from vllm_dsa_connector.proxy import app as pd_proxy

        served: list[dict[str, object]] = []
        monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw))
        pd_proxy.main(words[3:])  # parses, builds the app, "serves" it (nothing listens)
        assert served and served[0]["port"] > 0, command
    else:
        pytest.fail(f"no dry run for {module}: add one here ({command})")


def test_scripts_and_extras_exist() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for command in COMMANDS:
        words = _argv(command)
        if words[:1] == ["bash"]:
            assert (ROOT / words[1]).is_file(), command
        if words[:2] == ["pip", "install"]:
            for spec in words[2:]:
                m = re.match(r"^vllm-dsa-connector\[([\w,]+)\]$", spec)
                if m:
                    assert set(m[1].split(",")) <= set(extras), command


def test_kv_transfer_configs_validate() -> None:
    """The README's ``--kv-transfer-config`` JSON parses and its DSAConnector options pass validation."""
    from vllm_dsa_connector.connector.options import ConnectorOptions

    configs = [json.loads(_argv(c)[_argv(c).index("--kv-transfer-config") + 1])
               for c in COMMANDS if "--kv-transfer-config" in c]
    assert {c["kv_role"] for c in configs} >= {"kv_producer", "kv_consumer"}
    assert "VLLM_DSA_AUTH_SECRET" in README  # the README gives both engines the secret: with it
    for cfg in configs:
        assert cfg["kv_connector"] == "DSAConnector"
        ConnectorOptions.from_config(cfg.get("kv_connector_extra_config", {}),
                                     environ={"VLLM_DSA_AUTH_SECRET": "the-readmes-secret-0123"})


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(target)
    assert not broken, f"{doc.name}: links to missing files or headings: {broken}"


def test_router_commands_use_its_options() -> None:
    """The README's vllm-router command uses options the installed vllm-router has (the `[router]` extra)."""
    exe = shutil.which("vllm-router") or shutil.which(str(Path(sys.executable).parent / "vllm-router"))
    if exe is None:
        pytest.skip("vllm-router is not installed (the [router] or [test] extra)")
    usage = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60).stdout
    routers = [_argv(c) for c in COMMANDS if _argv(c)[:1] == ["vllm-router"]]
    assert routers, "the README lost its vllm-router command"
    for words in routers:
        for flag in (w for w in words if w.startswith("--")):
            assert re.search(rf"\[{re.escape(flag)}[\] ]", usage), f"vllm-router has no {flag}"
