"""Derive the aten ops PopTorch can lower from its source, for the emulator's op check.

    python scripts/derive_poptorch_ops.py GIT_DIR [--tag sdk/poptorch/3.4.0] \
        > schnet_ipu/backends/poptorch_ops_3.4.0.txt

GIT_DIR is a clone of github:graphcore/poptorch (a bare one is enough: files are read with
``git show TAG:PATH``). Three lists are written, each one name a line under a ``[section]``:

* ``[handlers]``: ops with a canonicalisation handler, from every
  ``registerHandler(c10::aten::NAME, ...)`` in
  ``poptorch/source/popart_canonicalization/**/*.cpp``. A traced node of any other aten kind
  survives to ``errorOnUnsupportedAten`` (``poptorch/source/ErrorOnUnsupportedAten.cpp``),
  which raises "Unsupported ops found in compiled model".
* ``[dispatcher]``: ops PopTorch's dispatcher implements itself instead of tracing them as a
  node (``m.impl`` with a function other than ``poptorch::fallback`` in
  ``poptorch/source/dispatch_tracer/RegisterOptionalAtenOps.cpp.inc`` and
  ``RegisterAtenOverloads.cpp``), plus ``alias``, whose nodes
  ``poptorch/source/AliasProcessing.cpp`` removes.
* ``[ipu_key]``: every ``name[.overload]`` registered for the IPU / AutogradIPU dispatch keys
  in those two files. torch does not decompose these (a direct backend registration beats
  torch's composite kernels), so they reach PopTorch as themselves.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from datetime import datetime, timezone

CANONICALISATION = "poptorch/source/popart_canonicalization/"
DISPATCH_FILES = (
    "poptorch/source/dispatch_tracer/RegisterOptionalAtenOps.cpp.inc",
    "poptorch/source/dispatch_tracer/RegisterAtenOverloads.cpp",
)
HANDLER = re.compile(r"registerHandler\(\s*(?:c10::)?aten::(\w+)\s*,")
ATEN_BLOCK = re.compile(
    r"TORCH_LIBRARY_IMPL\(\s*aten\s*,\s*(?:Autograd)?IPU\s*,\s*m\s*\)\s*\{(.*?)\n\}", re.S
)
IMPL = re.compile(r'm\.impl\(\s*"([\w.]+)"\s*,\s*([^;]*?)\);', re.S)


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", git_dir, *args], check=True, capture_output=True, text=True
    ).stdout


def strip_comments(source: str) -> str:
    source = re.sub(r"/\*.*?\*/", "", source, flags=re.S)
    return re.sub(r"//[^\n]*", "", source)


def derive(git_dir: str, tag: str) -> dict[str, list[str]]:
    """The three sections (see the module docstring) for PopTorch at ``tag``."""
    files = git(git_dir, "ls-tree", "-r", "--name-only", tag, CANONICALISATION).split()
    handlers = set()
    for path in files:
        if path.endswith(".cpp"):
            handlers |= set(HANDLER.findall(strip_comments(git(git_dir, "show", f"{tag}:{path}"))))
    dispatcher, ipu_key = {"alias"}, set()
    for path in DISPATCH_FILES:
        source = strip_comments(git(git_dir, "show", f"{tag}:{path}"))
        for block in ATEN_BLOCK.findall(source):
            for name, kernel in IMPL.findall(block):
                ipu_key.add(name)
                if "poptorch::fallback" not in kernel:
                    dispatcher.add(name.split(".")[0])
    return {
        "handlers": sorted(handlers),
        "dispatcher": sorted(dispatcher),
        "ipu_key": sorted(ipu_key),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir", help="a clone of github:graphcore/poptorch")
    parser.add_argument("--tag", default="sdk/poptorch/3.4.0")
    args = parser.parse_args()
    commit, date = git(args.git_dir, "log", "-1", "--format=%H %cI", args.tag).split()
    sections = derive(args.git_dir, args.tag)
    print(
        f"# PopTorch aten op lists, derived by scripts/derive_poptorch_ops.py on "
        f"{datetime.now(timezone.utc):%Y-%m-%d}"
    )
    print("# repository: https://github.com/graphcore/poptorch")
    print(f"# tag: {args.tag}  commit: {commit}  committed: {date}")
    print(
        "# [handlers]: registerHandler(c10::aten::NAME, ...) in "
        "poptorch/source/popart_canonicalization/**/*.cpp"
    )
    print(
        "# [dispatcher]: ops the dispatch tracer implements itself (m.impl without "
        "poptorch::fallback), plus alias (AliasProcessing.cpp)"
    )
    print(
        "# [ipu_key]: name[.overload] registered for the aten IPU / AutogradIPU keys in "
        "RegisterOptionalAtenOps.cpp.inc and RegisterAtenOverloads.cpp"
    )
    for section, names in sections.items():
        print(f"[{section}]")
        print("\n".join(names))


if __name__ == "__main__":
    main()
