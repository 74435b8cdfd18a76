"""``python -m schnet_ipu.bench SUITE [--quick] [--json PATH] [--out-dir DIR] [--store PATH]``.

Suites: throughput (training molecules/s, ours against stock PyG SchNet), batching (every
packing algorithm and the static/dynamic baselines), loader (the feed alone against PyG's
DataLoader), model (forward+backward against PyG's SchNet), gpu (full QM9 epochs against
stock PyG on a GPU), dense (dense vs sparse message passing), balance (cost-model grouping
across replicas), calculator (a model file in use: ASE calculator and exported-file latency,
MD steps per second), accuracy (test MAE after ``--minutes`` of training against stock PyG
SchNet), forces (energy + force training for ``--minutes`` on a force config's frames, ours
against schnetpack 2.1.1), force_step (force against energy-only step time on a force
config), periodic (neighbour-list builders; periodic against molecular steps).

Options some suites take (another suite refuses them): ``--device`` (gpu: cuda or cpu),
``--subset N`` (gpu, accuracy: molecules; 0 = all), ``--molecules-per-step N`` (gpu),
``--profile`` (gpu: top kernels per step), ``--minutes M`` (accuracy 10, forces 1.5),
``--set section.key=value`` (gpu, forces, force_step; repeatable), ``--config C`` (forces,
force_step), ``--variant`` (repeatable; forces: ``'NAME: key=value ...'``, another row of
ours; gpu: a step variant of ``gpu.VARIANTS``, all of them by default),
``--parallel N`` (forces: sides at a time, 2). Each suite prints a table and writes
``SUITE.json``, ``SUITE.md`` and ``SUITE.png`` in ``--out-dir``; the report records the
command that made it.
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
           "molecules_per_step": "molecules_per_step", "profile": "profile"}  # fmt: skip


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
    args = parser.parse_args(argv)
    suite = importlib.import_module(f"schnet_ipu.bench.{args.suite}")
    takes = inspect.signature(suite.run).parameters
    options = {"out_dir": args.out_dir} if "out_dir" in takes else {}
    for option, keyword in OPTIONS.items():
        value = getattr(args, option)
        if value is None:
            continue
        if keyword not in takes:
            flag = "--" + option.replace("_", "-")
            parser.error(f"{flag} is not an option of the {args.suite} suite")
        options[keyword] = value
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report = suite.run(args.quick, args.store, **options)
    argv = sys.argv[1:] if argv is None else argv
    report["command"] = shlex.join(["python", "-m", "schnet_ipu.bench", *argv])
    write_report(report, suite.COLUMNS, suite.PLOT, args.out_dir, args.json)
    return report


if __name__ == "__main__":
    sys.exit(run_cli(main))
