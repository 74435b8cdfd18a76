"""NVE energy drift of a trained model: velocity Verlet through the ASE calculator.

    python scripts/md_drift.py --model runs/emt_bulk/checkpoints/best.pt \
        --input data/emt_bulk.extxyz [--frame 0] [--steps 1000] [--dtype float64]

Takes one frame of ``--input`` (a periodic cell or a molecule), gives it Maxwell-Boltzmann
velocities at 300 K and runs ``--steps`` steps of 1 fs; prints the drift of the total
energy per atom (last minus first, and the largest excursion) in meV, and the steps/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import ase.io
import numpy as np
import torch
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from schnet_ipu.calculator import SchNetCalculator


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", nargs="+", required=True, help="checkpoint file(s) or run folder(s)"
    )
    parser.add_argument("--input", required=True, help="ASE-readable structures")
    parser.add_argument("--frame", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    args = parser.parse_args(argv)
    atoms = ase.io.read(args.input, index=args.frame)
    atoms.calc = SchNetCalculator(args.model, dtype=getattr(torch, args.dtype))
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    dyn = VelocityVerlet(atoms, timestep=1 * fs)
    totals = []
    dyn.attach(lambda: totals.append(atoms.get_total_energy()), interval=1)
    start = time.perf_counter()
    dyn.run(args.steps)
    seconds = time.perf_counter() - start
    per_atom = (np.array(totals) - totals[0]) / len(atoms) * 1000
    report = {
        "atoms": len(atoms),
        "periodic": bool(atoms.pbc.any()),
        "dtype": args.dtype,
        "steps": args.steps,
        "drift_mev_per_atom": float(per_atom[-1]),
        "largest_excursion_mev_per_atom": float(np.abs(per_atom).max()),
        "steps_per_s": args.steps / seconds,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
