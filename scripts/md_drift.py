"""NVE energy drift of a trained model: velocity Verlet through ASE, or through LAMMPS.

    python scripts/md_drift.py --model runs/emt_bulk/checkpoints/best.pt \
        --input data/emt_bulk.extxyz [--frame 0] [--steps 1000] [--dtype float64] \
        [--engine ase|lammps] [--repeat 3 3 3]

Takes one frame of ``--input`` (a periodic cell or a molecule; ``--repeat`` makes a
supercell), gives it Maxwell-Boltzmann velocities at 300 K and runs ``--steps`` steps of
1 fs; prints the drift of the total energy per atom (last minus first, and the largest
excursion) in meV, and the steps/s. ``--engine lammps`` (the ``md`` extra; periodic cells
in LAMMPS's lower-triangular form) integrates in LAMMPS through ``fix external``
(:mod:`schnet_ipu.inference.lammps`): ``--model`` may then also be a ``train.py export`` file,
run as a libtorch user would.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ase.io
import numpy as np
import torch
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from schnet_ipu.checkpoint import is_torchscript
from schnet_ipu.inference.calculator import SchNetCalculator


def ase_totals(atoms, model: list[str], dtype: torch.dtype, steps: int) -> list[float]:
    atoms.calc = SchNetCalculator(model, dtype=dtype)
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(0))
    dyn = VelocityVerlet(atoms, timestep=1 * fs)
    totals = []
    dyn.attach(lambda: totals.append(atoms.get_total_energy()), interval=1)
    dyn.run(steps)
    return totals


def lammps_totals(atoms, model: list[str], dtype: torch.dtype, steps: int) -> list[float]:
    from schnet_ipu.inference.lammps import AseForces, ExportedModel, run_lammps

    if len(model) == 1 and Path(model[0]).is_file() and is_torchscript(Path(model[0])):
        evaluator = ExportedModel(model[0])
    else:
        evaluator = AseForces(SchNetCalculator(model, dtype=dtype))
    return run_lammps(atoms, evaluator, steps, temperature_K=300, every=1).total


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", nargs="+", required=True, help="checkpoint file(s) or run folder(s)"
    )
    parser.add_argument("--input", required=True, help="ASE-readable structures")
    parser.add_argument("--frame", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    parser.add_argument("--engine", default="ase", choices=("ase", "lammps"))
    parser.add_argument("--repeat", type=int, nargs=3, default=(1, 1, 1))
    args = parser.parse_args(argv)
    atoms = ase.io.read(args.input, index=args.frame).repeat(tuple(args.repeat))
    run = ase_totals if args.engine == "ase" else lammps_totals
    start = time.perf_counter()
    totals = run(atoms, args.model, getattr(torch, args.dtype), args.steps)
    seconds = time.perf_counter() - start
    per_atom = (np.array(totals) - totals[0]) / len(atoms) * 1000
    report = {
        "engine": args.engine,
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
