"""Writing stores: all at once (:func:`write_store`) or streamed chunk by chunk
(:class:`StoreWriter`). Both check every record first (:mod:`.checks`) and lay the file out
through :mod:`.layout`, in a temp file beside the store that only a complete write renames
into place.

Streaming, for stores too large for memory::

    writer = StoreWriter(path, num_atoms, units={"energy": "kcal/mol"}, key="params...")
    for first in range(writer.written, len(num_atoms), chunk):  # resumes where it stopped
        writer.append(z, pos, {"energy": y}, ids)  # the next molecules, in order
    writer.finish()  # renames the temp file into place

The datasets are preallocated from the known atom counts (``num_atoms`` [M]) in a temp file
``.<name>.partial`` beside the store. After each chunk the file is flushed and its
``written_molecules`` attribute advanced, so a killed or disk-full run leaves a partial file
that a new writer with the same ``key`` resumes, and that :class:`MoleculeStore` refuses
(``complete`` is False). Only ``finish`` renames it to the store path. A chunk with a bad
record (unknown element, non-finite value) is refused before anything of it is written, and
closing the writer unfinished then deletes the partial file: bad input leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .checks import (
    StoreError,
    checked_masks,
    checked_periodic,
    checked_targets,
    invalid_frames,
)
from .elements import NUM_ELEMENTS, atomic_numbers
from .store_format import Frames, Header, create_layout, mark_created, write_frames

log = logging.getLogger(__name__)


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
    the store is then version 2). ``atomrefs[name]`` [119] (optional): a target's
    per-element reference. ``origin`` names the source files in error messages.
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
    if num_molecules < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise StoreError(f"{where}: offsets must start at 0 and not decrease (M >= 1)")
    if len(ids) != num_molecules:
        raise StoreError(f"{where}: {len(ids)} ids for {num_molecules} molecules")
    labels = np.asarray(z).reshape(-1)
    z_num = atomic_numbers(labels)
    pos_arr = np.asarray(pos, dtype=np.float32)
    if pos_arr.shape != (offsets[-1], 3) or len(z_num) != offsets[-1]:
        raise StoreError(
            f"{where}: expected {offsets[-1]} atoms (z [A], pos [A, 3]), got z {len(z_num)}, "
            f"pos {pos_arr.shape}"
        )
    forces_arr = None if forces is None else np.asarray(forces, dtype=np.float32)
    if forces_arr is not None and forces_arr.shape != pos_arr.shape:
        raise StoreError(f"{where}: forces {forces_arr.shape} do not match pos {pos_arr.shape}")
    target_arrays = checked_targets(targets, units, num_molecules, where)
    cell, pbc, stress = checked_periodic(cell, pbc, stress, num_molecules, where)
    masks = checked_masks(
        {"forces": (forces_mask, forces_arr), "stress": (stress_mask, stress)}, num_molecules, where
    )
    frames = Frames(
        offsets, z_num, pos_arr, ids, target_arrays, forces_arr, cell, pbc, stress, masks
    )
    frames, skipped = _without_invalid(frames, labels, where, skip_invalid)
    ref_arrays = {}
    for name, ref in (atomrefs or {}).items():
        ref = np.asarray(ref, dtype=np.float64)
        if name not in target_arrays or ref.shape != (NUM_ELEMENTS,):
            raise StoreError(f"{where}: atomref {name!r} needs a target and shape [119]")
        ref_arrays[name] = ref
    header = Header(
        offsets=frames.offsets,
        units={name: units[name] for name in target_arrays},
        descriptions=descriptions or {},
        attrs={**(attrs or {}), **skipped},
        forces_unit=None if forces_arr is None else forces_unit,
        periodic=cell is not None,
        stress_unit=None if stress is None else stress_unit,
        label_masks=tuple(masks),
        atomrefs=ref_arrays,
    )
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with h5py.File(tmp, "w") as f:
            create_layout(f, header)
            write_frames(f, frames, 0, 0)
            mark_created(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _without_invalid(
    frames: Frames, labels: np.ndarray, where: str, skip_invalid: bool
) -> tuple[Frames, dict[str, np.ndarray]]:
    """``frames`` when every record is valid; else StoreError naming the first bad one, or
    with ``skip_invalid`` the valid frames (the others logged) and the ``skipped_records``
    root attribute (their ids)."""
    bad = invalid_frames(frames, labels)
    if not bad:
        return frames, {}

    def record(i: int) -> str:
        return f"{where}: record {int(frames.ids[i])} (molecule {i})"

    if not skip_invalid:
        first = min(bad)
        raise StoreError(
            f"{record(first)} {bad[first]} ({len(bad)} bad record(s) in all); fix the source "
            "or import with --skip-invalid to drop them"
        )
    for i in sorted(bad):
        log.warning("skipped %s %s", record(i), bad[i])
    if len(bad) == len(frames):
        raise StoreError(f"{where}: every record is invalid; nothing to write")
    keep = np.setdiff1d(np.arange(len(frames)), sorted(bad))
    return frames.select(keep), {"skipped_records": frames.ids[sorted(bad)]}


def _per_atom(per_molecule: Sequence[Any]) -> np.ndarray:
    """Per-molecule [n_i, 3] arrays -> one float32 [A, 3] array."""
    if not len(per_molecule):
        return np.zeros((0, 3), dtype=np.float32)
    return np.concatenate([np.asarray(p, dtype=np.float32).reshape(-1, 3) for p in per_molecule])


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
        descriptions, attrs: as for :func:`write_store`.
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
        header = Header(
            offsets=self.offsets,
            units=self.units,
            descriptions=descriptions,
            attrs=attrs,
            periodic=self.periodic,
            stress_unit=self.stress_unit,
        )
        create_layout(f, header)
        f.attrs.update({"complete": False, "written_molecules": 0, "resume_key": self.key})
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
        cell, pbc, stress = self._periodic(where, len(ids), cell, pbc, stress)
        offsets = self.offsets[first : stop + 1] - lo
        frames = Frames(offsets, z, pos, ids, values, cell=cell, pbc=pbc, stress=stress)
        bad = invalid_frames(frames)
        if bad:
            self.refused = True
            m = min(bad)
            raise StoreError(f"{self.path}: record {int(ids[m])} (molecule {first + m}) {bad[m]}")
        f = self._file
        write_frames(f, frames, first, lo)
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
        mark_created(f)
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
