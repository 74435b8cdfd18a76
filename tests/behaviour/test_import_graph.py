"""The package's imports run one way: no module reaches, directly or through others, back to
itself, counting imports inside functions too (a lazy import does not hide a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "schnet_ipu"


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


# The floor plan: three wings (feed, training, inference) over shared floors. Each rule names
# a part of the package and the parts it must never import, directly or lazily.
SHARED = {"batch", "checkpoint", "config", "config_schema", "errors", "files", "recipes"}
SHARED |= {"response", "task"}
WINGS = ("feed", "training", "inference")
RULES = {
    "inference": {"feed", "training", "bench"},
    "feed": {"training", "inference", "bench"},
    "training": {"bench"},
    "data": {"feed", "training", "inference", "model", "backends", "bench"},
    "packing": {"feed", "training", "inference", "model", "backends", "bench"},
    "model": {"feed", "training", "inference", "backends", "bench"},
    "backends": {"feed", "training", "inference", "bench"},
    "shared": {*WINGS, "bench"},
}
# The one door from the top level into a wing: users' scripts import the ASE calculator as
# ``schnet_ipu.calculator.SchNetCalculator``.
DOORS = {("calculator", "inference")}


def part_of(module: str) -> str:
    """The rule's part a dotted module belongs to: its folder, or "shared" for the top level."""
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in SHARED:
        return "shared"
    return parts[1] if len(parts) > 1 else "shared"


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    """Every import that crosses a rule, as 'module -> module'."""
    broken = []
    for name, imports in sorted(graph.items()):
        part = part_of(name)
        for target in sorted(imports):
            crossed = part_of(target)
            if crossed in RULES.get(part, set()) and (name.split(".")[-1], crossed) not in DOORS:
                broken.append(f"{name} -> {target}")
    return broken


def test_the_wings_and_floors_keep_their_rules():
    modules = module_files()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert {part_of(name) for name in graph} >= {*WINGS, "data", "model", "shared"}
    assert broken_rules(graph) == []


def test_the_top_level_holds_only_shared_modules():
    """Only the shared floors (and the calculator's door) sit at the package's top level."""
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == SHARED | {"calculator"}


def test_a_broken_rule_is_found():
    """The check itself: inference reaching into the feed, and the top level into a wing."""
    graph = {
        "schnet_ipu.inference.predictor": {"schnet_ipu.feed.loader", "schnet_ipu.config"},
        "schnet_ipu.checkpoint": {"schnet_ipu.training.log"},
        "schnet_ipu.calculator": {"schnet_ipu.inference.calculator"},
    }
    assert broken_rules(graph) == [
        "schnet_ipu.checkpoint -> schnet_ipu.training.log",
        "schnet_ipu.inference.predictor -> schnet_ipu.feed.loader",
    ]
