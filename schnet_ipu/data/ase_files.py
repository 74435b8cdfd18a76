"""Structures from any file ``ase.io.read`` reads (extxyz, ASE db, ...) into the store.

    import_ase(["train.extxyz", "more.db"], "data/mine.h5", energy_key="energy")

Every frame becomes one store record; record ids are the frame's position across all the
files in order, and the store's ``files`` / ``frames_per_file`` attributes map an id back to
"file, frame i". Energies are read from ``atoms.info[energy_key]`` or the attached calculator,
forces from ``atoms.arrays[forces_key]`` or the calculator (optional: frames without them
are kept, marked in the store's ``forces_mask``).
A bad frame (no energy or a non-numeric one, unknown element, NaN position, forces of the
wrong shape or not finite, a bad cell) or a file ASE cannot read (empty, a truncated gzip)
stops the import with one line naming the file and frame index, and nothing is written; an
``energy_key`` that no frame of a file has is named with the keys present.

Periodic frames (any ``pbc`` True: extxyz with a Lattice, ASE db, VASP POSCAR/OUTCAR, CIF,
whatever ``ase.io.read`` reads) keep their cell and pbc (:func:`frame_cell`), and their
stress when they have one (:func:`frame_stress`: ``atoms.info["stress"]`` or the
calculator's, Voigt [6] or [3, 3], in eV/Angstrom^3). Frames without a cell stay molecules
(zero cell, pbc False); a file with no periodic frame gives a molecule store.

Partial labels: when some frames have forces (or, among the periodic ones, stress) and
others not, all are kept; those without hold zeros and the store's ``forces_mask`` /
``stress_mask`` (:mod:`schnet_ipu.data.store_format`, version 2) say which frames carry them, so
the loss and the metrics count only those.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .checks import StoreError, invalid_cells
from .elements import NUM_ELEMENTS
from .writer import write_store

log = logging.getLogger(__name__)

ENERGY_UNIT = "eV"  # ASE's units
FORCES_UNIT = "eV/Angstrom"
STRESS_UNIT = "eV/Angstrom^3"


def read_frames(path: str | Path) -> list:
    """All frames of one ASE-readable file as ``ase.Atoms``; StoreError naming the file and
    the frame where reading failed (an empty file, a truncated gzip, an unknown symbol)."""
    import ase.io

    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path}: file not found")
    if path.stat().st_size == 0:
        raise StoreError(f"{path}: empty file (no frames); give a file with structures")
    frames: list = []
    try:
        for atoms in ase.io.iread(path, index=":"):
            frames.append(atoms)
    except Exception as err:  # ASE raises many kinds for unreadable or unknown formats
        frame = len(frames)
        if isinstance(err, EOFError) and not frames:  # extxyz scans the file before parsing
            frame = _whole_xyz_frames(path)
        raise StoreError(
            f"{path}, frame {frame}: cannot read with ase.io.read ({_read_failure(err)})"
        ) from err
    if not frames:
        raise StoreError(f"{path}: no frames")
    return frames


def _read_failure(err: Exception) -> str:
    """What ASE's exception means, in a few words."""
    from ase.data import atomic_numbers

    symbol = err.args[0] if isinstance(err, KeyError) and err.args else None
    if isinstance(symbol, str) and symbol not in atomic_numbers:
        return f"unknown element {symbol!r}"
    if isinstance(err, EOFError):
        return f"the file ends early, truncated: {err}"
    message = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def _whole_xyz_frames(path: Path) -> int:
    """Whole (ext)xyz frames before a compressed file breaks off: the index of the frame the
    file ends in (0 for other formats)."""
    from ase.io.formats import filetype, open_with_compression

    try:
        if filetype(str(path), read=False) not in ("xyz", "extxyz"):
            return 0
    except Exception:  # no format known from the name
        return 0
    frames = 0
    try:
        with open_with_compression(str(path), "r") as f:
            for header in f:
                atoms = int(header)
                for _ in range(atoms + 1):  # the comment line and one line per atom
                    if not next(f).endswith("\n"):
                        return frames
                frames += 1
    except (EOFError, ValueError, StopIteration, OSError):
        pass
    return frames


