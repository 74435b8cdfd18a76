"""Periodic pairs of every frame of a store with cells, computed once per (store, cutoff) by
vesin and kept beside it in ``<store>.periodic-pairs-cutoff<c>.npz``.

A pair (i, j, S) says that atom j's image shifted by the integer cell vector S lies within
the cutoff of atom i: ``|pos[j] - pos[i] + S @ cell| <= cutoff`` (ASE's
``neighbor_list("ijS")`` convention). Each pair is stored once, as the half of ASE's full
list with i < j, or i == j and S lexicographically positive (an atom and its own image);
the other half is (j, i, -S), which the feed writes in the reversed half of a batch, so a
periodic batch keeps the radius layout (forward pairs, then the same pairs reversed) and
the model's pair-symmetric filter. Several images of one neighbour are several pairs.
Frames without a cell (pbc all False) get the plain radius pairs with S = 0.

File layout (M frames, P pairs)::

    i, j     uint8 (or wider) [P]   local atom indices, i <= j, in vesin's order per frame
    shift    int8 [P, 3]            integer cell shift S of atom j
    offsets  int64 [M + 1]          frame m owns pairs offsets[m]:offsets[m + 1]
    version, created, num_molecules, num_atoms, cutoff, checksum (crc32 of offsets, i, j, shift)

As for radius pairs (:mod:`schnet_ipu.data.pairs`) a file whose version, store stamp, sizes,
cutoff or checksum disagree, or that cannot be read, is rebuilt with a warning.

Why vesin (``python -m schnet_ipu.bench periodic`` measures it against
``ase.neighborlist.neighbor_list`` and ``matscipy.neighbours.neighbour_list`` on the same
frames): it handles mixed periodicity and cells smaller than the cutoff, returns ASE's
(i, j, S) with a half list, and is the fastest of the three per frame. Its API:
https://luthaf.fr/vesin (``vesin.NeighborList(cutoff, full_list).compute(points, box,
periodic, quantities)``).
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checks import StoreError
from .pairs_file import RadiusPairs, build_in_runs, cached_pairs
from .store import MoleculeStore

log = logging.getLogger(__name__)

# Bumped when the file layout or the pair convention changes.
PERIODIC_PAIRS_VERSION = 1

SHIFT_DTYPE = np.int8  # |S| <= 127 cells: a cutoff of 127 cell lengths
RUN_FRAMES = 1024  # frames listed, then canonicalised, at once by one thread


class PairCountError(StoreError):
    """A frame whose neighbour count the feed cannot hold (shift or index out of range)."""


@dataclass(frozen=True)
class PeriodicPairs(RadiusPairs):
    """Radius pairs with the cell shift of each (see the module docstring); ``counts``
    and the packer's edge counts (twice the pairs) work as for radius pairs."""

    shift: np.ndarray = None  # int8 [P, 3] integer cell shift S of atom j

    def checksum(self) -> int:
        return zlib.crc32(np.ascontiguousarray(self.shift), super().checksum())


def periodic_pairs_path(store: MoleculeStore, cutoff: float) -> Path:
    return store.path.with_name(f"{store.path.name}.periodic-pairs-cutoff{cutoff:g}.npz")


def periodic_pairs(
    store: MoleculeStore | str | Path,
    cutoff: float,
    positions: np.ndarray | None = None,
    progress: bool = True,
) -> PeriodicPairs:
    """The periodic pairs file of ``store`` (a store with cells) at ``cutoff``: loaded when
    valid, else (re)built and saved (from ``positions`` float32 [A, 3] when given)."""
    if not isinstance(store, MoleculeStore):
        store = MoleculeStore(store)
    return cached_pairs(
        periodic_pairs_path(store, cutoff),
        store,
        cutoff,
        PeriodicPairs,
        PERIODIC_PAIRS_VERSION,
        lambda: build_periodic_pairs(store, cutoff, positions, progress),
    )


