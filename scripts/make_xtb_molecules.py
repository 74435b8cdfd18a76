"""Make a molecular energy + force data set: QM9 molecules displaced around their GFN2-xTB
minimum, labelled by GFN2-xTB through tblite.

    python scripts/make_xtb_molecules.py --out data/xtb_molecules.extxyz [--molecules 1000]

``--molecules`` molecules drawn at random from qm9pack's first file (its B3LYP geometries,
read the way :mod:`schnet_ipu.data.qm9` reads them), each relaxed a little with BFGS under
GFN2-xTB (to GFN2's own equilibrium, not B3LYP's), then written as ``--frames`` copies
displaced by random Gaussian displacements of ``--rattle`` A per coordinate (no MD): the
energies (eV, ``atoms.info["energy"]``) and forces (eV/A, ``atoms.arrays["forces"]``) of
GFN2-xTB. Deterministic from ``--seed``; about 2 minutes on one core for the default
1,000 x 10 = 10,000 frames (9-26 atoms, H C N O). The default was 200 molecules (2,000
frames) until the 15-minute comparison with schnetpack showed that set too small: our side
saw every frame 300 times and its validation force MAE stopped falling after 700 s
(docs/benchmarks/forces-recipe-search.md, round 5).

tblite (``pip install tblite``, a bench-only extra: ``pip install -e .[bench]``) gives the
ASE calculator ``tblite.ase.TBLite``; one OpenMP thread per process is fastest for
molecules of this size and is set before tblite loads.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before tblite's OpenMP runtime starts

import numpy as np
from ase import Atoms
from tqdm import tqdm

from schnet_ipu.data.ase_files import rattled_around_minimum, write_labelled_frames
from schnet_ipu.data.qm9 import QM9PACK_FILES, qm9pack_dir

METHOD = "GFN2-xTB"
STRIP = str.maketrans("", "", "[]' \"")  # qm9pack writes lists as "['C','H']", "[[x,y,z],...]"


def qm9_molecules(count: int, rng: np.random.Generator) -> list[Atoms]:
    """``count`` distinct molecules at random from qm9pack's first file."""
    path = qm9pack_dir() / QM9PACK_FILES[0]
    with open(path, newline="") as f:
        rows = [(row["Elements"], row["XYZ_Ang"]) for row in csv.DictReader(f)]
    picked = rng.choice(len(rows), size=min(count, len(rows)), replace=False)
    molecules = []
    for index in sorted(picked.tolist()):
        elements, xyz = (text.translate(STRIP) for text in rows[index])
        positions = np.array(xyz.split(","), dtype=np.float64).reshape(-1, 3)
        molecules.append(Atoms(symbols=elements.split(","), positions=positions))
    return molecules


def calculator():
    from tblite.ase import TBLite

    return TBLite(method=METHOD, verbosity=0)


def make_frames(molecules: int, frames: int, rattle: float, seed: int) -> list[Atoms]:
    """``molecules`` x ``frames`` labelled frames (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for base in tqdm(qm9_molecules(molecules, rng), desc=f"{METHOD} labels", unit="mol"):
        out += rattled_around_minimum(
            base, calculator, fmax=0.1, frames=frames, rattle=rattle, rng=rng
        )
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="extxyz file to write")
    parser.add_argument("--molecules", type=int, default=1000)
    parser.add_argument("--frames", type=int, default=10, help="displaced frames per molecule")
    parser.add_argument("--rattle", type=float, default=0.05, help="Angstrom (Gaussian sigma)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    frames = make_frames(args.molecules, args.frames, args.rattle, args.seed)
    write_labelled_frames(frames, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