def check_frame(atoms, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Atomic numbers int64 [n] and float64 positions [n, 3] of a frame the model can take:
    known elements, finite positions (its cell: :func:`frame_cell`); otherwise StoreError
    naming ``where``."""
    if len(atoms) == 0:
        raise StoreError(f"{where}: no atoms")
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
    """``atoms.info[key]``, else the calculator's result ``key``; StoreError if neither, or
    if it is not one finite number."""
    value = atoms.info.get(key)
    if value is None and atoms.calc is not None:
        value = atoms.calc.results.get(key)
    if value is None:
        raise StoreError(
            f"{where}: no energy {key!r} in atoms.info or the attached calculator (this frame "
            f"has: {', '.join(frame_keys(atoms)) or 'nothing'})"
        )
    try:
        value = float(np.asarray(value, dtype=np.float64).reshape(-1)[0])
    except (ValueError, TypeError, IndexError):
        raise StoreError(f"{where}: energy {key!r} is not a number ({value!r})") from None
    if not np.isfinite(value):
        raise StoreError(f"{where}: energy {key!r} is not finite ({value})")
    return value


def frame_keys(atoms) -> list[str]:
    """Names of the per-frame values of a frame: ``atoms.info`` and calculator results."""
    results = atoms.calc.results if atoms.calc is not None else {}
    return sorted(set(atoms.info) | set(results))


def check_energy_key(frames: list, key: str, path: str | Path) -> None:
    """StoreError listing the keys present when no frame of ``path`` has ``key``."""
    if any(
        key in atoms.info or (atoms.calc is not None and key in atoms.calc.results)
        for atoms in frames
    ):
        return
    present = sorted({name for atoms in frames for name in frame_keys(atoms)})
    raise StoreError(
        f"{path}: no frame has the energy key {key!r}; keys present: "
        f"{', '.join(present) or 'none'}. Set data.energy_key to one of them"
    )


def frame_forces(atoms, key: str, where: str) -> np.ndarray | None:
    """``atoms.arrays[key]``, else the calculator's result ``key``, as float32 [n, 3]; None
    when the frame has none; StoreError for another shape or a non-finite value."""
    value = atoms.arrays.get(key)
    if value is None and atoms.calc is not None:
        value = atoms.calc.results.get(key)
    if value is None:
        return None
    try:
        forces = np.asarray(value, dtype=np.float64)
    except (ValueError, TypeError):
        raise StoreError(f"{where}: forces {key!r} are not numbers") from None
    if forces.shape != (len(atoms), 3):
        raise StoreError(
            f"{where}: forces {key!r} have shape {list(forces.shape)}, expected "
            f"[{len(atoms)}, 3] (atoms, xyz)"
        )
    if not np.isfinite(forces).all():
        atom = int(np.flatnonzero(~np.isfinite(forces).all(axis=1))[0])
        raise StoreError(f"{where}: non-finite (NaN/inf) forces {key!r} on atom {atom}")
    return forces.astype(np.float32)


def frame_cell(atoms, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The frame's cell float64 [3, 3] (rows the lattice vectors; zeros when not periodic)
    and pbc bool [3]; StoreError naming ``where`` for a NaN cell, pbc along a zero lattice
    vector (pbc without a cell) or a singular periodic cell."""
    pbc = np.asarray(atoms.pbc, dtype=bool).reshape(3)
    if not pbc.any():
        return np.zeros((3, 3)), pbc
    cell = np.asarray(atoms.cell.array, dtype=np.float64)
    reason = invalid_cells(cell[None], pbc[None]).get(0)
    if reason is not None:
        raise StoreError(f"{where}: {reason}; fix the cell or set pbc=False for a molecule")
    return cell, pbc


def frame_stress(atoms, where: str) -> np.ndarray | None:
    """``atoms.info["stress"]``, else the calculator's stress, as float64 [3, 3] (from ASE's
    Voigt order xx, yy, zz, yz, xz, xy, or 3 x 3); None when the frame has none."""
    value = atoms.info.get("stress")
    if value is None and atoms.calc is not None:
        value = atoms.calc.results.get("stress")
    if value is None:
        return None
    stress = np.asarray(value, dtype=np.float64).reshape(-1)
    if stress.shape == (6,):
        xx, yy, zz, yz, xz, xy = stress
        stress = np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]])
    elif stress.shape == (9,):
        stress = stress.reshape(3, 3)
    else:
        raise StoreError(f"{where}: stress has {stress.size} values, not 6 (Voigt) or 9 (3 x 3)")
    if not np.isfinite(stress).all():
        raise StoreError(f"{where}: stress is not finite")
    return stress


def periodic_arrays(
    cells: list[np.ndarray], pbcs: list[np.ndarray], stresses: list[np.ndarray | None]
) -> dict:
    """``write_store``'s cell, pbc, stress, stress_unit and stress_mask for the frames read:
    none when no frame is periodic; stress when a frame has one (zeros for the others), with
    a mask when a periodic frame has none."""
    periodic = [k for k, pbc in enumerate(pbcs) if pbc.any()]
    if not periodic:
        return {}
    arrays = {"cell": np.stack(cells), "pbc": np.stack(pbcs)}
    carried = np.array([s is not None for s in stresses])
    if carried.any():
        arrays["stress"] = np.stack([np.zeros((3, 3)) if s is None else s for s in stresses])
        arrays["stress_unit"] = STRESS_UNIT
        if not carried[periodic].all():
            arrays["stress_mask"] = carried
    return arrays


