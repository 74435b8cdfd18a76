"""Make a periodic energy + force + stress data set: fcc alloys labelled by ASE's EMT.

    python scripts/make_emt_bulk.py --out data/emt_bulk.extxyz [--frames 1200]
    python scripts/make_emt_bulk.py --out data/emt_partial.extxyz --no-slab-stress

Frames, in equal shares (deterministic from ``--seed``):

* bulk: a 2x2x2 conventional fcc cell (32 atoms) of a random binary alloy of Cu, Ni, Pd,
  Ag, Pt, Au (lattice constant by Vegard's law from EMT's own), under a random symmetric
  strain of up to ``--strain`` (so strained and sheared, triclinic cells);
* vacancies: the same with one or two atoms removed;
* slabs: a 2x2x4 fcc(111) or fcc(100) slab with 8 A of vacuum, pbc (True, True, False);

every frame rattled by a Gaussian of ``--rattle`` A, with EMT's energy (eV), forces
(eV/A) and stress (eV/A^3, ASE's convention) as a single-point result, which extxyz writes.
``--no-slab-stress`` leaves the slabs without stress, as DFT sets of bulk and surfaces
often are (a set with partial labels). About a second per 100 frames on one core.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
from ase import Atoms
from ase.build import bulk, fcc100, fcc111
from ase.calculators.emt import EMT

from schnet_ipu.data.ase_files import single_point, write_labelled_frames

# EMT's fcc lattice constants in Angstrom (its equilibrium, close to experiment)
LATTICE = {"Cu": 3.59, "Ni": 3.51, "Pd": 3.94, "Ag": 4.06, "Pt": 3.93, "Au": 4.07}
KINDS = ("bulk", "vacancy", "slab")
VACUUM = 8.0  # Angstrom on each side of a slab


def alloy(rng: np.random.Generator, count: int) -> tuple[list[str], float]:
    """A random binary composition of ``count`` atoms and its Vegard lattice constant."""
    pair = rng.choice(sorted(LATTICE), size=2, replace=False)
    symbols = np.where(rng.uniform(size=count) < rng.uniform(), pair[0], pair[1]).tolist()
    return symbols, float(np.mean([LATTICE[s] for s in symbols]))


def strained(rng: np.random.Generator, atoms: Atoms, strain: float) -> Atoms:
    """``atoms`` with cell and positions deformed by ``I + eps``, eps symmetric, entries
    uniform in [-strain, strain]."""
    eps = rng.uniform(-strain, strain, size=(3, 3))
    eps = 0.5 * (eps + eps.T)
    atoms.set_cell(atoms.cell.array @ (np.eye(3) + eps), scale_atoms=True)
    return atoms


def make_frame(rng: np.random.Generator, kind: str, strain: float, rattle: float) -> Atoms:
    """One unlabelled frame of ``kind`` (see the module docstring)."""
    if kind == "slab":
        build = fcc111 if rng.uniform() < 0.5 else fcc100
        symbols, lattice = alloy(rng, 16)
        atoms = build("Cu", size=(2, 2, 4), a=lattice, vacuum=VACUUM)  # pbc (True, True, False)
        atoms.info.clear()  # ase.build keeps adsorbate sites there, which extxyz cannot write
    else:
        symbols, lattice = alloy(rng, 32)
        atoms = strained(rng, bulk("Cu", "fcc", a=lattice, cubic=True).repeat((2, 2, 2)), strain)
    atoms.set_chemical_symbols(symbols)
    if kind == "vacancy":
        del atoms[rng.choice(len(atoms), size=int(rng.integers(1, 3)), replace=False)]
    atoms.positions += rng.normal(0.0, rattle, size=(len(atoms), 3))
    return atoms


def labelled(atoms: Atoms, stress: bool = True) -> Atoms:
    """A copy of ``atoms`` carrying EMT's energy, forces and (periodic frames, unless not
    ``stress``) stress as a single-point result."""
    return single_point(atoms, EMT(), stress)


def make_frames(
    frames: int, strain: float, rattle: float, seed: int, slab_stress: bool = True
) -> list[Atoms]:
    """``frames`` labelled frames, the kinds in turn (slabs without stress unless
    ``slab_stress``)."""
    rng = np.random.default_rng(seed)
    made = []
    for k in range(frames):
        kind = KINDS[k % len(KINDS)]
        made.append(labelled(make_frame(rng, kind, strain, rattle), kind != "slab" or slab_stress))
    return made


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="extxyz file to write")
    parser.add_argument("--frames", type=int, default=1200)
    parser.add_argument("--strain", type=float, default=0.03, help="largest strain entry")
    parser.add_argument("--rattle", type=float, default=0.05, help="Angstrom (Gaussian sigma)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-slab-stress", action="store_true", help="slabs without stress (partial labels)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    frames = make_frames(
        args.frames, args.strain, args.rattle, args.seed, slab_stress=not args.no_slab_stress
    )
    write_labelled_frames(frames, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
