"""Structures from any file ``ase.io.read`` reads (extxyz, ASE db, ...) into the store.

    import_ase(["train.extxyz", "more.db"], "data/mine.h5", energy_key="energy")

Every frame becomes one store record; record ids are the frame's position across all the
files in order, and the store's ``files`` / ``frames_per_file`` attributes map an id back to
"file, frame i". Energies are read from ``atoms.info[energy_key]`` or the attached calculator,
forces from ``atoms.arrays[forces_key]`` or the calculator (optional, but all frames or none).
A bad frame (no energy, unknown element, NaN position, a periodic cell) stops the import with
one line naming the file and frame index, and nothing is written. Periodic frames are refused:
the model's neighbour lists are for open clusters and molecules.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .store import NUM_ELEMENTS, StoreError, write_store

log = logging.getLogger(__name__)

ENERGY_UNIT = "eV"  # ASE's units
FORCES_UNIT = "eV/Angstrom"


def read_frames(path: str | Path) -> list:
    """All frames of one ASE-readable file as ``ase.Atoms``; StoreError if unreadable."""
    import ase.io

    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: file not found")
    try:
        frames = ase.io.read(path, index=":")
    except Exception as err:  # ASE raises many kinds for unreadable or unknown formats
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise StoreError(f"{path}: cannot read with ase.io.read ({message})") from err
    if not frames:
        raise StoreError(f"{path}: no frames")
    return frames


def check_frame(atoms, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Atomic numbers int64 [n] and float64 positions [n, 3] of a frame the model can take:
    not periodic, known elements, finite positions; otherwise StoreError naming ``where``."""
    if len(atoms) == 0:
        raise StoreError(f"{where}: no atoms")
    if np.any(atoms.pbc):
        raise StoreError(
            f"{where}: periodic cell (pbc={atoms.pbc.tolist()}); only open clusters and "
            "molecules are supported"
        )
    z = np.asarray(atoms.numbers, dtype=np.int64)
    bad = np.flatnonzero((z < 1) | (z >= NUM_ELEMENTS))
    if len(bad):
        raise StoreError(f"{where}: unknown element (atomic number {z[bad[0]]}, atom {bad[0]})")
    pos = np.asarray(atoms.positions, dtype=np.float64)
    if not np.isfinite(pos).all():
        atom = int(np.flatnonzero(~np.isfinite(pos).all(axis=1))[0])
        raise StoreError(f"{where}: non-finite (NaN/inf) position of atom {atom}")
    return z, pos


def frame_energy(atoms, key: str, where: str) -> float:
    """``atoms.info[key]``, else the calculator's result ``key``; StoreError if neither."""
    value = atoms.info.get(key)
    if value is None and atoms.calc is not None:
        value = atoms.calc.results.get(key)
    if value is None:
        raise StoreError(f"{where}: no energy {key!r} in atoms.info or the attached calculator")
    value = float(np.asarray(value).reshape(-1)[0])
    if not np.isfinite(value):
        raise StoreError(f"{where}: energy {key!r} is not finite ({value})")
    return value


def frame_forces(atoms, key: str, where: str) -> np.ndarray | None:
    """``atoms.arrays[key]``, else the calculator's result ``key``, as float32 [n, 3]; None
    when the frame has none."""
    value = atoms.arrays.get(key)
    if value is None and atoms.calc is not None:
        value = atoms.calc.results.get(key)
    if value is None:
        return None
    forces = np.asarray(value, dtype=np.float64)
    if forces.shape != (len(atoms), 3) or not np.isfinite(forces).all():
        raise StoreError(f"{where}: forces {key!r} must be finite [{len(atoms)}, 3]")
    return forces.astype(np.float32)


def import_ase(
    files: Sequence[str | Path],
    out: str | Path,
    energy_key: str = "energy",
    forces_key: str = "forces",
    progress: bool = True,
) -> Path:
    """Read every frame of ``files`` and write them to the store ``out`` (energy target in eV,
    forces in eV/Angstrom when every frame has them). Returns ``out``."""
    if not files:
        raise StoreError(f"{out}: data.source=ase needs data.files (a list of paths)")
    z, pos, energies, forces, counts = [], [], [], [], []
    missing_forces: str | None = None
    for path in files:
        frames = read_frames(path)
        counts.append(len(frames))
        for i, atoms in enumerate(tqdm(frames, desc=f"import {path}", disable=not progress)):
            where = f"{path}, frame {i}"
            numbers, positions = check_frame(atoms, where)
            z.append(numbers)
            pos.append(positions)
            energies.append(frame_energy(atoms, energy_key, where))
            frame = frame_forces(atoms, forces_key, where)
            if frame is None:
                missing_forces = missing_forces or where
            forces.append(frame)
    with_forces = missing_forces is None
    if not with_forces and any(f is not None for f in forces):
        raise StoreError(f"{missing_forces}: no forces {forces_key!r}, but other frames have them")
    log.info("read %d frames from %d file(s), forces: %s", len(z), len(files), with_forces)
    return write_store(
        out,
        z,
        pos,
        targets={"energy": np.asarray(energies)},
        units={"energy": ENERGY_UNIT},
        descriptions={"energy": f"ASE {energy_key!r}"},
        forces=forces if with_forces else None,
        forces_unit=FORCES_UNIT,
        attrs={
            "source": "ase",
            "files": [str(f) for f in files],
            "frames_per_file": counts,
            "energy_key": energy_key,
            "forces_key": forces_key,
        },
        origin=", ".join(str(f) for f in files),
    )