def forces_arrays(forces: list[np.ndarray | None], z: list[np.ndarray]) -> dict:
    """``write_store``'s forces and forces_mask for the frames read: none when no frame has
    forces; zeros for the frames without, and a mask, when some have them."""
    carried = np.array([f is not None for f in forces])
    if not carried.any():
        return {}
    arrays = {
        "forces": [np.zeros((len(n), 3), np.float32) if f is None else f for f, n in zip(forces, z)]
    }
    if not carried.all():
        arrays["forces_mask"] = carried
    return arrays


def import_ase(
    files: Sequence[str | Path],
    out: str | Path,
    energy_key: str = "energy",
    forces_key: str = "forces",
    progress: bool = True,
) -> Path:
    """Read every frame of ``files`` and write them to the store ``out`` (energy target in eV,
    forces in eV/Angstrom and stress in eV/Angstrom^3 of the frames that have them). Returns
    ``out``."""
    if not files:
        raise StoreError(f"{out}: data.source=ase needs data.files (a list of paths)")
    z, pos, energies, forces, counts = [], [], [], [], []
    cells, pbcs, stresses = [], [], []
    for path in files:
        frames = read_frames(path)
        check_energy_key(frames, energy_key, path)
        counts.append(len(frames))
        for i, atoms in enumerate(tqdm(frames, desc=f"import {path}", disable=not progress)):
            where = f"{path}, frame {i}"
            numbers, positions = check_frame(atoms, where)
            z.append(numbers)
            pos.append(positions)
            energies.append(frame_energy(atoms, energy_key, where))
            forces.append(frame_forces(atoms, forces_key, where))
            cell, pbc = frame_cell(atoms, where)
            cells.append(cell)
            pbcs.append(pbc)
            stresses.append(frame_stress(atoms, where) if pbc.any() else None)
    labels = {**forces_arrays(forces, z), **periodic_arrays(cells, pbcs, stresses)}
    log.info(
        "read %d frames from %d file(s): %d with forces, %d periodic, %d with stress",
        len(z),
        len(files),
        sum(f is not None for f in forces),
        int(sum(p.any() for p in pbcs)),
        sum(s is not None for s in stresses),
    )
    return write_store(
        out,
        z,
        pos,
        targets={"energy": np.asarray(energies)},
        units={"energy": ENERGY_UNIT},
        descriptions={"energy": f"ASE {energy_key!r}"},
        forces_unit=FORCES_UNIT,
        **labels,
        attrs={
            "source": "ase",
            "files": [str(f) for f in files],
            "frames_per_file": counts,
            "energy_key": energy_key,
            "forces_key": forces_key,
        },
        origin=", ".join(str(f) for f in files),
    )


def write_extxyz(frames: Sequence, out: Path) -> None:
    """Write ``frames`` (ASE ``Atoms``) to ``out`` as extxyz through a temporary file beside it,
    renamed at the end, so an interrupted write never leaves half a file under ``out``'s name."""
    import ase.io

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        ase.io.write(tmp, list(frames), format="extxyz")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind


def single_point(atoms, calculator, stress: bool = False):
    """A copy of ``atoms`` (ASE ``Atoms``) carrying ``calculator``'s energy and forces, and for
    a periodic frame with ``stress`` its stress, as a single-point result: a labelled frame
    the data scripts write to extxyz."""
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = atoms.copy()
    atoms.calc = calculator
    results = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if stress and atoms.pbc.any():
        results["stress"] = atoms.get_stress()
    atoms.calc = SinglePointCalculator(atoms, **results)
    return atoms


def rattled_around_minimum(
    base, calculator: Callable, fmax: float, frames: int, rattle: float, rng: np.random.Generator
) -> list:
    """``frames`` labelled copies of ``base`` (ASE ``Atoms``) after a short BFGS relaxation
    (at most 30 steps to ``fmax`` eV/A), each displaced by Gaussian noise of ``rattle`` A;
    ``calculator()`` makes a fresh ASE calculator for every evaluation."""
    from ase import Atoms
    from ase.optimize import BFGS

    base.calc = calculator()
    BFGS(base, logfile=None).run(fmax=fmax, steps=30)
    out = []
    for _ in range(frames):
        frame = Atoms(base.numbers, base.positions + rng.normal(0, rattle, (len(base), 3)))
        out.append(single_point(frame, calculator()))
    return out


def write_labelled_frames(frames: Sequence, out: Path) -> None:
    """:func:`write_extxyz`, then one log line saying what was written."""
    write_extxyz(frames, out)
    atoms = sum(len(frame) for frame in frames)
    logging.getLogger(__name__).info("wrote %d frames (%d atoms) to %s", len(frames), atoms, out)
