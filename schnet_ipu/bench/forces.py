"""Step time of force training against energy-only training, side by side; and the
``forces`` suite of ``python -m schnet_ipu.bench`` (ours against schnetpack at equal wall
time, :mod:`schnet_ipu.bench.forces_vs_schnetpack`).

    python -m schnet_ipu.bench.forces --config configs/emt_forces.yaml [key=value ...]

Builds the run's trainer six times on the same batches: energy only (torch flavour), energy
+ forces (torch flavour: custom autograd functions with double backward), energy + forces
through plain ops (the ipu flavour, which autograd differentiates twice by itself), the
first two with the tabulated filter (``model.filter=table``), and the energy-only table step
compiled (``backend.compile``). The steps are timed in
interleaved rounds, so load from other processes hits all alike; prints the median
milliseconds per step and the ratios to energy-only (exact filter).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from schnet_ipu.backends.distributed import ReplicaInfo
from schnet_ipu.bench.forces_vs_schnetpack import COLUMNS, PLOT, run  # the suite
from schnet_ipu.components import make_trainer
from schnet_ipu.config import load_config
from schnet_ipu.pipeline import make_loader, prepare_data

__all__ = ["COLUMNS", "PLOT", "main", "run"]

# name -> (forces_weight, op flavour, model.filter, backend.compile); force steps are not
# compiled (AOTAutograd refuses a double backward)
VARIANTS = {
    "energy": (0.0, "torch", "exact", False),
    "forces": (1.0, "torch", "exact", False),
    "forces_plain_ops": (1.0, "ipu", "exact", False),
    "energy_table": (0.0, "torch", "table", False),
    "forces_table": (1.0, "torch", "table", False),
    "energy_table_compiled": (0.0, "torch", "table", True),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m schnet_ipu.bench.forces")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, [*args.overrides, "loader.workers=0"])
    if cfg.backend.threads:
        torch.set_num_threads(cfg.backend.threads)
    data = prepare_data(cfg)
    calls = make_loader(cfg, data, "train").epoch(0)
    batches = [next(calls) for _ in range(args.steps)]
    backends = {}
    for name, (weight, ops, filter_, compiled) in VARIANTS.items():
        variant = dataclasses.replace(
            cfg,
            optim=dataclasses.replace(cfg.optim, forces_weight=weight),
            model=dataclasses.replace(cfg.model, ops=ops, filter=filter_),
            backend=dataclasses.replace(cfg.backend, compile=compiled),
        )
        backends[name] = make_trainer(variant, data, ReplicaInfo(), "cpu")[2]
        backends[name].train_call(batches[0])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            start = time.perf_counter()
            for call in batches:
                backend.train_call(call)
            times[name].append(1000 * (time.perf_counter() - start) / len(batches))
    median = {name: statistics.median(t) for name, t in times.items()}
    report = {
        "threads": torch.get_num_threads(),
        "step_ms": median,
        "ratio_to_energy": {name: median[name] / median["energy"] for name in VARIANTS},
        "table_speedup": {
            kind: median[kind] / median[f"{kind}_table"] for kind in ("energy", "forces")
        },
        "atoms_per_batch": int(batches[0][0].node_mask.sum()),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
