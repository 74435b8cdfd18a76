"""Check that the whole package, and what an IPU user runs beside it, needs no Python newer
than 3.8 (the Poplar SDK's).

    python scripts/check_py38.py          # vermin's verdict; exit 1 if anything needs > 3.8
    python scripts/check_py38.py --list   # only the files checked

The files are every module of the package (``schnet_ipu/``, bench/ included, whether or not
the IPU path imports it), every script under ``scripts/``, ``train.py``, the IPU test files
(``IPU_TEST_FILES``) and the first-party modules those import (every ``import`` / ``from``
statement counts, including those inside functions). The test helpers those files import
(``test_backend``...) are not first-party modules here: that they collect on Python 3.8 is
checked by really collecting them there (``scripts/check_torch201.sh``). ``vermin -t=3.8-``
checks them without evaluating annotations (it flags ``zip(strict=True)``, 3.10, and the
like): the code uses ``from __future__ import annotations``, so ``list[int]`` or
``X | None`` in an annotation is a string that Python 3.8 never evaluates. Outside
annotations they are evaluated, and vermin misses them in plain assignments
(``Pair = tuple[int, int]``, ``Slot = int | None``), so a second pass flags subscripted
builtins and ``collections.abc`` classes (3.9+) and ``|`` between types (3.10+) there. What
neither can see (annotations resolved at runtime, torch 2.0.1 APIs) is exercised on
Python 3.8 by ``scripts/check_torch201.sh``.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IPU_TEST_FILES = (
    "tests/backends/test_poptorch.py",
    "tests/backends/test_poptorch_ops.py",
    "tests/backends/test_ipu_emulator.py",
)
PACKAGE = "schnet_ipu"


def entry_points() -> list[Path]:
    """The package's modules, the scripts, ``train.py`` and the IPU test files."""
    package = sorted((ROOT / PACKAGE).rglob("*.py"))
    scripts = sorted((ROOT / "scripts").glob("*.py"))
    return [*package, *scripts, ROOT / "train.py", *(ROOT / test for test in IPU_TEST_FILES)]


def module_file(name: str) -> Path | None:
    """The file of first-party module ``name`` (``schnet_ipu.x.y``), or None."""
    base = ROOT / Path(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path) -> set[str]:
    """First-party modules ``path`` imports anywhere in its body (and their packages)."""
    names = set()
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    closure = set()
    for name in names:
        if name.split(".")[0] != PACKAGE:
            continue
        parts = name.split(".")
        closure |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {name for name in closure if module_file(name) is not None}


def import_closure() -> list[Path]:
    """Files of the entry points and every first-party module they reach."""
    files = set(entry_points())
    todo = list(files)
    while todo:
        for name in imported_modules(todo.pop()):
            path = module_file(name)
            if path not in files:
                files.add(path)
                todo.append(path)
    return sorted(files)


GENERIC_BUILTINS = {"list", "tuple", "dict", "set", "frozenset", "type"}
TYPE_NAMES = GENERIC_BUILTINS | {"int", "float", "str", "bytes", "bool", "complex"}


def runtime_generics(path: Path) -> list[str]:
    """``file:line: what`` for each generic alias outside annotations that Python 3.8 rejects:
    ``list[int]`` / ``collections.abc.Callable[...]`` (3.9) and ``int | None`` (3.10)."""
    tree = ast.parse(path.read_text(), str(path))
    abc_names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "collections.abc"
        for alias in node.names
    }
    annotations = set()
    for node in ast.walk(tree):
        for child in (getattr(node, "annotation", None), getattr(node, "returns", None)):
            if child is not None:
                annotations |= {id(sub) for sub in ast.walk(child)}

    def is_type(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value is None
        if isinstance(node, ast.Subscript):
            node = node.value
        return isinstance(node, ast.Name) and node.id in TYPE_NAMES | abc_names

    found = []
    for node in ast.walk(tree):
        if id(node) in annotations:
            continue
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in GENERIC_BUILTINS | abc_names
        ):
            found.append(f"{where}: {node.value.id}[...] at runtime needs Python 3.9")
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.BitOr)
            and (is_type(node.left) and is_type(node.right))
        ):
            found.append(f"{where}: X | Y of types at runtime needs Python 3.10")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the modules and stop")
    args = parser.parse_args()
    files = [str(path.relative_to(ROOT)) for path in import_closure()]
    if args.list:
        print("\n".join(files))
        return 0
    vermin = shutil.which("vermin") or str(Path(sys.executable).with_name("vermin"))
    command = [vermin, "-t=3.8-", "--no-tips", "--violations", *files]
    print(f"vermin over {len(files)} files: the package, scripts, train.py, IPU tests", flush=True)
    status = subprocess.run(command, cwd=ROOT).returncode
    found = [line for path in import_closure() for line in runtime_generics(path)]
    print("\n".join(found) or "no runtime generic aliases newer than Python 3.8")
    return status or int(bool(found))


if __name__ == "__main__":
    sys.exit(main())
