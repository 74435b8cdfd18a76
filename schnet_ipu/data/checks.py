"""What makes a store's records unusable, and the error that says so.

The writers (:mod:`.writer`) check every record before writing it: atomic numbers 1-118,
finite coordinates, forces, targets and stress, non-empty molecules, usable cells; they
refuse the file, or drop and list the bad records. The reader (:mod:`.store`) checks what
it reads with the same functions, so a store damaged after import never trains. Each
``invalid_*`` function maps a molecule index to what is wrong with it, one vectorised
pass when all is well; the ``checked_*`` functions turn a writer's input into arrays or
raise :class:`StoreError` naming ``where`` (the file or the source).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from schnet_ipu.errors import UserError

from .elements import NUM_ELEMENTS
from .store_format import Frames


class StoreError(UserError, ValueError):
    """A store (or the input for one) that cannot be used; the message names the file."""


def invalid_frames(frames: Frames, labels: np.ndarray | None = None) -> dict[int, str]:
    """Frame index -> what is wrong with it (:func:`invalid_records`, then
    :func:`invalid_cells`); ``labels`` [a] the elements as given, for the messages."""
    bad = invalid_records(
        frames.z, frames.pos, frames.offsets, frames.targets, labels, frames.forces
    )
    for m, reason in invalid_cells(frames.cell, frames.pbc, frames.stress).items():
        bad.setdefault(m, reason)
    return bad


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


def checked_targets(
    targets: Mapping[str, Any], units: Mapping[str, str], num_molecules: int, where: str
) -> dict[str, np.ndarray]:
    """name -> float64 [M] for each target; StoreError unless every target has a unit (and
    every unit a target) and M values."""
    if set(targets) != set(units):
        raise StoreError(f"{where}: targets {sorted(targets)} and units {sorted(units)} differ")
    arrays = {}
    for name, values in targets.items():
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (num_molecules,):
            raise StoreError(f"{where}: target {name!r} has shape {values.shape}, not [M]")
        arrays[name] = values
    return arrays


def checked_periodic(
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


def checked_masks(
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
