"""The house's layout, as a newcomer finds it: no folder of rlmesh/ or services/ holds more than
MAX_MODULES modules; no import circle among the project's modules, counting the imports made only
for type hints or inside functions; every package's `__init__` docstring names each of its modules
and sub-packages in a line of its own (`- `name`: what it is for`) and names nothing else."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_TREES = ("rlmesh", "services")
MAX_MODULES = 15
"""Per folder, `__init__.py` included: past this a folder wants rooms of its own."""
ENTRY = re.compile(r"^- `(\w+)`:", re.MULTILINE)
"""A docstring line naming a module or sub-package: - `name`: what it is for."""


def folders() -> Iterator[Path]:
    for tree in SOURCE_TREES:
        yield ROOT / tree
        yield from (p for p in sorted((ROOT / tree).rglob("*")) if p.is_dir() and p.name != "__pycache__")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module of the source trees by its dotted name (a package by its own name)."""
    return {module_name(path): path for tree in SOURCE_TREES for path in sorted((ROOT / tree).rglob("*.py"))}


def owner(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` is, or is in (`a.b.f` for a function `f` of module `a.b`); None
    outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported_modules(path: Path, package: str, modules: dict[str, Path]) -> Iterator[str]:
    """The project modules `path` imports anywhere: at the top, under TYPE_CHECKING, inside functions.
    `from a import b` imports module `a.b` where there is one, else (a name of `a`) module `a`;
    relative imports are read against `package`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        yield from (target for name in names if (target := owner(name, modules)) is not None)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports. A module importing a package it is in is left out:
    Python runs that package's `__init__` before the module whatever the module imports."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {
            target
            for target in imported_modules(path, package, modules)
            if target != name and not name.startswith(f"{target}.")
        }
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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


def test_no_folder_holds_more_than_fifteen_modules():
    crowded = {
        str(folder.relative_to(ROOT)): count
        for folder in folders()
        if (count := len(list(folder.glob("*.py")))) > MAX_MODULES
    }
    assert crowded == {}, f"folders with more than {MAX_MODULES} modules (split them into rooms): {crowded}"


def test_no_import_circle_among_the_project_modules():
    found = circles(import_graph())
    assert found == [], "modules importing each other, type-only and function-level imports counted: " + "; ".join(
        " <-> ".join(component) for component in found
    )


def test_every_package_docstring_names_each_of_its_modules_and_nothing_else():
    wrong = {}
    for folder in folders():
        init = folder / "__init__.py"
        if not init.is_file():
            wrong[str(folder.relative_to(ROOT))] = "a folder of modules with no __init__.py"
            continue
        members = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
        members |= {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
        named = ENTRY.findall(ast.get_docstring(ast.parse(init.read_text())) or "")
        missing, unknown = sorted(members - set(named)), sorted(set(named) - members)
        twice = sorted({name for name in named if named.count(name) > 1})
        if missing or unknown or twice:
            wrong[str(init.relative_to(ROOT))] = {"not named": missing, "no such module": unknown, "twice": twice}
    assert wrong == {}, f"package docstrings out of step with their folders: {wrong}"
