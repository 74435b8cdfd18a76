"""The HDF5 molecule store (schema version 2): one file per dataset, written once, read often.

Layout (M molecules, A atoms in total)::

    /z         uint8   [A]     atomic numbers, molecules concatenated
    /pos       float32 [A, 3]  positions in Angstrom
    /offsets   int64   [M + 1] molecule i owns atoms offsets[i]:offsets[i + 1]
    /ids       int64   [M]     record id in the source (QM9: gdb index)
    /forces    float32 [A, 3]  optional per-atom forces; attrs: unit (e.g. eV/Angstrom)
    /cell      float64 [M, 3, 3] optional (periodic stores): lattice vectors as rows, Angstrom;
                               zeros for a frame without a cell (a molecule)
    /pbc       bool    [M, 3]  with /cell: periodic along each cell vector
    /stress    float64 [M, 3, 3] optional, with /cell: ASE's stress (sign and convention);
                               attrs: unit (eV/Angstrom^3)
    /forces_mask bool  [M]     optional, with /forces: frame m carries forces (version 2)
    /stress_mask bool  [M]     optional, with /stress: frame m carries stress (version 2)
    /targets/<name>  float64 [M]    attrs: unit, description
    /atomrefs/<name> float64 [119]  optional per-element reference in the target's unit

Root attributes: schema, schema_version, source, source_version, synthetic, num_molecules,
num_atoms, created (ISO time), plus anything an importer adds.

Partial labels (version 2): a store where only some frames carry forces or stress holds
zeros for the others and a per-frame mask saying which do. Without a mask every frame
carries the forces of ``/forces``, and every frame with pbc the stress of ``/stress`` (the
version-1 meaning). A store with a mask is written as version 2, one without as version 1,
so that code older than the masks opens every store it can read right and refuses the
others (it would take their zeros for labels); this code reads both.

Reads are lazy and per process: :class:`MoleculeStore` keeps only small metadata until the
first molecule is read, opens the file then, and re-opens it after a fork. A cache miss reads
the whole compressed chunk(s) holding the molecule and keeps every molecule inside them in a
memory cache (the second level after the compressed file).

Validation: :func:`write_store` checks every record (atomic numbers 1-118, finite
coordinates and targets, non-empty molecules) and refuses the file, or drops and lists the
bad records with ``skip_invalid``. Opening checks the cheap invariants (schema, shapes,
offsets); reading checks what it reads without extra passes over the file: ``target`` its
values, ``concatenated`` (which every run goes through) the atoms. Errors name the file,
the store index and the record id.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from schnet_ipu.errors import UserError

log = logging.getLogger(__name__)

SCHEMA = "schnet-ipu-molecule-store"
SCHEMA_VERSION = 2  # the newest version this code writes: version 1 + forces/stress masks
READABLE_VERSIONS = (1, 2)

# Index = atomic number; "" at 0 so that ELEMENTS[z] is the symbol of z.
_SYMBOLS = (
    "H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge "
    "As Se Br Kr Rb Sr Y Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm "
    "Eu Gd Tb Dy Ho Er Tm Yb Lu Hf Ta W Re Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U "
    "Np Pu Am Cm Bk Cf Es Fm Md No Lr Rf Db Sg Bh Hs Mt Ds Rg Cn Nh Fl Mc Lv Ts Og"
)
ELEMENTS: tuple[str, ...] = ("", *_SYMBOLS.split())
ATOMIC_NUMBER: dict[str, int] = {s: i for i, s in enumerate(ELEMENTS) if s}
NUM_ELEMENTS = len(ELEMENTS)  # 119: atomref arrays are indexed by atomic number

# Chunking: 512 atoms per chunk (pos chunk = 6 KiB raw), so a random molecule read
# decompresses one or two small chunks. Measured on full QM9 (2 shared cores): LZF with 512-atom
# chunks reads ~11k molecules/s from a 28 MB file; gzip or 8k-atom chunks read 2-5x slower
# for a file only ~10% smaller.
ATOM_CHUNK = 512
MOLECULE_CHUNK = 65536
COMPRESSION = "lzf"
READ_SLICE = 1 << 24  # atoms per HDF5 read when reading a whole dataset


class StoreError(UserError, ValueError):
    """A store (or the input for one) that cannot be used; the message names the file."""


def write_store(
    path: str | Path,
    z: Sequence[Any] | np.ndarray,
    pos: Sequence[Any] | np.ndarray,
    targets: Mapping[str, Any],
    units: Mapping[str, str],
    *,
    offsets: Sequence[int] | np.ndarray | None = None,
    ids: Sequence[int] | np.ndarray | None = None,
    descriptions: Mapping[str, str] | None = None,
    attrs: Mapping[str, Any] | None = None,
    atomrefs: Mapping[str, Any] | None = None,
    forces: Sequence[Any] | np.ndarray | None = None,
    forces_unit: str = "",
    cell: Sequence[Any] | np.ndarray | None = None,
    pbc: Sequence[Any] | np.ndarray | None = None,
    stress: Sequence[Any] | np.ndarray | None = None,
    stress_unit: str = "",
    forces_mask: Sequence[bool] | np.ndarray | None = None,
    stress_mask: Sequence[bool] | np.ndarray | None = None,
    origin: str | None = None,
    skip_invalid: bool = False,
) -> Path:
    """Validate molecules and write them atomically (temp file in the same folder, renamed).

    ``z`` and ``pos`` are either per-molecule lists (``z[i]`` [n_i], ``pos[i]`` [n_i, 3]) or
    concatenated arrays ([A], [A, 3]) with ``offsets`` [M + 1]. Elements are atomic numbers or
    symbols ("C"). ``targets[name]`` is [M]; ``units[name]`` its unit. ``ids`` [M] default to
    0..M-1. ``forces`` (optional) are per-atom like ``pos`` ([A, 3], or per-molecule
    [n_i, 3]) in ``forces_unit``. ``cell`` [M, 3, 3] (rows are the lattice vectors; zeros
    for a molecule) and ``pbc`` bool [M, 3] make a periodic store; ``stress`` [M, 3, 3] (needs
    them) is in ``stress_unit``. ``forces_mask`` / ``stress_mask`` bool [M] (optional, with
    forces / stress): which frames carry them, the others holding zeros (partial labels;
    the store is then version 2). ``origin`` names the source files in error messages.
    Nothing is written when any check fails; with ``skip_invalid`` the bad records are
    dropped instead, listed in a warning and in the ``skipped_records`` attribute (their ids).
    """
    path = Path(path)
    where = f"{origin or path}"
    if offsets is None:
        counts = np.array([len(m) for m in z], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        z = np.concatenate([np.asarray(m).reshape(-1) for m in z]) if len(z) else np.zeros(0)
        pos = _per_atom(pos)
        forces = None if forces is None else _per_atom(forces)
    offsets = np.asarray(offsets, dtype=np.int64)
    num_molecules = len(offsets) - 1
    ids = np.arange(num_molecules, dtype=np.int64) if ids is None else np.asarray(ids, np.int64)

    def record(i: int) -> str:
        return f"{where}: record {int(ids[i])} (molecule {i})"

    if num_molecules < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise StoreError(f"{where}: offsets must start at 0 and not decrease (M >= 1)")
    if len(ids) != num_molecules:
        raise StoreError(f"{where}: {len(ids)} ids for {num_molecules} molecules")
    labels = np.asarray(z).reshape(-1)
    z_num = _atomic_numbers(labels)
    pos_arr = np.asarray(pos, dtype=np.float32)
    if pos_arr.shape != (offsets[-1], 3) or len(z_num) != offsets[-1]:
        raise StoreError(
            f"{where}: expected {offsets[-1]} atoms (z [A], pos [A, 3]), got z {len(z_num)}, "
            f"pos {pos_arr.shape}"
        )
    forces_arr = None if forces is None else np.asarray(forces, dtype=np.float32)
    if forces_arr is not None and forces_arr.shape != pos_arr.shape:
        raise StoreError(f"{where}: forces {forces_arr.shape} do not match pos {pos_arr.shape}")
    target_arrays = _check_targets(targets, units, num_molecules, where)
    periodic = _periodic_arrays(cell, pbc, stress, num_molecules, where)
    masks = _label_masks(
        {"forces": (forces_mask, forces_arr), "stress": (stress_mask, periodic[2])},
        num_molecules,
        where,
    )
    bad = invalid_records(z_num, pos_arr, offsets, target_arrays, labels, forces_arr)
    for m, reason in invalid_cells(*periodic).items():
        bad.setdefault(m, reason)
    if bad and not skip_invalid:
        first = min(bad)
        raise StoreError(
            f"{record(first)} {bad[first]} ({len(bad)} bad record(s) in all); fix the source "
            "or import with --skip-invalid to drop them"
        )
    if bad:
        for i in sorted(bad):
            log.warning("skipped %s %s", record(i), bad[i])
        if len(bad) == num_molecules:
            raise StoreError(f"{where}: every record is invalid; nothing to write")
        keep = np.setdiff1d(np.arange(num_molecules), sorted(bad))
        atoms = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in keep])
        z_num, pos_arr = z_num[atoms], pos_arr[atoms]
        forces_arr = None if forces_arr is None else forces_arr[atoms]
        target_arrays = {name: values[keep] for name, values in target_arrays.items()}
        periodic = tuple(None if values is None else values[keep] for values in periodic)
        masks = {name: mask[keep] for name, mask in masks.items()}
        attrs = {**(attrs or {}), "skipped_records": ids[sorted(bad)]}
        ids = ids[keep]
        offsets = np.concatenate([[0], np.cumsum(np.diff(offsets)[keep])])
        num_molecules = len(keep)
    ref_arrays = {}
    for name, ref in (atomrefs or {}).items():
        ref = np.asarray(ref, dtype=np.float64)
        if name not in target_arrays or ref.shape != (NUM_ELEMENTS,):
            raise StoreError(f"{where}: atomref {name!r} needs a target and shape [119]")
        ref_arrays[name] = ref

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with h5py.File(tmp, "w") as f:
            _dataset(f, "z", z_num.astype(np.uint8), (ATOM_CHUNK,))
            _dataset(f, "pos", pos_arr, (ATOM_CHUNK, 3))
            _dataset(f, "offsets", offsets, (MOLECULE_CHUNK,))
            _dataset(f, "ids", ids, (MOLECULE_CHUNK,))
            if forces_arr is not None:
                _dataset(f, "forces", forces_arr, (ATOM_CHUNK, 3)).attrs["unit"] = forces_unit
            cells, pbcs, stresses = periodic
            if cells is not None:
                _dataset(f, "cell", cells, (MOLECULE_CHUNK, 3, 3))
                _dataset(f, "pbc", pbcs, (MOLECULE_CHUNK, 3))
            if stresses is not None:
                _dataset(f, "stress", stresses, (MOLECULE_CHUNK, 3, 3)).attrs["unit"] = stress_unit
            for name, mask in masks.items():
                _dataset(f, f"{name}_mask", mask, (MOLECULE_CHUNK,))
            f.create_group("targets", track_order=True)
            for name, values in target_arrays.items():
                ds = _dataset(f, f"targets/{name}", values, (MOLECULE_CHUNK,))
                ds.attrs["unit"] = units[name]
                ds.attrs["description"] = (descriptions or {}).get(name, name)
            for name, ref in ref_arrays.items():
                f.create_dataset(f"atomrefs/{name}", data=ref)
            f.attrs.update(
                {
                    **root_attributes(attrs or {}, num_molecules, int(offsets[-1]), bool(masks)),
                    "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                }
            )
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _periodic_arrays(
    cell: Any, pbc: Any, stress: Any, num_molecules: int, where: str
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """(cell float64 [M, 3, 3], pbc bool [M, 3], stress float64 [M, 3, 3]) as given, each
    None when absent; StoreError for a wrong shape, pbc without cells or stress without them."""
    if cell is None:
        if pbc is not None or stress is not None:
            raise StoreError(f"{where}: pbc and stress need cells (cell [M, 3, 3])")
        return None, None, None
    cell = np.asarray(cell, dtype=np.float64)
    pbc = np.zeros((num_molecules, 3), bool) if pbc is None else np.asarray(pbc, dtype=bool)
    stress = None if stress is None else np.asarray(stress, dtype=np.float64)
    expected = {"cell": (cell, (3, 3)), "pbc": (pbc, (3,)), "stress": (stress, (3, 3))}
    for name, (values, shape) in expected.items():
        if values is not None and values.shape != (num_molecules, *shape):
            raise StoreError(f"{where}: {name} has shape {values.shape}, not [M, {shape}]")
    return cell, pbc, stress


def _label_masks(
    given: Mapping[str, tuple[Any, np.ndarray | None]], num_molecules: int, where: str
) -> dict[str, np.ndarray]:
    """label name -> bool [M] mask, for each mask given (``given[name]``: the mask or None,
    and the labels it masks); StoreError for a mask without its labels or of a wrong shape."""
    masks = {}
    for name, (mask, labels) in given.items():
        if mask is None:
            continue
        if labels is None:
            raise StoreError(f"{where}: a {name} mask needs {name}")
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (num_molecules,):
            raise StoreError(f"{where}: {name}_mask has shape {mask.shape}, not [M]")
        masks[name] = mask
    return masks


def invalid_cells(
    cell: np.ndarray | None, pbc: np.ndarray | None, stress: np.ndarray | None = None
) -> dict[int, str]:
    """Molecule index -> what is wrong with its cell: non-finite, periodic along a zero
    lattice vector, or (periodic) singular; or a non-finite stress. cell [M, 3, 3], pbc
    [M, 3], stress [M, 3, 3] or None (a store without cells: nothing to check)."""
    if cell is None:
        return {}
    reasons: dict[int, str] = {}
    finite = np.isfinite(cell).all(axis=(1, 2))
    for m in np.flatnonzero(~finite).tolist():
        reasons[m] = "has a non-finite (NaN/inf) cell"
    safe = np.where(finite[:, None, None], cell, 0.0)
    empty = np.linalg.norm(safe, axis=2) == 0  # [M, 3] zero lattice vectors
    for m in np.flatnonzero((pbc & empty).any(axis=1) & finite).tolist():
        reasons[m] = f"is periodic (pbc={pbc[m].tolist()}) along a zero cell vector"
    volume = np.abs(np.linalg.det(safe))
    scale = np.prod(np.maximum(np.linalg.norm(safe, axis=2), 1e-300), axis=1)
    singular = pbc.any(axis=1) & ~(pbc & empty).any(axis=1) & (volume <= 1e-9 * scale)
    for m in np.flatnonzero(singular & finite).tolist():
        reasons[m] = f"has a singular cell (volume {volume[m]:.3g} A^3)"
    for m, reason in invalid_stress(stress).items():
        reasons.setdefault(m, reason)
    return reasons


def invalid_stress(stress: np.ndarray | None) -> dict[int, str]:
    """Molecule index -> what is wrong, for each non-finite stress [M, 3, 3] (None: none)."""
    if stress is None:
        return {}
    return {
        m: "has a non-finite (NaN/inf) stress"
        for m in np.flatnonzero(~np.isfinite(stress).all(axis=(1, 2))).tolist()
    }


def root_attributes(
    attrs: Mapping[str, Any], molecules: int, atoms: int, label_masks: bool = False
) -> dict[str, Any]:
    """A store's root attributes: defaults, the importer's ``attrs``, then the schema, its
    version (2 with label masks, else 1: see the module docstring) and the counts (which
    ``attrs`` cannot override)."""
    return {
        "source": "unknown",
        "source_version": "",
        "synthetic": False,
        **attrs,
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION if label_masks else READABLE_VERSIONS[0],
        "num_molecules": molecules,
        "num_atoms": atoms,
    }


def _per_atom(per_molecule: Sequence[Any]) -> np.ndarray:
    """Per-molecule [n_i, 3] arrays -> one float32 [A, 3] array."""
    if not len(per_molecule):
        return np.zeros((0, 3), dtype=np.float32)
    return np.concatenate([np.asarray(p, dtype=np.float32).reshape(-1, 3) for p in per_molecule])


def _atomic_numbers(z: np.ndarray) -> np.ndarray:
    """Symbols or numbers [A] -> int64 atomic numbers [A]; 0 for an unknown symbol or a
    non-integral number (:func:`invalid_records` reports those)."""
    if z.dtype.kind in "USO":
        symbols, inverse = np.unique(z.astype(str), return_inverse=True)
        known = np.array([ATOMIC_NUMBER.get(s.strip(), 0) for s in symbols], dtype=np.int64)
        return known[inverse]
    numbers = np.where(np.isfinite(z), z, 0).astype(np.int64)
    return np.where(numbers == z, numbers, 0)


def invalid_records(
    z: np.ndarray,
    pos: np.ndarray | None,
    offsets: np.ndarray,
    targets: Mapping[str, np.ndarray] | None = None,
    labels: np.ndarray | None = None,
    forces: np.ndarray | None = None,
) -> dict[int, str]:
    """Molecule index -> what is wrong with it, for every molecule with no atoms, an atomic
    number outside 1-118, a non-finite coordinate, force or target.

    z: int [A]; pos: float [A, 3]; offsets: int64 [M + 1]; targets: name -> float [M];
    labels: [A] the elements as given (symbols or numbers), for the messages; forces: float
    [A, 3] or None.
    """
    labels = z if labels is None else labels
    reasons: dict[int, str] = {}

    def note(atoms: np.ndarray, describe) -> None:
        molecules = np.searchsorted(offsets, atoms, side="right") - 1
        unique, first = np.unique(molecules, return_index=True)
        for m, atom in np.column_stack((unique, atoms[first])).tolist():
            reasons.setdefault(m, describe(atom))

    for m in np.flatnonzero(np.diff(offsets) == 0).tolist():
        reasons[m] = "has no atoms"
    if len(z) and (z.min() < 1 or z.max() >= NUM_ELEMENTS):  # one pass when all is well
        note(
            np.flatnonzero((z < 1) | (z >= NUM_ELEMENTS)),
            lambda atom: _unknown_element(labels[atom]),
        )
    # NaN or inf anywhere makes the sum non-finite: one pass when all is well
    if pos is not None and not np.isfinite(pos.sum(dtype=np.float64)):
        note(
            np.flatnonzero(~np.isfinite(pos).all(axis=1)),
            lambda atom: "has non-finite (NaN/inf) coordinates",
        )
    if forces is not None and not np.isfinite(forces.sum(dtype=np.float64)):
        note(
            np.flatnonzero(~np.isfinite(forces).all(axis=1)),
            lambda atom: "has non-finite (NaN/inf) forces",
        )
    for name, values in (targets or {}).items():
        for m, reason in invalid_targets(name, values).items():
            reasons.setdefault(m, reason)
    return reasons


def _unknown_element(label: Any) -> str:
    if isinstance(label, (str, np.str_, bytes)):
        return f"has an unknown element symbol {str(label).strip()!r}"
    return f"has an unknown element (atomic number {label}; elements are 1-118)"


def invalid_targets(name: str, values: np.ndarray) -> dict[int, str]:
    """Molecule index -> what is wrong, for each non-finite entry of target ``values`` [M]."""
    return {
        m: f"has a non-finite target {name!r} ({values[m]})"
        for m in np.flatnonzero(~np.isfinite(values)).tolist()
    }


def _check_targets(targets, units, num_molecules, where) -> dict[str, np.ndarray]:
    if set(targets) != set(units):
        raise StoreError(f"{where}: targets {sorted(targets)} and units {sorted(units)} differ")
    arrays = {}
    for name, values in targets.items():
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (num_molecules,):
            raise StoreError(f"{where}: target {name!r} has shape {values.shape}, not [M]")
        arrays[name] = values
    return arrays


def byte_shuffle(dtype: np.dtype) -> bool:
    """Whether a dataset of ``dtype`` is byte-shuffled before LZF: multi-byte integers and
    float64 targets, not float32 coordinates or forces. Shuffling QM9's positions saved 7% of
    their 28 MB but made reading them all 4x slower (117 vs 29 ms on the 2-core box)."""
    dtype = np.dtype(dtype)
    return dtype.itemsize > 1 and dtype != np.float32


def _dataset(f: h5py.File, name: str, data: np.ndarray, chunks: tuple[int, ...]) -> h5py.Dataset:
    chunks = (min(chunks[0], max(len(data), 1)), *chunks[1:])
    return f.create_dataset(
        name, data=data, chunks=chunks, compression=COMPRESSION, shuffle=byte_shuffle(data.dtype)
    )


class MoleculeStore:
    """Read access to a store written by :func:`write_store`.

    Validated on construction (a missing, corrupt, foreign or other-version file raises
    :class:`StoreError` naming it). The HDF5 handle opens on the first molecule read in each
    process, so the object pickles cheaply into DataLoader workers (handle and cache dropped).
    """

    def __init__(self, path: str | Path, cache: bool = True) -> None:
        self.path = Path(path)
        self.cache_enabled = cache
        self._handle: h5py.File | None = None
        self._pid: int | None = None
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._targets: dict[str, np.ndarray] = {}
        self.cache_hits = 0
        self.cache_misses = 0
        self._read_metadata()

    def _read_metadata(self) -> None:
        if not self.path.is_file():
            raise StoreError(f"{self.path}: store file not found")
        try:
            with h5py.File(self.path, "r") as f:
                attrs = {k: _plain(v) for k, v in f.attrs.items()}
                if attrs.get("schema") != SCHEMA:
                    raise StoreError(
                        f"{self.path}: not a schnet-ipu molecule store (schema attribute "
                        f"{attrs.get('schema')!r}, expected {SCHEMA!r})"
                    )
                if attrs.get("schema_version") not in READABLE_VERSIONS:
                    raise StoreError(
                        f"{self.path}: written with store schema version "
                        f"{attrs.get('schema_version')}, this code reads versions "
                        f"{' and '.join(map(str, READABLE_VERSIONS))}; re-import the data"
                    )
                if attrs.get("complete", True) is False:
                    raise StoreError(
                        f"{self.path}: incomplete store (its writing was interrupted); "
                        "rerun the import or generation to resume it"
                    )
                self.offsets = f["offsets"][:]
                self.ids = f["ids"][:]
                self._units = {n: str(_plain(d.attrs["unit"])) for n, d in f["targets"].items()}
                self._atomrefs = {n: d[:] for n, d in f.get("atomrefs", {}).items()}
                self.forces_unit = str(_plain(f["forces"].attrs["unit"])) if "forces" in f else None
                self.periodic = "cell" in f
                self.stress_unit = str(_plain(f["stress"].attrs["unit"])) if "stress" in f else None
                self._masks = {
                    name: f[f"{name}_mask"][:]
                    for name in ("forces", "stress")
                    if f"{name}_mask" in f
                }
                shapes = (f["z"].shape, f["pos"].shape)
        except StoreError:
            raise
        except (OSError, KeyError, ValueError) as err:
            raise StoreError(
                f"{self.path}: unreadable store (not HDF5, truncated or corrupt): {err}"
            ) from err
        num_molecules, num_atoms = len(self.offsets) - 1, int(self.offsets[-1])
        if (
            shapes != ((num_atoms,), (num_atoms, 3))
            or len(self.ids) != num_molecules
            or attrs.get("num_molecules") != num_molecules
        ):
            raise StoreError(f"{self.path}: inconsistent store (offsets, z, pos, ids disagree)")
        if any(mask.shape != (num_molecules,) for mask in self._masks.values()):
            raise StoreError(f"{self.path}: inconsistent store (a label mask is not [M])")
        self.attrs: dict[str, Any] = attrs
        self.num_atoms: np.ndarray = np.diff(self.offsets)
        if self.offsets[0] != 0 or np.any(self.num_atoms <= 0):
            i = int(np.flatnonzero(self.num_atoms <= 0)[0]) if self.offsets[0] == 0 else 0
            raise StoreError(
                f"{self.record_name(i)}: offsets do not give it any atoms (offsets must start at 0 "
                "and increase); the store is damaged, re-import it"
            )

    def record_name(self, i: int) -> str:
        """How errors name molecule i: the file, the store index and the record id."""
        return f"{self.path}: molecule {i} (record {int(self.ids[i])})"

    def _refuse(self, bad: dict[int, str]) -> None:
        if bad:
            first = min(bad)
            raise StoreError(
                f"{self.record_name(first)} {bad[first]} ({len(bad)} bad record(s) in all); the "
                "store is damaged, re-import it (--skip-invalid drops bad records)"
            )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __repr__(self) -> str:
        return f"MoleculeStore({str(self.path)!r}, {len(self)} molecules)"

    @property
    def target_names(self) -> list[str]:
        return list(self._units)

    def unit(self, name: str) -> str:
        self._check_target(name)
        return self._units[name]

    def target(self, name: str) -> np.ndarray:
        """float64 [M] values of one target, in ``unit(name)``."""
        self._check_target(name)
        if name not in self._targets:
            values = self._file()[f"targets/{name}"][:]
            self._refuse(invalid_targets(name, values))
            self._targets[name] = values
        return self._targets[name]

    def atomref(self, name: str) -> np.ndarray | None:
        """float64 [119] per-element reference for ``name`` (index = atomic number), or None."""
        self._check_target(name)
        return self._atomrefs.get(name)

    def molecule(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Molecule i: (z uint8 [n], pos float32 [n, 3] in Angstrom). Cached when enabled."""
        i = int(i)
        cached = self._cache.get(i)
        if cached is not None:
            self.cache_hits += 1
            return cached
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: molecule {i} out of range [0, {len(self)})")
        self.cache_misses += 1
        self._file()
        if not self.cache_enabled:
            start, stop = self.offsets[i], self.offsets[i + 1]
            return self._z[start:stop], self._pos[start:stop]
        self._cache_block(i)
        return self._cache[i]

    def _cache_block(self, i: int) -> None:
        """Read the compressed chunks holding molecule i once and cache every molecule that lies
        wholly inside them: decompressing a chunk costs the same for one molecule or all of its
        ~30 (QM9), so a shuffled first epoch reads each chunk about once, not once per molecule.
        """
        chunk = self._pos.chunks[0] if self._pos.chunks else ATOM_CHUNK
        start, stop = self.offsets[i], self.offsets[i + 1]
        lo = start // chunk * chunk
        hi = -(-stop // chunk) * chunk
        first = int(np.searchsorted(self.offsets, lo, side="left"))  # starts at or after lo
        last = int(np.searchsorted(self.offsets, hi, side="right")) - 1  # ends at or before hi
        base = self.offsets[first]
        z, pos = self._z[base : self.offsets[last]], self._pos[base : self.offsets[last]]
        for m in range(first, last):
            if m not in self._cache:
                a, b = self.offsets[m] - base, self.offsets[m + 1] - base
                self._cache[m] = (z[a:b], pos[a:b])

    @property
    def has_forces(self) -> bool:
        return self.forces_unit is not None

    def forces(self) -> np.ndarray:
        """All per-atom forces at once: float32 [A, 3] in ``forces_unit`` (split by offsets)."""
        if not self.has_forces:
            raise StoreError(f"{self.path}: the store holds no forces; re-import them")
        return self._read_all("forces")

    @property
    def has_stress(self) -> bool:
        return self.stress_unit is not None

    @property
    def partial_labels(self) -> tuple[str, ...]:
        """The labels ("forces", "stress") only some frames carry (those with a mask)."""
        return tuple(self._masks)

    def forces_mask(self) -> np.ndarray:
        """bool [M]: which frames carry forces (all, or none for a store without them)."""
        if "forces" in self._masks:
            return self._masks["forces"]
        return np.full(len(self), self.has_forces)

    def stress_mask(self) -> np.ndarray:
        """bool [M]: which frames carry stress; without a mask, every frame with pbc when
        the store holds stress (molecules hold zeros), else none."""
        if "stress" in self._masks:
            return self._masks["stress"]
        if not self.has_stress:
            return np.zeros(len(self), dtype=bool)
        return self.cells()[1].any(axis=1)

    def cells(self) -> tuple[np.ndarray, np.ndarray]:
        """Every frame's (cell float64 [M, 3, 3], rows the lattice vectors in Angstrom, and
        pbc bool [M, 3]); a store without cells (molecules) gives zero cells, pbc all False.
        Checked as read: a damaged cell raises naming its record."""
        if not self.periodic:
            return np.zeros((len(self), 3, 3)), np.zeros((len(self), 3), dtype=bool)
        f = self._file()
        cell, pbc = f["cell"][:], f["pbc"][:]
        self._refuse(invalid_cells(cell, pbc))
        return cell, pbc

    def stress(self) -> np.ndarray:
        """Every frame's stress, float64 [M, 3, 3] in ``stress_unit`` (ASE's convention)."""
        if not self.has_stress:
            raise StoreError(f"{self.path}: the store holds no stress; re-import it with stress")
        values = self._file()["stress"][:]
        self._refuse(invalid_stress(values))
        return values

    def atomic_numbers(self) -> np.ndarray:
        """All atomic numbers at once, uint8 [A] (without reading the positions). Checked as
        read: an atomic number outside 1-118 raises naming its record."""
        z = self._read_all("z")
        self._refuse(invalid_records(z, None, self.offsets))
        return z

    def concatenated(self) -> tuple[np.ndarray, np.ndarray]:
        """All atoms at once: (z uint8 [A], pos float32 [A, 3]); split them with ``offsets``.
        Checked as read: a bad atomic number or coordinate raises naming its record."""
        z, pos = self._read_all("z"), self._read_all("pos")
        self._refuse(invalid_records(z, pos, self.offsets))
        return z, pos

    def _read_all(self, name: str) -> np.ndarray:
        """A whole per-atom dataset, read in slices of READ_SLICE atoms: one HDF5 read over all
        570k chunks of a 290M-atom store holds ~3.5 GB of HDF5 bookkeeping at its peak,
        slices ~0.25 GB."""
        dataset = self._file()[name]
        out = np.empty(dataset.shape, dtype=dataset.dtype)
        for start in range(0, len(out), READ_SLICE):
            part = np.s_[start : start + READ_SLICE]
            dataset.read_direct(out, part, part)
        return out

    def _check_target(self, name: str) -> None:
        if name not in self._units:
            raise StoreError(
                f"{self.path}: no target {name!r}; targets: {', '.join(self.target_names)}"
            )

    def _file(self) -> h5py.File:
        if self._handle is None or self._pid != os.getpid():
            self._handle = h5py.File(self.path, "r")
            self._z, self._pos = self._handle["z"], self._handle["pos"]
            self._pid = os.getpid()
        return self._handle

    def close(self) -> None:
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_handle=None, _pid=None, _cache={}, cache_hits=0, cache_misses=0)
        state.pop("_z", None)
        state.pop("_pos", None)
        return state


def _plain(value: Any) -> Any:
    """HDF5 attribute -> plain Python (numpy scalars to int/float/bool, bytes to str)."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value
