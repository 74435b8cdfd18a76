"""The pairs file, which radius pairs (:mod:`.pairs`) and periodic pairs
(:mod:`.periodic_pairs`) both keep beside their store: its record, its load-or-build, and
the threaded runner both builds go through.

File layout (M molecules, P pairs in all)::

    i, j     uint8 (or wider) [P]   local atom indices, row-major within a molecule
    offsets  int64 [M + 1]          molecule m owns pairs offsets[m]:offsets[m + 1]
    <more>   [P, ...]               any further field of the record (periodic: shift [P, 3])
    version, created, num_molecules, num_atoms, cutoff, checksum (crc32 of offsets, i, j and
                                    the further fields)

``created``, ``num_molecules`` and ``num_atoms`` are the store's: a file whose version,
store stamp, sizes, cutoff or checksum disagree, or that cannot be read, is rebuilt with a
warning, never used.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from tqdm import tqdm

from .store import MoleculeStore, ranges_of

log = logging.getLogger(__name__)

RunResult = TypeVar("RunResult")


@dataclass(frozen=True)
class RadiusPairs:
    """Unordered pairs within ``cutoff`` of every store molecule (:mod:`.pairs`), the
    record of a pairs file (see the module docstring)."""

    i: np.ndarray  # [P] local index of the first atom (unsigned, smallest dtype that fits)
    j: np.ndarray  # [P] local index of the second atom, j > i
    offsets: np.ndarray  # int64 [M + 1]
    cutoff: float

    @property
    def counts(self) -> np.ndarray:
        """int64 [M] unordered pairs per molecule."""
        return np.diff(self.offsets)

    def of(self, molecules: np.ndarray) -> RadiusPairs:
        """The pairs of ``molecules`` only (int [K] store indices), a record of K molecules
        (every per-pair field kept, the periodic shifts too)."""
        molecules = np.asarray(molecules, dtype=np.int64)
        counts = self.counts[molecules]
        rows = ranges_of(self.offsets[molecules], counts)
        per_pair = {
            f.name: getattr(self, f.name)[rows]
            for f in fields(self)
            if f.name not in ("offsets", "cutoff")
        }
        return replace(self, offsets=np.concatenate([[0], np.cumsum(counts)]), **per_pair)

    def checksum(self) -> int:
        """crc32 of the bytes of offsets, i, j (read in place, not copied)."""
        crc = 0
        for values in (self.offsets, self.i, self.j):
            crc = zlib.crc32(np.ascontiguousarray(values), crc)
        return crc


def cached_pairs(
    path: Path,
    store: MoleculeStore,
    cutoff: float,
    kind: type[RadiusPairs],
    version: int,
    build: Callable[[], RadiusPairs],
) -> RadiusPairs:
    """The pairs file at ``path`` (pairs of class ``kind``, file format ``version``) when it
    belongs to ``store`` and ``cutoff``; else ``build()``, saved there (a file that
    disagrees or cannot be read is rebuilt with a warning, never used)."""
    if path.is_file():
        pairs, problem = _load(path, store, cutoff, kind, version)
        if pairs is not None:
            return pairs
        warnings.warn(f"{path}: {problem}; rebuilding it", stacklevel=3)
    start = time.perf_counter()
    pairs = build()
    _save(path, pairs, store, version)
    log.info(
        "%s (cutoff %g): %d pairs in %.1f s, saved at %s",
        kind.__name__,
        cutoff,
        len(pairs.i),
        time.perf_counter() - start,
        path,
    )
    return pairs


def build_in_runs(
    count: int,
    run: int,
    build_run: Callable[[int], RunResult],
    desc: str,
    unit: str,
    progress: bool,
) -> list[RunResult]:
    """``build_run(lo)`` for the runs of ``run`` molecules starting at lo = 0, run, ...
    below ``count``, in order: on torch's intra-op threads' worth of Python threads (runs
    are independent, and the builds release the GIL), with a progress bar on stderr when
    ``progress`` and the build has taken a second."""
    bar = tqdm(
        total=count,
        desc=desc,
        unit=unit,
        delay=1.0,  # shown only when the build is long
        disable=not progress,
        file=sys.stderr,
    )
    starts, done = range(0, count, run), []
    with bar, ThreadPoolExecutor(torch.get_num_threads()) as pool:
        for lo, found in zip(starts, pool.map(build_run, starts)):
            done.append(found)
            bar.update(min(run, count - lo))
    return done


def _save(path: Path, pairs: RadiusPairs, store: MoleculeStore, version: int) -> None:
    """The pairs' arrays (every field but the cutoff) and what ties them to ``store``."""
    arrays = {f.name: getattr(pairs, f.name) for f in fields(pairs) if f.name != "cutoff"}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")  # concurrent writers: own files
    np.savez(
        tmp,
        **arrays,
        version=version,
        created=str(store.attrs.get("created", "")),
        num_molecules=len(store),
        num_atoms=int(store.offsets[-1]),
        cutoff=pairs.cutoff,
        checksum=pairs.checksum(),
    )
    tmp.replace(path)


def _load(
    path: Path, store: MoleculeStore, cutoff: float, kind: type[RadiusPairs], version: int
) -> tuple[RadiusPairs | None, str | None]:
    """(pairs, None) when the file belongs to this store, cutoff and ``version``, else
    (None, why not)."""
    names = [f.name for f in fields(kind) if f.name != "cutoff"]
    try:
        with np.load(path) as saved:
            meta = {k: saved[k] for k in saved.files if k not in names}
            if int(meta.get("version", -1)) != version:
                return None, f"pairs file version {meta.get('version')} != {version}"
            expected = {
                "created": str(store.attrs.get("created", "")),
                "num_molecules": len(store),
                "num_atoms": int(store.offsets[-1]),
                "cutoff": float(cutoff),
            }
            for key, value in expected.items():
                if type(value)(meta[key]) != value:
                    return None, f"written for another store or cutoff ({key} differs)"
            pairs = kind(**{k: saved[k] for k in names}, cutoff=float(cutoff))
    except Exception as err:  # a truncated or foreign file: any read error means rebuild
        return None, f"unreadable ({type(err).__name__}: {err})"
    if len(pairs.offsets) != len(store) + 1 or pairs.checksum() != int(meta["checksum"]):
        return None, "checksum mismatch (corrupt)"
    return pairs, None
