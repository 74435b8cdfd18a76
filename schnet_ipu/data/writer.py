"""Streaming store writer: molecules appended chunk by chunk, never all in memory at once.

    writer = StoreWriter(path, num_atoms, units={"energy": "kcal/mol"}, key="params...")
    for first in range(writer.written, len(num_atoms), chunk):  # resumes where it stopped
        writer.append(z, pos, {"energy": y}, ids)  # the next molecules, in order
    writer.finish()  # renames the temp file into place

The datasets are preallocated from the known atom counts (``num_atoms`` [M]) in a temp file
``.<name>.partial`` beside the store, in the schema of :mod:`schnet_ipu.data.store`. After
each chunk the file is flushed and its ``written_molecules`` attribute advanced, so a killed
or disk-full run leaves a partial file that a new writer with the same ``key`` resumes, and
that :class:`MoleculeStore` refuses (``complete`` is False). Only ``finish`` renames it to
the store path. A chunk with a bad record (unknown element, non-finite value) is refused
before anything of it is written, and closing the writer unfinished then deletes the partial
file: bad input leaves nothing behind.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .store import (
    ATOM_CHUNK,
    COMPRESSION,
    MOLECULE_CHUNK,
    StoreError,
    byte_shuffle,
    invalid_cells,
    invalid_records,
    root_attributes,
)

log = logging.getLogger(__name__)


def partial_path(path: str | Path) -> Path:
    """The temp file a streaming write of ``path`` goes to until it is complete."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


