"""HydroNet importer: PyG's per-size npz files ``W{n}_geoms_all.npz`` into one store.

Each file holds ``z`` [G, 3n] (8 for O, 1 for H), ``pos`` [G, 3n, 3] in Angstrom, ``y`` [G]
total energy in kcal/mol and ``num_graphs``. A record id is ``n * 10**8 + row in its file``.
"""

from __future__ import annotations

import json
import logging
import sys
import zipfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .checks import StoreError
from .writer import StoreWriter

log = logging.getLogger(__name__)

SUBSETS: dict[str, range] = {
    "large": range(3, 31),  # W3-W30, every cluster
    "medium": range(3, 26),  # W3-W25
    "small": range(3, 26),  # a seeded sample of the medium clusters
}
SMALL_SIZE = 500_000
ID_STRIDE = 10**8


def hydronet_file(raw_dir: Path, waters: int) -> Path:
    return raw_dir / f"W{waters}_geoms_all.npz"


def import_hydronet(
    raw_dir: str | Path,
    out: str | Path,
    subset: str = "small",
    seed: int = 0,
    sample_size: int = SMALL_SIZE,
    progress: bool = True,
) -> Path:
    """Import a HydroNet subset ("large", "medium" or "small") into a store at ``out``.

    "small" draws ``sample_size`` clusters (seeded) from the medium ones; when fewer exist
    it takes them all and logs a warning. Target ``energy`` in kcal/mol. Streamed: one raw
    file in memory at a time, written through a resumable :class:`StoreWriter`.
    """
    raw_dir = Path(raw_dir)
    if subset not in SUBSETS:
        raise StoreError(f"unknown HydroNet subset {subset!r}; choose {', '.join(SUBSETS)}")
    sizes = SUBSETS[subset]
    files = [hydronet_file(raw_dir, n) for n in sizes]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise StoreError(
            f"{raw_dir}: HydroNet subset {subset!r} needs W{sizes[0]}..W{sizes[-1]}"
            f"_geoms_all.npz; missing: {', '.join(missing)}"
        )
    lengths = [_num_clusters(f) for f in files]  # opens every file: truncation shows here
    total = sum(lengths)
    rows = [np.arange(g) for g in lengths]
    if subset == "small":
        if total <= sample_size:
            log.warning(
                "HydroNet small: only %d medium clusters exist (< %d); taking all",
                total,
                sample_size,
            )
        else:
            chosen = np.sort(np.random.default_rng(seed).choice(total, sample_size, replace=False))
            starts = np.cumsum([0, *lengths[:-1]])
            parts = np.split(chosen, np.searchsorted(chosen, starts[1:]))
            rows = [part - start for part, start in zip(parts, starts)]
    num_atoms = np.concatenate(
        [np.full(len(r), 3 * n, dtype=np.int64) for n, r in zip(sizes, rows)]
    )
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = json.dumps({"subset": subset, "seed": seed, "sample": sample_size, "files": stamp})
    writer = StoreWriter(
        out,
        num_atoms,
        units={"energy": "kcal/mol"},
        key=key,
        descriptions={"energy": "total energy (TTM2.1-F)"},
        attrs={
            "source": "hydronet",
            "source_version": "pyg-npz",
            "synthetic": False,
            "subset": subset,
            "seed": seed,
            "ids": "waters * 10**8 + row in W{waters}_geoms_all.npz",
        },
    )
    bar = tqdm(
        total=len(num_atoms),
        initial=writer.written,
        desc=f"import HydroNet {subset}",
        unit="cluster",
        disable=not progress,
        file=sys.stderr,
    )
    first = 0
    try:
        for n, path, take in zip(sizes, files, rows):
            if first + len(take) > writer.written and len(take):
                bar.set_postfix_str(path.name)
                z, pos, y = _read_file(path, n)
                writer.append(z[take], pos[take], {"energy": y[take]}, n * ID_STRIDE + take)
                bar.update(len(take))
            first += len(take)
    except BaseException:
        writer.close()  # the partial file stays for resuming
        raise
    finally:
        bar.close()
    path = writer.finish()
    log.info("wrote %s: HydroNet %s, %d of %d clusters", path, subset, len(num_atoms), total)
    return path


def _num_clusters(path: Path) -> int:
    """G, the clusters in one raw file (reads only its ``y``)."""
    try:
        with np.load(path) as npz:
            return len(npz["y"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        raise StoreError(f"{path}: unreadable HydroNet file (truncated? needs y): {err}") from err


def _read_file(path: Path, waters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z int64 [G, 3n], pos float32 [G, 3n, 3], y float64 [G]) from one npz, checked."""
    try:
        with np.load(path) as npz:
            z, pos, y = npz["z"], npz["pos"], npz["y"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        raise StoreError(f"{path}: unreadable HydroNet file (needs z, pos, y): {err}") from err
    atoms = 3 * waters
    if z.ndim != 2 or z.shape[1] != atoms or pos.shape != (*z.shape, 3) or y.shape != z.shape[:1]:
        raise StoreError(
            f"{path}: expected z [G, {atoms}], pos [G, {atoms}, 3], y [G]; "
            f"got {z.shape}, {pos.shape}, {y.shape}"
        )
    return z.astype(np.int64), pos.astype(np.float32), y.astype(np.float64)
