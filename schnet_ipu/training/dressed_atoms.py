"""The linear "dressed atom" baseline: target = sum over atoms of a per-element energy.

Fitted by least squares on element counts of the training split. It is reported beside
the network so users see what the network adds, and its per-element energies seed the
model's atom reference, so the network learns the residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schnet_ipu.data.elements import NUM_ELEMENTS

COUNT_ATOMS = 1 << 24  # atoms counted at once (their sums' int64 copy: 128 MB)


@dataclass(frozen=True)
class ElementCounts:
    """Atoms of each element per molecule, for the elements present only: every host of a
    run keeps the counts of every molecule (the fit and the baselines are shared), and
    [M, 119] would take 1 GB for 4.46M water clusters, where [M, 2] takes 18 MB."""

    elements: np.ndarray  # int64 [E] atomic numbers present, ascending
    table: np.ndarray  # uint16 [M, E] atoms of elements[e] in molecule m

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index) -> ElementCounts:
        """The counts of the molecules ``index`` (an index array, a mask or a slice)."""
        return ElementCounts(self.elements, self.table[index])

    def dot(self, per_element: np.ndarray) -> np.ndarray:
        """float64 [M]: each molecule's sum over its atoms of ``per_element`` [119]."""
        return self.table @ np.asarray(per_element, dtype=np.float64)[self.elements]

    def totals(self) -> np.ndarray:
        """int64 [119]: atoms of each element over all these molecules."""
        totals = np.zeros(NUM_ELEMENTS, dtype=np.int64)
        totals[self.elements] = self.table.sum(axis=0, dtype=np.int64)
        return totals


def element_counts(z: np.ndarray, offsets: np.ndarray) -> ElementCounts:
    """Count elements per molecule.

    Args:
        z: uint8 [A] concatenated atomic numbers.
        offsets: int64 [M + 1] start of each molecule in ``z``.
    Returns:
        uint16 counts of the elements present, [M, E] (compact: 18 MB for 4.46M water
        clusters).

    Molecules are counted in groups of about COUNT_ATOMS atoms, one pass per element present
    over each group, summing a boolean mask over each molecule's range: the sums' int64
    copy of the mask stays a group's (4.5M water clusters have 290M atoms, whose int64 copy
    at once would take 2.3 GB).
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    elements = np.unique(z).astype(np.int64)
    table = np.zeros((len(offsets) - 1, len(elements)), dtype=np.uint16)
    groups = np.searchsorted(offsets, np.arange(0, offsets[-1], COUNT_ATOMS), side="right") - 1
    for first, last in zip(groups, [*groups[1:], len(offsets) - 1]):
        starts = offsets[first:last] - offsets[first]
        part = z[offsets[first] : offsets[last]]
        filled = np.diff(offsets[first : last + 1]) > 0  # reduceat: an empty one's next atom
        for column, element in enumerate(elements.tolist()):
            per_molecule = np.add.reduceat(part == element, starts[filled], dtype=np.int64)
            table[first + np.flatnonzero(filled), column] = per_molecule
    return ElementCounts(elements, table)


def fit_dressed_atoms(counts: ElementCounts, y: np.ndarray) -> np.ndarray:
    """Least-squares per-element energies.

    Args:
        counts: element counts of the training molecules.
        y: [M] targets.
    Returns:
        float64 [119] energy per element; 0 for elements absent from the training data.
    """
    present = np.flatnonzero(counts.table.sum(axis=0))
    solution, *_ = np.linalg.lstsq(counts.table[:, present].astype(np.float64), y, rcond=None)
    energies = np.zeros(NUM_ELEMENTS)
    energies[counts.elements[present]] = solution
    return energies


def predict_dressed_atoms(counts: ElementCounts, energies: np.ndarray) -> np.ndarray:
    """Element counts of M molecules, [119] energies -> [M] predictions."""
    return counts.dot(energies)