class StoreWriter:
    """Writes a store of ``len(num_atoms)`` molecules in order, resumably.

    Args:
        path: the final store path (written only by :meth:`finish`).
        num_atoms: int [M] atoms of every molecule, in store order.
        units: target name -> unit; every :meth:`append` gives each target.
        key: identifies the content (source and parameters); a partial file with the same key
            and counts is resumed, any other partial file is discarded with a warning.
        descriptions, attrs: as for :func:`schnet_ipu.data.store.write_store`.
        periodic: the store holds cells and pbc (every :meth:`append` gives them).
        stress_unit: the store holds stress in this unit (periodic stores only).
    """

    def __init__(
        self,
        path: str | Path,
        num_atoms: np.ndarray,
        units: Mapping[str, str],
        key: str,
        descriptions: Mapping[str, str] | None = None,
        attrs: Mapping[str, Any] | None = None,
        periodic: bool = False,
        stress_unit: str | None = None,
    ) -> None:
        if stress_unit is not None and not periodic:
            raise StoreError(f"{path}: a store with stress needs cells (periodic=True)")
        self.periodic, self.stress_unit = periodic, stress_unit
        self.path = Path(path)
        self.tmp = partial_path(self.path)
        counts = np.asarray(num_atoms, dtype=np.int64)
        if counts.ndim != 1 or len(counts) < 1 or counts.min() < 1:
            raise StoreError(f"{self.path}: need >= 1 molecule, each with >= 1 atom")
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.units = dict(units)
        self.key = key
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._resume() or self._create(descriptions or {}, attrs or {})
        self.written = int(self._file.attrs["written_molecules"])
        self.refused = False  # a chunk with a bad record was refused

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _resume(self) -> h5py.File | None:
        if not self.tmp.exists():
            return None
        try:
            f = h5py.File(self.tmp, "r+")
        except OSError as err:
            log.warning("%s is unreadable (%s); starting over", self.tmp, err)
            self.tmp.unlink()
            return None
        same = f.attrs.get("resume_key") == self.key and np.array_equal(
            f["offsets"][:], self.offsets
        )
        if same:
            log.info(
                "resuming %s at molecule %d of %d",
                self.tmp,
                int(f.attrs["written_molecules"]),
                len(self),
            )
            return f
        f.close()
        log.warning("%s holds another dataset (different parameters); starting over", self.tmp)
        self.tmp.unlink()
        return None

    def _create(self, descriptions: Mapping[str, str], attrs: Mapping[str, Any]) -> h5py.File:
        f = h5py.File(self.tmp, "w")
        molecules, atoms = len(self), int(self.offsets[-1])

        def dataset(name: str, shape: tuple[int, ...], dtype, chunk: int) -> h5py.Dataset:
            chunks = (min(chunk, shape[0]), *shape[1:])
            return f.create_dataset(
                name,
                shape=shape,
                dtype=dtype,
                chunks=chunks,
                compression=COMPRESSION,
                shuffle=byte_shuffle(dtype),
            )

        dataset("z", (atoms,), np.uint8, ATOM_CHUNK)
        dataset("pos", (atoms, 3), np.float32, ATOM_CHUNK)
        dataset("offsets", (molecules + 1,), np.int64, MOLECULE_CHUNK)[:] = self.offsets
        dataset("ids", (molecules,), np.int64, MOLECULE_CHUNK)
        if self.periodic:
            dataset("cell", (molecules, 3, 3), np.float64, MOLECULE_CHUNK)
            dataset("pbc", (molecules, 3), np.bool_, MOLECULE_CHUNK)
        if self.stress_unit is not None:
            stress = dataset("stress", (molecules, 3, 3), np.float64, MOLECULE_CHUNK)
            stress.attrs["unit"] = self.stress_unit
        f.create_group("targets", track_order=True)
        for name, unit in self.units.items():
            ds = dataset(f"targets/{name}", (molecules,), np.float64, MOLECULE_CHUNK)
            ds.attrs["unit"] = unit
            ds.attrs["description"] = descriptions.get(name, name)
        f.attrs.update(
            {
                **root_attributes(attrs, molecules, atoms),
                "complete": False,
                "written_molecules": 0,
                "resume_key": self.key,
            }
        )
        f.flush()
        return f

    def append(
        self,
        z: np.ndarray,
        pos: np.ndarray,
        targets: Mapping[str, np.ndarray],
        ids: np.ndarray,
        cell: np.ndarray | None = None,
        pbc: np.ndarray | None = None,
        stress: np.ndarray | None = None,
    ) -> None:
        """Write the next ``m = len(ids)`` molecules: z [a], pos [a, 3] (a = their atoms),
        ``targets[name]`` [m]; periodic stores also cell [m, 3, 3] and pbc bool [m, 3], and
        stress [m, 3, 3] when the store has a stress unit. Checked like ``write_store``:
        sizes, elements, finite values, cells."""
        first = self.written
        stop = first + len(ids)
        if stop > len(self):
            raise StoreError(f"{self.path}: {stop} molecules appended, {len(self)} planned")
        lo, hi = int(self.offsets[first]), int(self.offsets[stop])
        z = np.asarray(z).reshape(-1)
        pos = np.asarray(pos, dtype=np.float32).reshape(-1, 3)
        ids = np.asarray(ids, dtype=np.int64)
        where = f"{self.path}: molecules {first}..{stop - 1}"
        if len(z) != hi - lo or len(pos) != hi - lo:
            raise StoreError(f"{where}: expected {hi - lo} atoms, got z {len(z)}, pos {len(pos)}")
        if set(targets) != set(self.units):
            raise StoreError(f"{where}: targets {sorted(targets)}, expected {sorted(self.units)}")
        values = {name: np.asarray(v, dtype=np.float64) for name, v in targets.items()}
        for name, v in values.items():
            if v.shape != (len(ids),):
                raise StoreError(f"{where}: target {name!r} has shape {v.shape}, not [{len(ids)}]")
        bad = invalid_records(z, pos, self.offsets[first : stop + 1] - lo, values)
        periodic = self._periodic(where, len(ids), cell, pbc, stress)
        for m, reason in invalid_cells(*periodic).items():
            bad.setdefault(m, reason)
        if bad:
            self.refused = True
            m = min(bad)
            raise StoreError(f"{self.path}: record {int(ids[m])} (molecule {first + m}) {bad[m]}")
        f = self._file
        for name, v in values.items():
            f[f"targets/{name}"][first:stop] = v
        f["z"][lo:hi] = z.astype(np.uint8)
        f["pos"][lo:hi] = pos
        f["ids"][first:stop] = ids
        for name, values in zip(("cell", "pbc", "stress"), periodic):
            if values is not None:
                f[name][first:stop] = values
        f.flush()  # the data reaches the file before the progress mark that vouches for it
        f.attrs["written_molecules"] = stop
        f.flush()
        self.written = stop

    def _periodic(
        self, where: str, count: int, cell: Any, pbc: Any, stress: Any
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """(cell [m, 3, 3], pbc [m, 3], stress [m, 3, 3]) of an append, None where the store
        has none; StoreError when what is given does not match what the store holds."""
        given = (cell is not None, pbc is not None, stress is not None)
        if given != (self.periodic, self.periodic, self.stress_unit is not None):
            raise StoreError(
                f"{where}: this store takes cell and pbc: {self.periodic}, stress: "
                f"{self.stress_unit is not None}; got cell, pbc, stress: {given}"
            )
        arrays = (
            None if cell is None else np.asarray(cell, dtype=np.float64),
            None if pbc is None else np.asarray(pbc, dtype=bool),
            None if stress is None else np.asarray(stress, dtype=np.float64),
        )
        for name, values, shape in zip(("cell", "pbc", "stress"), arrays, [(3, 3), (3,), (3, 3)]):
            if values is not None and values.shape != (count, *shape):
                raise StoreError(f"{where}: {name} is {values.shape}, not [{count}, {shape}]")
        return arrays

    def finish(self, extra_attrs: Mapping[str, Any] | None = None) -> Path:
        """Mark the store complete and rename it into place; every molecule must be written."""
        if self.written != len(self):
            raise StoreError(f"{self.path}: only {self.written} of {len(self)} molecules written")
        f = self._file
        f.attrs.update(dict(extra_attrs or {}))
        for name in ("written_molecules", "resume_key"):
            del f.attrs[name]
        f.attrs["complete"] = True
        f.attrs["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
        f.close()
        os.replace(self.tmp, self.path)
        return self.path

    def close(self) -> None:
        """Close the partial file: kept for resuming, unless a chunk was refused as bad input
        (a resume would meet the same record again), then deleted: bad input leaves nothing."""
        if self._file.id.valid:
            self._file.close()
        if self.refused:
            self.tmp.unlink(missing_ok=True)
