"""``python -m schnet_ipu.bench SUITE [--quick] [--json PATH] [--out-dir DIR] [--store PATH]``.

The gpu suite also takes ``--device`` (default cuda), ``--subset N`` (molecules; 0 = all),
``--molecules-per-step N`` (ours, about; default 32), ``--set section.key=value``
(config overrides, repeatable) and ``--profile`` (top kernels per step of each variant).

Suites: throughput, ablation, batching, loader, scaling, model (forward+backward against
PyG's SchNet), replication (replicas x gradient reduction), gpu (full QM9 epochs against
stock PyG on a GPU), dense (dense vs sparse message passing), balance (cost-model grouping
across replicas), calculator (a model file in use: ASE calculator and exported-file latency,
MD steps per second), accuracy (test MAE after ``--minutes`` of training, ours against
stock PyG SchNet), forces (energy + force training for ``--minutes`` on a force config's
frames, ours against schnetpack 2.1.1: ``--config``, ``--set``, ``--variant``, ``--parallel``).
Each prints a table and writes ``SUITE.json``, ``SUITE.md`` and
``SUITE.png`` in ``--out-dir``; the report records the command that made it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import sys

from schnet_ipu.bench import forces_vs_schnetpack as forces_suite
from schnet_ipu.bench.common import QM9_STORE, write_report
from schnet_ipu.errors import run_cli

SUITES = (
    "throughput",
    "ablation",
    "batching",
    "loader",
    "scaling",
    "model",
    "replication",
    "gpu",
    "dense",
    "balance",
    "calculator",
    "accuracy",
    "forces",
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m schnet_ipu.bench", description=__doc__)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--quick", action="store_true", help="reduced version (minutes)")
    parser.add_argument("--json", default=None, help="also write the JSON report here")
    parser.add_argument("--out-dir", default="bench_results", help="reports and plots")
    parser.add_argument("--store", default=QM9_STORE, help="QM9 molecule store")
    parser.add_argument("--device", default=None, help="gpu suite: cuda (default) or cpu")
    parser.add_argument(
        "--subset", type=int, default=None, help="gpu and accuracy suites: molecules used"
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="accuracy and forces suites: minutes each side (10; forces 1.5)",
    )
    parser.add_argument(
        "--set", action="append", default=[], help="gpu and forces suites: key=value"
    )
    parser.add_argument("--config", default=None, help="forces suite: a force config")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="forces suite: another row of ours, 'NAME: key=value ...' (repeatable)",
    )
    parser.add_argument(
        "--parallel", type=int, default=None, help="forces suite: sides at a time (2)"
    )
    parser.add_argument(
        "--molecules-per-step", type=int, default=None, help="gpu suite: ours, about (32)"
    )
    parser.add_argument(
        "--profile", action="store_true", default=None, help="gpu suite: top kernels per step"
    )
    args = parser.parse_args(argv)
    gpu_options = {
        "device": args.device,
        "subset": args.subset,
        "overrides": args.set or None,
        "molecules_per_step": args.molecules_per_step,
        "profile": args.profile,
    }
    gpu_options = {key: value for key, value in gpu_options.items() if value is not None}
    forces_only = args.config is not None or args.variant or args.parallel is not None
    if forces_only and args.suite != "forces":
        parser.error("--config, --variant and --parallel are forces suite options")
    if args.suite == "forces":
        options = {
            "minutes": args.minutes or 1.5,
            "config": args.config or forces_suite.DEFAULT_CONFIG,
            "overrides": args.set,
            "variants": args.variant,
            "parallel": args.parallel or 2,
            "out_dir": args.out_dir,
        }
        gpu_options = {k: v for k, v in gpu_options.items() if k != "overrides"}
    elif args.suite == "accuracy":
        gpu_options.pop("subset", None)
        options = {"minutes": args.minutes or 10.0, "subset": args.subset or 0}
        options["out_dir"] = args.out_dir
    elif args.minutes is not None:
        parser.error("--minutes is an accuracy and forces suite option")
    else:
        options = gpu_options
    if gpu_options and args.suite != "gpu":
        parser.error(
            "--device, --subset, --molecules-per-step, --set and --profile are gpu suite options"
        )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    suite = importlib.import_module(f"schnet_ipu.bench.{args.suite}")
    report = suite.run(args.quick, args.store, **options)
    argv = sys.argv[1:] if argv is None else argv
    report["command"] = shlex.join(["python", "-m", "schnet_ipu.bench", *argv])
    write_report(report, suite.COLUMNS, suite.PLOT, args.out_dir, args.json)
    return report


if __name__ == "__main__":
    sys.exit(run_cli(main))
