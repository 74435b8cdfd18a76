"""The package's imports run one way: no module reaches, directly or through others, back to
itself, counting imports inside functions too (a lazy import does not hide a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "schnet_ipu"


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages by __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: the package, less level - 1 folders
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from a import b``: the submodule a.b where there is one, else a itself
            targets += [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    order, lowest, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        order[node] = lowest[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in order:
                visit(other)
                lowest[node] = min(lowest[node], lowest[other])
            elif other in on_stack:
                lowest[node] = min(lowest[node], order[other])
        if lowest[node] == order[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return groups


def test_the_package_imports_have_no_circle():
    modules = module_files()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the graph was read
    assert circles(graph) == []


def test_a_circle_is_found():
    """The check itself: a lazy import back up a chain is a circle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
