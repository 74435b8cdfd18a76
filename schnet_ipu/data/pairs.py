"""The pairs of every molecule of a store, computed once per (store, cutoff) and kept beside
it: radius pairs i < j, built here into ``<store>.pairs-cutoff<c>.npz``, or for a store
with cells its periodic pairs (:mod:`.periodic_pairs`). Both files are pairs files
(:mod:`.pairs_file`: layout, checks, rebuild when stale).

The packer's edge counts are twice the pairs of each molecule, so planning and batches come
from one computation.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.data import compiled_pairs

from .graphs import pairs_within_cutoff
from .pairs_file import RadiusPairs, build_in_runs, cached_pairs
from .periodic_pairs import periodic_pairs
from .store import MoleculeStore

log = logging.getLogger(__name__)

# Bumped when the file layout or within_cutoff's arithmetic changes.
PAIRS_VERSION = 1

# Largest pair table (molecules x pairs of the store's largest molecule) filled at once.
_BLOCK_ELEMENTS = 1 << 22

# A pair (i, j) in a local index dtype of 1, 2 or 4 bytes read as one integer (twice as wide):
# kept codes viewed back as that dtype are the [P, 2] (i, j) rows.
_CODE_DTYPES = {1: np.int16, 2: np.int32, 4: np.int64}


def pairs_path(store: MoleculeStore, cutoff: float) -> Path:
    return store.path.with_name(f"{store.path.name}.pairs-cutoff{cutoff:g}.npz")


def radius_pairs(
    store: MoleculeStore | str | Path,
    cutoff: float,
    positions: np.ndarray | None = None,
    progress: bool = True,
) -> RadiusPairs:
    """The pairs file of ``store`` at ``cutoff``: loaded when valid, else (re)built and saved
    (from ``positions``, the store's float32 [A, 3] atoms, when the caller has them), with a
    progress bar when ``progress`` and the build takes over a second. A store with cells
    gets its periodic pairs (:mod:`schnet_ipu.data.periodic_pairs`) instead."""
    if not isinstance(store, MoleculeStore):
        store = MoleculeStore(store)
    if store.periodic:
        return periodic_pairs(store, cutoff, positions, progress)
    return cached_pairs(
        pairs_path(store, cutoff),
        store,
        cutoff,
        RadiusPairs,
        PAIRS_VERSION,
        lambda: build_pairs(store, cutoff, positions, progress),
    )


def edge_counts(store: MoleculeStore | str | Path, cutoff: float) -> np.ndarray:
    """Directed radius edges per molecule, int64 [M]: twice its pairs in the pairs file."""
    return 2 * radius_pairs(store, cutoff).counts


def build_pairs(
    store: MoleculeStore,
    cutoff: float,
    positions: np.ndarray | None = None,
    progress: bool = False,
) -> RadiusPairs:
    """Every molecule's pairs i < j, by within_cutoff's test: numba's compiled loops when
    installed (:func:`_run_pairs_compiled`), else torch (:func:`pairs_within_cutoff`).

    ``positions`` float32 [A, 3]: the store's atoms when the caller has read them already
    (``store.concatenated()``), else they are read here. Store order is cut into runs of
    molecules, tested on torch's intra-op threads' worth of Python threads (the loops, torch
    and numpy release the GIL; runs are independent). ``progress``: a bar on stderr once the
    build has taken a second (QM9 takes ~0.05 s compiled, ~0.3 s by torch; a store of
    millions of water clusters, tens of times its pairs, far longer).
    """
    pos = store.concatenated()[1] if positions is None else positions
    coords = torch.from_numpy(np.ascontiguousarray(pos.T, dtype=np.float32))  # [3, A]: x, y, z
    sizes = store.num_atoms
    dtype = np.min_scalar_type(max(int(sizes.max()) - 1, 0))
    if compiled_pairs.AVAILABLE:
        run_pairs = _run_pairs_compiled
    else:  # torch, on the pair tables of every molecule size present
        present = np.flatnonzero(np.bincount(sizes)).tolist()  # np.unique: ~0.1 s first call
        tables = {n: _PairTable.of(n, dtype) for n in present if n > 1}
        run_pairs = functools.partial(_run_pairs, tables=tables)
    run = max(1, _BLOCK_ELEMENTS // max(_num_pairs(int(sizes.max())), 1))

    def test(lo: int) -> tuple[np.ndarray, np.ndarray]:
        part = slice(lo, lo + run)
        return run_pairs(coords, store.offsets[part], sizes[part], cutoff, dtype)

    desc = f"radius pairs (cutoff {cutoff:g})"
    done = build_in_runs(len(store), run, test, desc, "mol", progress)
    counts = np.concatenate([run_counts for run_counts, _ in done])
    pair_ij = [codes.view(dtype).reshape(-1, 2) for _, codes in done]  # [P_run, 2] each
    i = np.concatenate([ij[:, 0] for ij in pair_ij])
    j = np.concatenate([ij[:, 1] for ij in pair_ij])
    return RadiusPairs(i, j, np.concatenate([[0], np.cumsum(counts)]), float(cutoff))


def _run_pairs(
    coords: Tensor,
    starts: np.ndarray,
    sizes: np.ndarray,
    cutoff: float,
    dtype: np.dtype,
    tables: dict[int, _PairTable],
) -> tuple[np.ndarray, np.ndarray]:
    """The pairs of a run of R molecules (first atoms ``starts`` [R], ``sizes`` [R]) in
    ``coords`` [3, A]: int64 counts [R] and the kept (i, j) codes [P_run] (``dtype`` pairs
    read as one integer), in store order.

    The molecules of n atoms are tested together on the n(n - 1) / 2 pairs of
    ``np.triu_indices(n, 1)`` (i, then j); each molecule's results fill the front of its row
    of an [R, widest] table, so one compress reads the kept pairs molecule by molecule.
    """
    width = _num_pairs(int(sizes.max()))
    keep = np.zeros((len(sizes), width), dtype=bool)
    codes = np.empty((len(sizes), width), dtype=_CODE_DTYPES[dtype.itemsize])
    order = np.argsort(sizes, kind="stable")
    for rows in np.split(order, np.flatnonzero(np.diff(sizes[order])) + 1):
        n = int(sizes[rows[0]])
        if n < 2:
            continue
        table = tables[n]
        atoms = torch.from_numpy((starts[rows][:, None] + np.arange(n)).ravel())
        x, y, z = coords.index_select(1, atoms).view(3, len(rows), n)
        found = pairs_within_cutoff(x, y, z, table.i, table.j, cutoff)
        keep[rows, : len(table.code)] = found.numpy()
        codes[rows, : len(table.code)] = table.code
    return np.count_nonzero(keep, axis=1), np.compress(keep.ravel(), codes.ravel())


def _run_pairs_compiled(
    coords: Tensor, starts: np.ndarray, sizes: np.ndarray, cutoff: float, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_run_pairs` by numba's compiled loops (the same test, bit for bit: float32
    differences and squares, summed x, y, z, compared with the float32 square of the cutoff
    as torch compares a float32 tensor with a Python float), in one pass over each molecule's
    n(n-1)/2 pairs."""
    x, y, z = coords.numpy()
    starts, sizes = (np.ascontiguousarray(v, dtype=np.int64) for v in (starts, sizes))
    counts = np.empty(len(sizes), dtype=np.int64)
    room = np.empty((int((sizes * (sizes - 1) // 2).sum()), 2), dtype=np.int32)
    found = compiled_pairs.find_pairs(
        x, y, z, starts, sizes, np.float32(cutoff * cutoff), counts, room
    )
    return counts, room[:found].astype(dtype).view(_CODE_DTYPES[dtype.itemsize]).reshape(-1)


def _num_pairs(n: int) -> int:
    return n * (n - 1) // 2


@dataclass(frozen=True)
class _PairTable:
    """The pairs i < j of n atoms, i then j (``np.triu_indices(n, 1)``)."""

    i: Tensor  # int64 [T] first atom
    j: Tensor  # int64 [T] second atom
    code: np.ndarray  # [T] (i, j) in the pairs dtype, read as one integer of twice its width

    @classmethod
    def of(cls, n: int, dtype: np.dtype) -> _PairTable:
        i, j = np.triu_indices(n, 1)
        code = np.stack([i, j], 1).astype(dtype).view(_CODE_DTYPES[dtype.itemsize]).ravel()
        return cls(torch.from_numpy(i), torch.from_numpy(j), code)
