"""``python -m schnet_ipu.packing report STORE [--cutoff 6] [--json PATH] [--out-dir DIR]``."""

from __future__ import annotations

import argparse
import sys

from schnet_ipu.errors import positive_float, run_cli
from schnet_ipu.packing.report import main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m schnet_ipu.packing")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="compare packing algorithms on a store")
    report.add_argument("store", help="HDF5 molecule store, e.g. data/qm9.h5")
    report.add_argument(
        "--cutoff", type=positive_float, default=6.0, help="radius graph cutoff (A)"
    )
    report.add_argument("--json", default="", help="also write the numbers to this JSON file")
    report.add_argument("--out-dir", default="runs/packing", help="folder for the PNG plots")
    report.add_argument("--packs-per-batch", type=int, default=8, help="packs per batch (B)")
    report.add_argument(
        "--batch-graphs", type=int, default=0, help="baseline molecules per batch; 0 = as LPFHP"
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run_cli(lambda: main(parse())))
