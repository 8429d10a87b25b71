"""No import cycles between the modules of the `nats` package, and layers that only point down: no module of the
library imports an entry point (the module of a console script: `nats.train`, `nats.eval`, `nats.eval_hf`, ...).

Static: every module under ``nats/`` is parsed with ``ast`` and each ``import`` / ``from ... import`` naming a nats
module becomes an edge, wherever it stands (module level or inside a function: a deferred import is still a cycle,
only one that Python happens to tolerate). Imports under ``if TYPE_CHECKING:`` never run and are left out, and so is
the implicit import of a module's parent package. ``from nats.a import b`` is an edge to ``nats.a.b`` when that is a
module, else to ``nats.a``. A failure prints every cycle, with the import lines that make it.

The entry points are the modules that pyproject.toml's ``[project.scripts]`` name: each instantiates and wires what
the library offers, and nothing imports them (a function the library needs from one belongs in the library, e.g.
`nats.evaluation` under `nats.eval`). Scripts, tests and notebooks outside the package may import them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGE = "nats"


def module_files(root: Path = REPO / PACKAGE) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module under ``root`` (a package's ``__init__.py`` is the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` blocks (imports there never run)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of dotted ``name`` that is a module of the package (None: not a nats module)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(files: dict[str, Path], base: Path = REPO) -> dict[str, dict[str, list[str]]]:
    """``{module: {imported nats module: ["file:line", ...]}}`` (files named relative to ``base``)."""
    modules = set(files)
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        skip = _type_checking_lines(tree)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    source = ".".join(package + ([source] if source else []))
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    targets.append(full if full in modules else source)
            where = f"{path.relative_to(base)}:{node.lineno}"
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != module:
                    lines = graph[module].setdefault(resolved, [])
                    if where not in lines:
                        lines.append(where)
    for edges in graph.values():
        for lines in edges.values():
            lines.sort(key=lambda w: int(w.rsplit(":", 1)[1]))
    return graph


def find_cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # recursion depth: the package's module count at most
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for component in components:  # a shortest path back to the component's first module, found breadth-first
        members = set(component)
        start = component[0]
        parent: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        found = v
                        break
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v != start:
            path.append(v)
            v = parent[v]
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def describe(cycle: list[str], graph: dict[str, dict[str, list[str]]]) -> str:
    hops = [f"  {a} -> {b}  ({', '.join(graph[a][b])})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n" + "\n".join(hops)


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "nats"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from nats.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nats.sub.c import X\nfrom . import a\n"
    )
    (pkg / "sub" / "c.py").write_text("import nats.sub.b\n")
    graph = import_graph(module_files(pkg), base=tmp_path)
    assert set(graph["nats.sub"]) == {"nats.sub.a"}
    assert set(graph["nats.sub.a"]) == {"nats.sub.b"}
    assert set(graph["nats.sub.b"]) == {"nats.sub.a"}  # the TYPE_CHECKING import is left out
    assert set(graph["nats.sub.c"]) == {"nats.sub.b"}
    assert find_cycles(graph) == [["nats.sub.a", "nats.sub.b", "nats.sub.a"]]


def test_no_import_cycles_in_nats():
    graph = import_graph(module_files())
    assert len(graph) > 50 and "nats.hf.attention" in graph  # the walk found the package
    cycles = find_cycles(graph)
    report = "\n".join(describe(c, graph) for c in cycles)
    if report:
        print(f"import cycles in nats/:\n{report}")
    assert not cycles, f"import cycles in nats/ (an import inside a function counts too):\n{report}"


def entry_points(pyproject: Path = REPO / "pyproject.toml") -> set[str]:
    """The modules of the console scripts of ``[project.scripts]`` (``nats-eval-hf = "nats.eval_hf:main"``)."""
    text = pyproject.read_text(encoding="utf-8")
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [project.scripts]"
    return set(re.findall(r'^[\w-]+\s*=\s*"([\w.]+):\w+"', section.group(1), re.M))


def layer_violations(graph: dict[str, dict[str, list[str]]], entries: set[str]) -> list[str]:
    """``"a -> b  (file:line, ...)"`` for every import of an entry point `b` by a module `a` (an entry point
    included: they import the library, not each other)."""
    return [
        f"{module} -> {target}  ({', '.join(lines)})"
        for module in sorted(graph)
        for target, lines in sorted(graph[module].items())
        if target in entries
    ]


def test_the_layer_rule_sees_entry_points_and_function_level_imports(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\nx-run = "nats.run:main"\n\n[tool.other]\ny = 1\n')
    pkg = tmp_path / "nats"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "run.py").write_text("from nats import lib\n")
    (pkg / "lib.py").write_text("def f():\n    from nats.run import main\n")
    entries = entry_points(tmp_path / "pyproject.toml")
    assert entries == {"nats.run"}
    graph = import_graph(module_files(pkg), base=tmp_path)
    assert layer_violations(graph, entries) == ["nats.lib -> nats.run  (nats/lib.py:2)"]


def test_no_module_imports_an_entry_point():
    """Layers point down: entry points import the library; no module of nats imports an entry point, not even
    inside a function."""
    entries = entry_points()
    assert {"nats.train", "nats.eval", "nats.eval_hf", "nats.generate", "nats.prepare"} <= entries
    graph = import_graph(module_files())
    assert entries <= set(graph), f"pyproject.toml names entry points that are not modules: {entries - set(graph)}"
    bad = layer_violations(graph, entries)
    assert not bad, "modules of nats import an entry point (move what they need into the library):\n" + "\n".join(bad)
