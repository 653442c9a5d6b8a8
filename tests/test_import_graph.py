"""sdp_cli's import graph has no cycle, between modules or between packages.

Every import counts, wherever it is written: at the top of a module, inside a function (a lazy
import is still a dependency) or under ``TYPE_CHECKING``. A package is a directory of sdp_cli
(``sdp_cli.engine``); a module directly in ``sdp_cli/`` is its own node.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sdp_cli

ROOT = Path(sdp_cli.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The sdp_cli modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            # the longest known module the import names (`a.b.C` names module `a.b`)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _edges_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    members = set(component)
    return [f"{a} → {b}" for a in component for b in sorted(graph[a] & members)]


def test_the_graph_sees_the_imports_it_should():
    graph = _graph()
    # a top-level, a relative-free `from pkg import module`, and a lazy import in a function
    assert "sdp_cli.errors" in graph["sdp_cli.config.compose"]
    assert "sdp_cli.train.session.run" in graph["sdp_cli.cli.train"]
    assert "sdp_cli.cli.train" in graph["sdp_cli.cli.main"]


def test_no_module_import_cycle():
    graph = _graph()
    problems = [" ; ".join(_edges_within(graph, c)) for c in _cycles(graph)]
    assert not problems, "import cycles between modules:\n" + "\n".join(problems)


def test_no_package_import_cycle():
    modules = _graph()
    packages: dict[str, set[str]] = {}
    for module, targets in modules.items():
        deps = packages.setdefault(_package(module), set())
        deps.update(_package(t) for t in targets if _package(t) != _package(module))
    problems = []
    for component in _cycles(packages):
        members = set(component)
        via = [
            f"{m} → {t}"
            for m, targets in sorted(modules.items())
            if _package(m) in members
            for t in sorted(targets)
            if _package(t) in members and _package(t) != _package(m)
        ]
        problems.append(f"{' ↔ '.join(component)} (via {'; '.join(via)})")
    assert not problems, "import cycles between packages:\n" + "\n".join(problems)


#: packages split into wings, lowest first: a module of a wing imports no module of a wing above
#: it (docs/design.md §7); a module of the package outside every wing may not be imported by one
WINGS = {"sdp_cli.train": ("step", "asyncloop", "session")}


def _wing(module: str, package: str, wings: tuple[str, ...]) -> int | None:
    """The rank of the wing ``module`` lies in, len(wings) for the rest of ``package``, or None."""
    if module != package and not module.startswith(package + "."):
        return None
    part = module[len(package) + 1 :].split(".")[0]
    return wings.index(part) if part in wings else len(wings)


def test_wings_import_only_downward():
    graph = _graph()
    upward = [
        f"{module} → {target}"
        for package, wings in WINGS.items()
        for module, targets in sorted(graph.items())
        if (rank := _wing(module, package, wings)) is not None
        for target in sorted(targets)
        if (other := _wing(target, package, wings)) is not None and other > rank
    ]
    assert not upward, "imports from a lower wing to a higher one:\n" + "\n".join(upward)


def test_every_wing_has_modules():
    modules = set(_graph())
    missing = [f"{p}.{w}" for p, wings in WINGS.items() for w in wings if not any(m.startswith(f"{p}.{w}.") for m in modules)]
    assert not missing, f"wings with no module: {missing}"
