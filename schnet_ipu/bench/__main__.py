"""``python -m schnet_ipu.bench SUITE [--quick] [--json PATH] [--out-dir DIR] [--store PATH]``.

Suites: throughput, ablation, batching, loader, scaling, dense, balance. Each prints a table
and writes ``SUITE.json``, ``SUITE.md`` and ``SUITE.png`` in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import importlib
import logging

from schnet_ipu.bench.common import QM9_STORE, write_report

SUITES = ("throughput", "ablation", "batching", "loader", "scaling", "dense", "balance")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m schnet_ipu.bench", description=__doc__)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--quick", action="store_true", help="reduced version (minutes)")
    parser.add_argument("--json", default=None, help="also write the JSON report here")
    parser.add_argument("--out-dir", default="bench_results", help="reports and plots")
    parser.add_argument("--store", default=QM9_STORE, help="QM9 molecule store")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    suite = importlib.import_module(f"schnet_ipu.bench.{args.suite}")
    report = suite.run(args.quick, args.store)
    write_report(report, suite.COLUMNS, suite.PLOT, args.out_dir, args.json)
    return report


if __name__ == "__main__":
    main()
