"""Make an energy + force data set: rattled Cu/Pt/Au clusters labelled by ASE's EMT.

    python scripts/make_emt_clusters.py --out data/emt_clusters.extxyz [--clusters 200]

Each cluster has 6-20 atoms of random composition, placed at random in a sphere (no two
closer than 2.2 A), relaxed a little with BFGS, then written as ``--frames`` copies rattled
by a Gaussian of ``--rattle`` A: the energies (eV, ``atoms.info["energy"]``) and forces
(eV/A, ``atoms.arrays["forces"]``) of EMT. Deterministic from ``--seed``; takes about
two minutes on one core for the default 200 x 15 = 3000 frames.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
from ase import Atoms
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from ase.optimize import BFGS

from schnet_ipu.data.ase_files import write_extxyz

ELEMENTS = ("Cu", "Pt", "Au")
MIN_DISTANCE = 2.2  # Angstrom, closest start distance
VOLUME_PER_ATOM = 16.0  # Angstrom^3 of the start sphere (about a metal's)


def random_cluster(rng: np.random.Generator, size: int) -> Atoms:
    """``size`` atoms of random elements, uniform in a sphere, at least MIN_DISTANCE apart."""
    radius = (3 * size * VOLUME_PER_ATOM / (4 * np.pi)) ** (1 / 3)
    positions: list[np.ndarray] = []
    while len(positions) < size:
        trial = rng.uniform(-radius, radius, size=3)
        if np.linalg.norm(trial) <= radius and all(
            np.linalg.norm(trial - p) >= MIN_DISTANCE for p in positions
        ):
            positions.append(trial)
    symbols = rng.choice(ELEMENTS, size=size)
    return Atoms(symbols=list(symbols), positions=positions)


def labelled(atoms: Atoms) -> Atoms:
    """A copy of ``atoms`` carrying EMT's energy and forces as a single-point result."""
    atoms = atoms.copy()
    atoms.calc = EMT()
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces)
    return atoms


def make_frames(
    clusters: int, frames: int, rattle: float, seed: int, sizes: tuple[int, int] = (6, 20)
) -> list[Atoms]:
    """``clusters`` x ``frames`` labelled frames (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(clusters):
        base = random_cluster(rng, int(rng.integers(sizes[0], sizes[1] + 1)))
        base.calc = EMT()
        BFGS(base, logfile=None).run(fmax=0.2, steps=30)
        for _ in range(frames):
            frame = Atoms(base.numbers, base.positions + rng.normal(0, rattle, (len(base), 3)))
            out.append(labelled(frame))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="extxyz file to write")
    parser.add_argument("--clusters", type=int, default=200)
    parser.add_argument("--frames", type=int, default=15, help="rattled frames per cluster")
    parser.add_argument("--rattle", type=float, default=0.1, help="Angstrom (Gaussian sigma)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    frames = make_frames(args.clusters, args.frames, args.rattle, args.seed)
    write_extxyz(frames, args.out)
    atoms = sum(len(f) for f in frames)
    logging.info("wrote %d frames (%d atoms) to %s", len(frames), atoms, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
