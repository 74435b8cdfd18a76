"""The linear "dressed atom" baseline: target = sum over atoms of a per-element energy.

Fitted by least squares on element counts of the training split. It is reported beside
the network so users see what the network adds, and its per-element energies seed the
model's atom reference, so the network learns the residual.
"""

from __future__ import annotations

import numpy as np

from schnet_ipu.data.elements import NUM_ELEMENTS


def element_counts(z: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Count elements per molecule.

    Args:
        z: uint8 [A] concatenated atomic numbers.
        offsets: int64 [M + 1] start of each molecule in ``z``.
    Returns:
        uint16 [M, 119] counts (compact: 31 MB for all of QM9).

    One pass per element present, summing a boolean mask [A] over each molecule's range:
    no per-atom index arrays (4.5M water clusters have 290M atoms).
    """
    starts = np.asarray(offsets[:-1], dtype=np.int64)
    counts = np.zeros((len(starts), NUM_ELEMENTS), dtype=np.uint16)
    filled = np.diff(offsets) > 0  # reduceat would give an empty molecule its next atom
    for element in np.unique(z).tolist():
        per_molecule = np.add.reduceat(z == element, starts[filled], dtype=np.int64)
        counts[filled, element] = per_molecule
    return counts


def fit_dressed_atoms(counts: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares per-element energies.

    Args:
        counts: [M, 119] element counts of the training molecules.
        y: [M] targets.
    Returns:
        float64 [119] energy per element; 0 for elements absent from the training data.
    """
    present = np.flatnonzero(counts.sum(axis=0))
    solution, *_ = np.linalg.lstsq(counts[:, present].astype(np.float64), y, rcond=None)
    energies = np.zeros(NUM_ELEMENTS)
    energies[present] = solution
    return energies


def predict_dressed_atoms(counts: np.ndarray, energies: np.ndarray) -> np.ndarray:
    """[M, 119] counts, [119] energies -> [M] predictions."""
    return counts @ energies
