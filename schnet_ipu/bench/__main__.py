"""``python -m schnet_ipu.bench SUITE [--quick] [--json PATH] [--out-dir DIR] [--store PATH]``.

Each suite's module docstring says what it measures. Suite options (another suite refuses them;
they override ``--quick``'s reduced settings): ``--device`` (gpu, force_step), ``--subset N``
(gpu, accuracy), ``--molecules-per-step N`` and ``--profile`` (gpu), ``--minutes M`` (accuracy,
forces), ``--ours-only`` and ``--run-dir DIR`` (accuracy), ``--set section.key=value`` (gpu,
accuracy, forces, force_step, hosts), ``--config C`` (forces, force_step, hosts),
``--parallel N`` and ``--peer schnetpack|mace|both`` (forces), ``--variant`` (forces:
``'NAME: key=value ...'``; gpu and force_step: a name of the module's ``VARIANTS``). Each
writes ``SUITE.json``, ``.md`` and ``.png`` in ``--out-dir``.

``python -m schnet_ipu.bench table [--check]`` rewrites (or checks) the headline table of
docs/benchmarks/README.md from the committed reports (:mod:`schnet_ipu.bench.table`)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import shlex
import sys

from schnet_ipu.bench import table
from schnet_ipu.bench.common import QM9_STORE, write_report
from schnet_ipu.errors import run_cli

SUITES = ("throughput", "batching", "loader", "model", "gpu", "dense", "balance", "calculator",
          "accuracy", "forces", "force_step", "periodic", "hosts")  # fmt: skip
# suite option -> (the keyword of the suites' ``run`` that takes it, its argparse settings)
OPTIONS = {"device": ("device", {}), "subset": ("subset", {"type": int}),
           "minutes": ("minutes", {"type": float}), "set": ("overrides", {"action": "append"}),
           "config": ("config", {}), "variant": ("variants", {"action": "append"}),
           "parallel": ("parallel", {"type": int}), "peer": ("peer", {}),
           "molecules_per_step": ("molecules_per_step", {"type": int}),
           "profile": ("profile", {"action": "store_true", "default": None}),
           "ours_only": ("ours_only", {"action": "store_true", "default": None}),
           "run_dir": ("run_dir", {})}  # fmt: skip


def main(argv: list[str] | None = None) -> dict | int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["table"]:
        return table.main(given[1:])
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="python -m schnet_ipu.bench", description=__doc__,
                                     formatter_class=formatter)  # fmt: skip
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--quick", action="store_true", help="reduced version (minutes)")
    parser.add_argument("--json", default=None, help="also write the JSON report here")
    parser.add_argument("--out-dir", default="bench_results", help="reports and plots")
    parser.add_argument("--store", default=QM9_STORE, help="QM9 molecule store")
    for option, (_, settings) in OPTIONS.items():
        parser.add_argument("--" + option.replace("_", "-"), **settings)
    args = parser.parse_args(argv)
    suite = importlib.import_module(f"schnet_ipu.bench.{args.suite}")
    takes = inspect.signature(suite.run).parameters
    options = dict(suite.QUICK) if args.quick else {}  # the options given override these
    options.update({key: getattr(args, key) for key in ("store", "out_dir") if key in takes})
    for option, (keyword, _) in OPTIONS.items():
        value = getattr(args, option)
        if value is not None and keyword not in takes:
            parser.error(f"--{option.replace('_', '-')} is not an option of the {args.suite} suite")
        if value is not None:
            options[keyword] = value
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report = suite.run(**options)
    argv = sys.argv[1:] if argv is None else argv
    report["command"] = shlex.join(["python", "-m", "schnet_ipu.bench", *argv])
    write_report(report, suite.COLUMNS, suite.PLOT, args.out_dir, args.json)
    return report


if __name__ == "__main__":
    sys.exit(run_cli(main))
