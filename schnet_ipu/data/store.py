"""Reading the HDF5 molecule store (layout: :mod:`.layout`): written once, read often.

Reads are lazy and per process: :class:`MoleculeStore` keeps only small metadata until the
first molecule is read, opens the file then, and re-opens it after a fork. A cache miss reads
the whole compressed chunk(s) holding the molecule and keeps every molecule inside them in a
memory cache (the second level after the compressed file).

Validation: opening checks the cheap invariants (schema, shapes, offsets); reading checks
what it reads without extra passes over the file (:mod:`.checks`): ``target`` its values,
``concatenated`` (which every run goes through) the atoms. Errors name the file, the store
index and the record id. The writers (:mod:`.writer`) check every record before writing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .checks import StoreError, invalid_cells, invalid_records, invalid_stress, invalid_targets
from .store_format import ATOM_CHUNK, READABLE_VERSIONS, SCHEMA

READ_SLICE = 1 << 24  # atoms per HDF5 read when reading a whole dataset


class MoleculeStore:
    """Read access to a store written by :mod:`.writer`.

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

    def atoms_of(self, molecules: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The atoms of ``molecules`` only (int [K], ascending store indices): (z uint8 [a],
        pos float32 [a, 3], offsets int64 [K + 1] splitting them), read in spans
        (:meth:`_read_rows`). Checked as read, like :meth:`concatenated`."""
        molecules = np.asarray(molecules, dtype=np.int64)
        z, pos = self._read_rows("z", molecules), self._read_rows("pos", molecules)
        offsets = np.concatenate([[0], np.cumsum(self.num_atoms[molecules])])
        bad = invalid_records(z, pos, offsets)
        self._refuse({int(molecules[m]): reason for m, reason in bad.items()})
        return z, pos, offsets

    def forces_of(self, molecules: np.ndarray) -> np.ndarray:
        """The forces of ``molecules`` only (as :meth:`atoms_of` reads atoms), float32 [a, 3]."""
        if not self.has_forces:
            raise StoreError(f"{self.path}: the store holds no forces; re-import them")
        return self._read_rows("forces", np.asarray(molecules, dtype=np.int64))

    def _read_rows(self, name: str, molecules: np.ndarray) -> np.ndarray:
        """A per-atom dataset's rows of ``molecules`` (ascending), molecule after molecule.

        The molecules are taken in windows of READ_SLICE atoms of the file; each window is one
        read from its first wanted atom to its last, so molecules that lie together cost one
        read, a window without any costs none, and memory holds the rows kept plus one
        window's span. A span without gaps is read straight into the result.
        """
        dataset = self._file()[name]
        starts, sizes = self.offsets[molecules], self.num_atoms[molecules]
        out = np.empty((int(sizes.sum()), *dataset.shape[1:]), dtype=dataset.dtype)
        windows = np.flatnonzero(np.diff(starts // READ_SLICE)) + 1
        written = 0
        for first, last in zip([0, *windows], [*windows, len(molecules)]):
            lo, hi = int(starts[first]), int(starts[last - 1] + sizes[last - 1])
            count = int(sizes[first:last].sum())
            target = np.s_[written : written + count]
            if hi - lo == count:  # no gap: straight into place
                dataset.read_direct(out, np.s_[lo:hi], target)
            else:
                out[target] = dataset[lo:hi][ranges_of(starts[first:last] - lo, sizes[first:last])]
            written += count
        return out

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


def ranges_of(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64 [sum of lengths]: ``arange(s, s + l)`` for every (s, l) of ``starts`` /
    ``lengths`` [K], one after the other."""
    lengths = np.asarray(lengths, dtype=np.int64)
    before = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - before, lengths) + np.arange(
        lengths.sum()
    )


def _plain(value: Any) -> Any:
    """HDF5 attribute -> plain Python (numpy scalars to int/float/bool, bytes to str)."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value