def build_periodic_pairs(
    store: MoleculeStore,
    cutoff: float,
    positions: np.ndarray | None = None,
    progress: bool = False,
) -> PeriodicPairs:
    """Every frame's half list (as :func:`frame_pairs`) as one PeriodicPairs.

    Store order is cut into runs of RUN_FRAMES frames, listed on torch's intra-op threads'
    worth of Python threads (vesin's C library is called through ctypes, which releases the
    GIL). In a run vesin lists frame after frame (one neighbour-list object), then one
    vectorised pass puts the run's pairs in canonical form and the final dtypes: on 32-atom
    frames per-frame numpy calls cost more than vesin itself, and a pass over all frames at
    once would hold ~28 bytes per pair (2 GB for 100k frames at 5 A)."""
    pos = store.concatenated()[1] if positions is None else positions
    cells, pbcs = store.cells()
    sizes = store.num_atoms
    dtype = np.min_scalar_type(max(int(sizes.max()) - 1, 0))

    def run(lo: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        neighbours = _neighbour_list(cutoff)
        frames = range(lo, min(lo + RUN_FRAMES, len(store)))
        found = [
            _vesin_pairs(
                neighbours, pos[store.offsets[m] : store.offsets[m + 1]], cells[m], pbcs[m]
            )
            for m in frames
        ]
        counts = np.array([len(i) for i, _, _ in found], dtype=np.int64)
        frame = np.repeat(np.arange(lo, frames.stop), counts)
        i, j, shift = (np.concatenate([f[k] for f in found]) for k in range(3))
        try:
            i, j, shift = _canonical(i.astype(np.int64), j.astype(np.int64), shift, frame, cutoff)
        except PairCountError as err:
            message, m = err.args
            raise PairCountError(f"{store.record_name(m)}: {message}") from None
        return counts, i.astype(dtype), j.astype(dtype), shift

    desc = f"periodic pairs (cutoff {cutoff:g})"
    done = build_in_runs(len(store), RUN_FRAMES, run, desc, "frame", progress)
    counts, i, j, shift = (np.concatenate([d[k] for d in done]) for k in range(4))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return PeriodicPairs(i=i, j=j, offsets=offsets, cutoff=float(cutoff), shift=shift)


def frame_pairs(
    pos: np.ndarray, cell: np.ndarray, pbc: np.ndarray, cutoff: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One frame's half list: (i int64 [P], j int64 [P], shift int8 [P, 3]) with i < j, or
    i == j and S lexicographically positive, in vesin's order. pos [n, 3] Angstrom, cell
    [3, 3] (rows), pbc bool [3]. The full list is these and every (j, i, -S)."""
    i, j, shift = _vesin_pairs(_neighbour_list(cutoff), pos, cell, pbc)
    frame = np.zeros(len(i), dtype=np.int64)
    try:
        return _canonical(i.astype(np.int64), j.astype(np.int64), shift, frame, cutoff)
    except PairCountError as err:
        raise PairCountError(err.args[0]) from None


def _neighbour_list(cutoff: float):
    """vesin's half-list builder at ``cutoff``, on one thread (frames are small: its own
    threads cost more than they save; runs of frames go to threads instead)."""
    import vesin

    return vesin.NeighborList(cutoff=float(cutoff), full_list=False, n_threads=1)


def _vesin_pairs(
    neighbours, pos: np.ndarray, cell: np.ndarray, pbc: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vesin's half list of one frame as it comes: (i [P], j [P], shift int32 [P, 3])."""
    pbc = np.asarray(pbc, dtype=bool)
    box = np.asarray(cell, dtype=np.float64) if pbc.any() else np.zeros((3, 3))
    return neighbours.compute(
        np.asarray(pos, dtype=np.float64), box, pbc.tolist(), quantities="ijS"
    )


def _canonical(
    i: np.ndarray, j: np.ndarray, shift: np.ndarray, frame: np.ndarray, cutoff: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (of frames ``frame`` [P]) in canonical form, order kept: (j, i, -S) where
    i > j, or i == j with S lexicographically negative; int8 shifts. PairCountError(message,
    frame) for a shift int8 cannot hold. (vesin 0.6's half list is already in this form, which
    it does not document; the pairs file's form must not hang on it.)"""
    first = np.where(
        shift[:, 0] != 0, shift[:, 0], np.where(shift[:, 1] != 0, shift[:, 1], shift[:, 2])
    )  # the first nonzero component
    flip = (i > j) | ((i == j) & (first < 0))
    i, j = np.where(flip, j, i), np.where(flip, i, j)
    shift = np.where(flip[:, None], -shift, shift)
    limit = np.iinfo(SHIFT_DTYPE).max
    too_far = np.abs(shift).max(axis=1, initial=0) > limit
    if too_far.any():
        p = int(np.flatnonzero(too_far)[0])
        raise PairCountError(
            f"a pair spans {int(np.abs(shift[p]).max())} cells (at most {limit}); the cell is "
            f"far smaller than the cutoff {cutoff:g} (or degenerate)",
            int(frame[p]),
        )
    return i, j, shift.astype(SHIFT_DTYPE)
