"""The package's import graph: layers import downwards only, and no module import cycle.

The graph is read statically from every module's source (``ast``): ``import`` / ``from ... import``
statements anywhere in a module (function-level imports count: a lazy import is still a dependency) and
string constants naming one of our modules (``importlib.import_module("vllm_dsa_connector.x")``, the CLI's
command table, the plugin's hook table), so a dependency cannot hide behind ``importlib``.

The layer table is the architecture stated once (docs/architecture.md "Module map", vllm_dsa_connector/README.md "Layers"): a module of a layer may import
its own layer and the layers below it, never one above. A new top-level module or subpackage must be
placed in the table: the test names it.
"""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import vllm_dsa_connector

PACKAGE = "vllm_dsa_connector"
ROOT = Path(vllm_dsa_connector.__file__).parent

# Lowest first. Names are the first component under the package, and under ``core`` the first two ("core.plan";
# "(root)" is vllm_dsa_connector/__init__). The dev package (dev/vllm_dsa_dev, not in the wheel) sits above all of
# them: it may import anything of the wheel, the wheel never imports it (test_the_wheel_never_imports_dev).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("options", "compat"),                     # no project imports besides each other
    ("core.plan",),                            # what moves: pages, rules, runs, token map, pairing, segments, peer plan
    ("core.transfer",),                        # how bytes move: routed sends, receiver, NIXL (nixl/), copies (copy/)
    ("core.handoff",),                         # who may write where and when: protocol, producer/consumer state
    ("core.worker",),                          # a worker's send side (P) and receive side (D), their counters
    ("core",),                                 # core/__init__ (engine-free: tests/test_core_isolation.py)
    ("tokenizer", "admission", "cpu_dsa"),
    ("connector",),                            # vLLM's connector API -> the core (+ page tables from vLLM specs)
    ("fixes",),
    ("plugin",),
    ("proxy",),                                # the P/D proxy app and its pure body/merge rules
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
    if len(parts) > 2 and parts[1] == "core":
        return "core." + parts[2]
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
           "def f():\n    from vllm_dsa_connector.core.plan import runs\n"
           "MOD = importlib.import_module('vllm_dsa_connector.core.plan')\n")
    tree = ast.parse(src)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and isinstance(n.value, str) and n.value.startswith(PACKAGE + ".")]
    assert imports and imports[0].module == "vllm_dsa_connector.core.plan"
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


DEV = "vllm_dsa_dev"
#: The soft limit: a module that grows past it is split inside its concept's folder (no re-export shim).
SOFT_LIMIT_LINES = 600
#: Over this a module fails the test (the soft limit leaves room for a concept that reads best in one file).
HARD_LIMIT_LINES = 700


def test_the_wheel_never_imports_dev() -> None:
    """Nothing of the wheel names the dev package: no import, no module string (an optional import would still make
    a deployment depend on what the wheel does not ship). The CLI finds dev's commands through an entry point."""
    bad = []
    for name, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                targets = [node.value.strip()]
            bad += [f"{name}: {t}" for t in targets if t == DEV or t.startswith(DEV + ".")]
    assert not bad, "the wheel imports the dev package:\n" + "\n".join(bad)


def _reexports(path: Path) -> list[str]:
    """Names a module imports from the package and hands on without using them itself (``__all__`` or nothing)."""
    tree = ast.parse(path.read_text(), str(path))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    strings = " ".join(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                       and not any(isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                                     for t in s.targets) for s in tree.body
                                   if n in ast.walk(s)))
    out = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
            for a in node.names:
                local = a.asname or a.name
                if local not in used and f"{node.module}.{a.name}" not in _modules() \
                        and not re.search(rf"\b{re.escape(local)}\b", strings):
                    out.append(f"{local} (from {node.module})")
    return out


#: Package faces outside code reaches by name: vLLM's factory loads ``vllm_dsa_connector.connector:DSAConnector``
#: (plugin.py), users pass ``--scheduler-cls vllm_dsa_connector.admission.DSAScheduler`` and the tokenizer cache's
#: classes. Nothing inside the package imports through them.
PUBLIC_FACES = {"vllm_dsa_connector.connector", "vllm_dsa_connector.admission", "vllm_dsa_connector.tokenizer"}
#: Modules that name a face for outside code, not to import through it: the plugin hands vLLM's factory the module.
NAMES_A_FACE = {("vllm_dsa_connector.plugin", "vllm_dsa_connector.connector")}


def test_no_reexport_shims_and_modules_stay_readable() -> None:
    """No module of the wheel re-exports what another defines (importers import the real module), nothing imports
    through a public face, and no module grows past the limit (split near SOFT_LIMIT_LINES, inside its folder)."""
    mods = _modules()
    shims = {name: r for name, path in sorted(mods.items()) if name not in PUBLIC_FACES and (r := _reexports(path))}
    assert not shims, f"re-export shims: {shims}"
    through = sorted(f"{src} -> {dst}" for src, ts in _graph().items() for dst in ts if dst in PUBLIC_FACES
                     and not src.startswith(dst + ".") and (src, dst) not in NAMES_A_FACE)
    assert not through, "imports through a public face (import the real module):\n" + "\n".join(through)
    long = {name: n for name, path in mods.items() if (n := len(path.read_text().splitlines())) > HARD_LIMIT_LINES}
    assert not long, f"modules over {HARD_LIMIT_LINES} lines (split near {SOFT_LIMIT_LINES}, in the folder): {long}"
