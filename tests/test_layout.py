"""The code's layout holds: no import cycles between edgelin's modules (function-level imports count; imports only
for type checkers do not), no module over 600 lines, one module per layer kind, and the CLI kept out of the library."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"edgelin": ROOT / "edgelin", "edgelin.exporters": ROOT / "exporters", "edgelin.runtime": ROOT / "runtime",
            "edgelin.models": ROOT / "models"}
MAX_LINES = 600


def modules() -> dict[str, Path]:
    found = {}
    for prefix, folder in PACKAGES.items():
        for file in folder.rglob("*.py"):
            parts = [p for p in file.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([prefix, *parts])] = file
    return found


def _runtime_imports(tree: ast.AST):
    """Import statements that run: those under ``if TYPE_CHECKING:`` are skipped."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, file in mods.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [resolve(f"{base}.{a.name}") or resolve(base) for a in node.names]
            graph[name].update(t for t in targets if t and t != name and not name.startswith(t + "."))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_module_over_600_lines():
    long = {name: n for name, file in modules().items() if (n := len(file.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"split these by concept: {long}"


def test_the_library_never_imports_the_cli():
    graph = import_graph()
    offenders = {m: sorted(t for t in targets if t.startswith("edgelin.cli")) for m, targets in graph.items()
                 if not m.startswith("edgelin.cli") and any(t.startswith("edgelin.cli") for t in targets)}
    assert not offenders


def test_each_layer_kind_has_its_module_and_no_importer_imports_another():
    import importlib

    from edgelin.importers import catalog
    from edgelin.layers import MIXERS

    family_modules = {family.module for family in catalog.FAMILIES}
    for module in family_modules:
        importlib.import_module(module)
    for kind, cls in MIXERS.items():
        assert cls.__module__.startswith("edgelin.layers."), f"layer kind {kind!r} lives in {cls.__module__}, not edgelin/layers/"
    graph = import_graph()
    for module in family_modules:
        others = sorted(graph[module] & (family_modules - {module}))
        assert not others, f"the importer {module} imports another family's importer: {others}"
