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

from schnet_ipu.data.ase_files import rattled_around_minimum, write_labelled_frames

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


def make_frames(
    clusters: int, frames: int, rattle: float, seed: int, sizes: tuple[int, int] = (6, 20)
) -> list[Atoms]:
    """``clusters`` x ``frames`` labelled frames (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(clusters):
        base = random_cluster(rng, int(rng.integers(sizes[0], sizes[1] + 1)))
        out += rattled_around_minimum(base, EMT, fmax=0.2, frames=frames, rattle=rattle, rng=rng)
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
    write_labelled_frames(frames, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
