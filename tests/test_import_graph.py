"""No import cycle among ``unirl_pl``'s modules, counting imports inside functions too.

A late import (inside a function) hides a cycle from Python until that function runs: ``export`` used to
import the CLI in its ``main`` while the CLI, through the callbacks package, imported ``export``. The
graph here has an edge for every ``import``/``from ... import`` anywhere in a module's source, at module
level or not, and follows Python's rule that importing ``a.b.c`` first runs ``a/__init__.py`` and
``a/b/__init__.py``: so ``cli -> unirl_pl.callbacks.run_checkpoint`` is also ``cli -> unirl_pl.callbacks``,
whose ``__init__`` imports every callback module. A module's own enclosing packages are not edges (Python has
already started them before the module runs). Imports under ``if TYPE_CHECKING:`` never run, so they are not
edges.
"""

from __future__ import annotations

import ast
from collections.abc import Set
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "unirl_pl"

# Cycles accepted on purpose, each as its sorted module names, with the reason. Empty: there are none.
ALLOWED_CYCLES: set[tuple[str, ...]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of import nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name ``path`` imports (``from m import x`` gives ``m`` and ``m.x``: ``x`` may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_only(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules importing it runs (the named module and every package above it)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for imported in imported_names(path, name):
            parts = imported.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                # The module itself and its own enclosing packages are already running when it imports.
                if target in modules and target != name and not name.startswith(target + "."):
                    targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]], allowed: Set[tuple[str, ...]] = frozenset()) -> list[str] | None:
    """A cycle as a path ``[a, b, ..., a]`` by depth-first search, or None; cycles in ``allowed`` are skipped."""
    done: set[str] = set()

    def visit(node: str, path: list[str], on_path: set[str]) -> list[str] | None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                cycle = path[path.index(nxt) :] + [nxt]
                if tuple(sorted(set(cycle))) not in allowed:
                    return cycle
                continue
            if nxt in done:
                continue
            found = visit(nxt, [*path, nxt], on_path | {nxt})
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start, [start], {start})
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    # The graph is the real one: the CLI reaches the callbacks package (and so every callback module).
    assert "unirl_pl.callbacks" in graph["unirl_pl.cli"]
    assert "unirl_pl.cli" in graph["unirl_pl.export"], "export builds its module through the CLI"
    cycle = find_cycle(graph, ALLOWED_CYCLES)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_search_reports_a_cycle_through_late_imports_and_packages(tmp_path):
    # The shape of the cycle this test was written for, as a graph: a late import in `export` closes it.
    graph = {
        "p.cli": {"p.callbacks"},
        "p.callbacks": {"p.callbacks.export"},
        "p.callbacks.export": {"p.export"},
        "p.export": {"p.cli"},
    }
    assert find_cycle(graph) == ["p.callbacks", "p.callbacks.export", "p.export", "p.cli", "p.callbacks"]
    assert find_cycle({**graph, "p.export": set()}) is None
    assert find_cycle(graph, {("p.callbacks", "p.callbacks.export", "p.cli", "p.export")}) is None
    # A late import is an edge, and so is the package a submodule import runs first.
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n    from q.sub.mod import thing\n")
    assert {"q.sub.mod", "q.sub.mod.thing"} <= imported_names(pkg / "m.py", "p.m")


def test_the_method_does_not_import_the_callbacks():
    # The layers point one way: the callbacks (gates) read the method, never the reverse. The hook the update
    # calls (`on_policy_logprobs`) lives in `unirl_pl.method.hooks`, below both. Late imports count too; only
    # `if TYPE_CHECKING:` imports (which never run) are allowed.
    method = PACKAGE / "method"
    back_arrows = sorted(
        f"{module_name(path)} imports {imported}"
        for path in method.rglob("*.py")
        for imported in imported_names(path, module_name(path))
        if imported == "unirl_pl.callbacks" or imported.startswith("unirl_pl.callbacks.")
    )
    assert back_arrows == [], "the method must not know the callbacks: " + "; ".join(back_arrows)
    # The graph agrees (packages run first: importing `unirl_pl.callbacks.x` is an edge to `unirl_pl.callbacks`).
    graph = import_graph()
    for name, targets in graph.items():
        if name == "unirl_pl.method" or name.startswith("unirl_pl.method."):
            assert not {t for t in targets if t.split(".")[:2] == ["unirl_pl", "callbacks"]}, name
