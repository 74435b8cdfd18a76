"""Radius pairs of every molecule of a store, computed once per (store, cutoff) and kept
beside it in ``<store>.pairs-cutoff<c>.npz``.

File layout (M molecules, P unordered pairs in all)::

    i, j     uint8 (or wider) [P]   local atom indices, i < j, row-major within a molecule
    offsets  int64 [M + 1]          molecule m owns pairs offsets[m]:offsets[m + 1]
    version, created, num_molecules, num_atoms, cutoff, checksum (crc32 of offsets, i, j)

A file whose version, store stamp, sizes, cutoff or checksum disagree, or that cannot be
read, is rebuilt with a warning, never used. The packer's edge counts are twice the pairs of
each molecule, so planning and batches come from one computation.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .graphs import within_cutoff
from .store import MoleculeStore

log = logging.getLogger(__name__)

# Bumped when the file layout or within_cutoff's arithmetic changes.
PAIRS_VERSION = 1

# Largest distance block (molecules x n x n) evaluated at once.
_BLOCK_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class RadiusPairs:
    """Unordered pairs within ``cutoff`` of every store molecule (see the module docstring)."""

    i: np.ndarray  # [P] local index of the first atom (unsigned, smallest dtype that fits)
    j: np.ndarray  # [P] local index of the second atom, j > i
    offsets: np.ndarray  # int64 [M + 1]
    cutoff: float

    @property
    def counts(self) -> np.ndarray:
        """int64 [M] unordered pairs per molecule."""
        return np.diff(self.offsets)

    def checksum(self) -> int:
        crc = zlib.crc32(self.offsets.tobytes())
        return zlib.crc32(self.j.tobytes(), zlib.crc32(self.i.tobytes(), crc))


def pairs_path(store: MoleculeStore, cutoff: float) -> Path:
    return store.path.with_name(f"{store.path.name}.pairs-cutoff{cutoff:g}.npz")


def radius_pairs(store: MoleculeStore | str | Path, cutoff: float) -> RadiusPairs:
    """The pairs file of ``store`` at ``cutoff``: loaded when valid, else (re)built and saved."""
    if not isinstance(store, MoleculeStore):
        store = MoleculeStore(store)
    path = pairs_path(store, cutoff)
    if path.is_file():
        pairs, problem = _load(path, store, cutoff)
        if pairs is not None:
            return pairs
        warnings.warn(f"{path}: {problem}; rebuilding it", stacklevel=2)
    start = time.perf_counter()
    pairs = build_pairs(store, cutoff)
    _save(path, pairs, store)
    log.info(
        "radius pairs (cutoff %g): %d pairs in %.1f s, saved at %s",
        cutoff,
        len(pairs.i),
        time.perf_counter() - start,
        path,
    )
    return pairs


def edge_counts(store: MoleculeStore | str | Path, cutoff: float) -> np.ndarray:
    """Directed radius edges per molecule, int64 [M]: twice its pairs in the pairs file."""
    return 2 * radius_pairs(store, cutoff).counts


def build_pairs(store: MoleculeStore, cutoff: float) -> RadiusPairs:
    """Every molecule's pairs, by :func:`within_cutoff` on blocks of equal-size molecules.

    Molecules of n atoms are stacked into [m, n, 3] blocks; each block's pairs come out
    molecule-major, i then j, and are written straight to their molecule's place.
    """
    _, pos = store.concatenated()
    pos_t = torch.from_numpy(pos)
    sizes = store.num_atoms
    dtype = np.min_scalar_type(max(int(sizes.max()) - 1, 0))
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # compact dtypes
    counts = np.zeros(len(store), dtype=np.int64)
    for n in np.unique(sizes):
        members = np.flatnonzero(sizes == n)
        step = max(1, _BLOCK_ELEMENTS // (n * n))
        for lo in range(0, len(members), step):
            chunk = members[lo : lo + step]
            atoms = store.offsets[chunk][:, None] + np.arange(n)
            keep = within_cutoff(pos_t[torch.from_numpy(atoms)], cutoff).triu_(1)
            m, i, j = keep.nonzero(as_tuple=True)
            counts[chunk] = torch.bincount(m, minlength=len(chunk)).numpy()
            found.append((chunk, m.int().numpy(), i.numpy().astype(dtype), j.numpy().astype(dtype)))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    pair_i = np.empty(offsets[-1], dtype=dtype)
    pair_j = np.empty(offsets[-1], dtype=dtype)
    for chunk, m, i, j in found:
        block_counts = counts[chunk]
        block_start = np.cumsum(block_counts) - block_counts
        place = offsets[chunk][m] + np.arange(len(m)) - block_start[m]
        pair_i[place] = i
        pair_j[place] = j
    return RadiusPairs(pair_i, pair_j, offsets, float(cutoff))


def _save(path: Path, pairs: RadiusPairs, store: MoleculeStore) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")  # concurrent writers: own files
    np.savez(
        tmp,
        i=pairs.i,
        j=pairs.j,
        offsets=pairs.offsets,
        version=PAIRS_VERSION,
        created=str(store.attrs.get("created", "")),
        num_molecules=len(store),
        num_atoms=int(store.offsets[-1]),
        cutoff=pairs.cutoff,
        checksum=pairs.checksum(),
    )
    tmp.replace(path)


def _load(path: Path, store: MoleculeStore, cutoff: float) -> tuple[RadiusPairs | None, str | None]:
    """(pairs, None) when the file belongs to this store and cutoff, else (None, why not)."""
    try:
        with np.load(path) as saved:
            meta = {k: saved[k] for k in saved.files if k not in ("i", "j", "offsets")}
            if int(meta.get("version", -1)) != PAIRS_VERSION:
                return None, f"pairs file version {meta.get('version')} != {PAIRS_VERSION}"
            expected = {
                "created": str(store.attrs.get("created", "")),
                "num_molecules": len(store),
                "num_atoms": int(store.offsets[-1]),
                "cutoff": float(cutoff),
            }
            for key, value in expected.items():
                if type(value)(meta[key]) != value:
                    return None, f"written for another store or cutoff ({key} differs)"
            pairs = RadiusPairs(saved["i"], saved["j"], saved["offsets"], float(cutoff))
    except Exception as err:  # a truncated or foreign file: any read error means rebuild
        return None, f"unreadable ({type(err).__name__}: {err})"
    if len(pairs.offsets) != len(store) + 1 or pairs.checksum() != int(meta["checksum"]):
        return None, "checksum mismatch (corrupt)"
    return pairs, None
