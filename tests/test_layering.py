"""The package's import graph: layers import downwards only, and no module import cycle.

The graph is read statically from every module's source (``ast``): ``import`` / ``from ... import``
statements anywhere in a module (function-level imports count: a lazy import is still a dependency) and
string constants naming one of our modules (``importlib.import_module("vllm_dsa_connector.x")``, the CLI's
command table, the plugin's hook table), so a dependency cannot hide behind ``importlib``.

The layer table is the architecture stated once (vllm_dsa_connector/README.md "Layers"): a module of a layer may import
its own layer and the layers below it, never one above. A new top-level module or subpackage must be
placed in the table: the test names it.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import vllm_dsa_connector

PACKAGE = "vllm_dsa_connector"
ROOT = Path(vllm_dsa_connector.__file__).parent

# Lowest first. Names are the first component under the package ("(root)" is vllm_dsa_connector/__init__).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("options", "compat"),                     # no project imports besides each other
    ("transport",),                            # NIXL, bounce, runs: no vLLM, nothing above
    ("layout",),                               # page tables (layout.build reads vLLM's specs)
    ("token_map", "pairing"),                  # the planner's token-position map (Bp != Bd); block pairing
                                               # by token position: both below matching (re-exported there)
    ("plan_segments",),                        # the plan over page tables: elected senders, segments,
                                               # exactly once (re-exported by matching)
    ("matching",),                             # the planner's per-request runs: layout + transport's run merging
    ("handoff",),                              # the vLLM-free core: protocol, producer/consumer state
    ("tiny_models",),
    ("tokenizer", "admission", "cpu_dsa", "kv_probe"),
    ("connector",),                            # vLLM's connector API -> the core
    ("fixes",),
    ("plugin",),
    ("pd_bodies",),                            # the proxy's pure body/merge rules (re-exported by pd_proxy)
    ("pd_proxy",),                             # the P/D proxy app (the harness launches it by module name)
    ("harness",),                              # server and two-process launchers (benches, tests)
    ("commands",),
    ("cli",),
    ("(root)",),                               # vllm_dsa_connector/__init__: the entry point, calls plugin
)
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
# Same-rank imports across different names are allowed only where listed (a -> b).
SIDEWAYS: frozenset[tuple[str, str]] = frozenset()


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith(PACKAGE + "."):
                targets = [node.value.split(":")[0].strip()]
            for target in targets:
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    resolved = resolve(target)
                    if resolved and resolved != name:
                        edges[name].add(resolved)
    return edges


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def test_every_top_level_name_has_a_layer() -> None:
    names = {_layer(m) for m in _modules()}
    missing = sorted(names - set(RANK))
    assert not missing, f"place these in tests/test_layering.py LAYERS: {missing}"


def test_layers_import_downwards_only() -> None:
    bad = []
    for src, targets in sorted(_graph().items()):
        a = _layer(src)
        for dst in sorted(targets):
            b = _layer(dst)
            if a == b or a not in RANK or b not in RANK:
                continue
            if RANK[b] > RANK[a] or (RANK[b] == RANK[a] and (a, b) not in SIDEWAYS):
                bad.append(f"{src} ({a}, layer {RANK[a]}) imports {dst} ({b}, layer {RANK[b]})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(set(edges) | {t for ts in edges.values() for t in ts}):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles() -> None:
    """A package ``__init__`` that re-exports its submodules is not a cycle by itself: the edge from a
    submodule to its own package ``__init__`` (``from .x import y`` resolves through it) is left out."""
    edges = {src: {t for t in ts if not src.startswith(t + ".")} for src, ts in _graph().items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_lazy_and_string_imports(tmp_path: Path) -> None:
    """The graph reader itself: a function-level import and an importlib string are edges."""
    src = ("import importlib\n"
           "def f():\n    from vllm_dsa_connector.core.transfer import runs\n"
           "MOD = importlib.import_module('vllm_dsa_connector.core.plan')\n")
    tree = ast.parse(src)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and isinstance(n.value, str) and n.value.startswith(PACKAGE + ".")]
    assert imports and imports[0].module == "vllm_dsa_connector.core.transfer"
    assert strings == ["vllm_dsa_connector.core.plan"]
    cyc = _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cyc == [["a", "b", "c"]]


def test_no_private_name_is_imported_across_modules() -> None:
    """A name that starts with ``_`` belongs to its module: no other module of the package imports it
    (``from x import _y``) or reaches for it (``x._y`` on an imported module). What another module needs is
    public, with a docstring, or it stays where it is used."""
    bad = []
    mods = _modules()
    for name, path in sorted(mods.items()):
        tree = ast.parse(path.read_text(), str(path))
        imported_modules: dict[str, str] = {}  # local alias -> our module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in mods:
                        imported_modules[alias.asname or alias.name] = full
                    elif alias.name.startswith("_") and not alias.name.startswith("__"):
                        bad.append(f"{name} imports {alias.name} from {node.module}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PACKAGE + ".") and alias.asname:
                        imported_modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in imported_modules and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                bad.append(f"{name} uses {imported_modules[node.value.id]}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(sorted(set(bad)))
