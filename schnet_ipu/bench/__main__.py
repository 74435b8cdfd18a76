"""``python -m schnet_ipu.bench SUITE [--quick] [--json PATH] [--out-dir DIR] [--store PATH]``.

Suites (each module's docstring says what it measures): throughput, batching, loader, model,
gpu, dense, balance, calculator, accuracy, forces, force_step, periodic. Suite options
(another suite refuses them; they override ``--quick``'s reduced settings): ``--device``
(gpu), ``--subset N`` (gpu, accuracy), ``--molecules-per-step N`` and ``--profile`` (gpu),
``--minutes M`` (accuracy, forces), ``--ours-only`` (accuracy), ``--set section.key=value``
(gpu, accuracy, forces, force_step), ``--config C`` (forces, force_step), ``--variant``
(forces: ``'NAME: key=value ...'``; gpu: a name of ``gpu.VARIANTS``), ``--parallel N``
(forces). Each writes ``SUITE.json``, ``.md`` and ``.png`` in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import shlex
import sys

from schnet_ipu.bench.common import QM9_STORE, write_report
from schnet_ipu.errors import run_cli

SUITES = ("throughput", "batching", "loader", "model", "gpu", "dense", "balance", "calculator",
          "accuracy", "forces", "force_step", "periodic")  # fmt: skip
# command-line option -> the keyword of the suites' ``run`` that takes it
OPTIONS = {"device": "device", "subset": "subset", "minutes": "minutes", "set": "overrides",
           "config": "config", "variant": "variants", "parallel": "parallel",
           "molecules_per_step": "molecules_per_step", "profile": "profile",
           "ours_only": "ours_only"}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m schnet_ipu.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--quick", action="store_true", help="reduced version (minutes)")
    parser.add_argument("--json", default=None, help="also write the JSON report here")
    parser.add_argument("--out-dir", default="bench_results", help="reports and plots")
    parser.add_argument("--store", default=QM9_STORE, help="QM9 molecule store")
    parser.add_argument("--device")
    parser.add_argument("--subset", type=int)
    parser.add_argument("--minutes", type=float)
    parser.add_argument("--set", action="append")
    parser.add_argument("--config")
    parser.add_argument("--variant", action="append")
    parser.add_argument("--parallel", type=int)
    parser.add_argument("--molecules-per-step", type=int)
    parser.add_argument("--profile", action="store_true", default=None)
    parser.add_argument("--ours-only", action="store_true", default=None)
    args = parser.parse_args(argv)
    suite = importlib.import_module(f"schnet_ipu.bench.{args.suite}")
    takes = inspect.signature(suite.run).parameters
    options = dict(suite.QUICK) if args.quick else {}  # the options given override these
    options.update(
        {k: v for k, v in (("store", args.store), ("out_dir", args.out_dir)) if k in takes}
    )
    for option, keyword in OPTIONS.items():
        value = getattr(args, option)
        if value is None:
            continue
        if keyword not in takes:
            flag = "--" + option.replace("_", "-")
            parser.error(f"{flag} is not an option of the {args.suite} suite")
        options[keyword] = value
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report = suite.run(**options)
    argv = sys.argv[1:] if argv is None else argv
    report["command"] = shlex.join(["python", "-m", "schnet_ipu.bench", *argv])
    write_report(report, suite.COLUMNS, suite.PLOT, args.out_dir, args.json)
    return report


if __name__ == "__main__":
    sys.exit(run_cli(main))
