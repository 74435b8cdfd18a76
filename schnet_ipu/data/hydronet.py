"""HydroNet importer: PyG's per-size npz files ``W{n}_geoms_all.npz`` into one store.

Each file holds ``z`` [G, 3n] (8 for O, 1 for H), ``pos`` [G, 3n, 3] in Angstrom, ``y`` [G]
total energy in kcal/mol and ``num_graphs``. A record id is ``n * 10**8 + row in its file``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .store import StoreError, write_store

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
) -> Path:
    """Import a HydroNet subset ("large", "medium" or "small") into a store at ``out``.

    "small" draws ``sample_size`` clusters (seeded) from the medium ones; when fewer exist
    it takes them all and logs a warning. Target ``energy`` in kcal/mol.
    """
    raw_dir = Path(raw_dir)
    if subset not in SUBSETS:
        raise StoreError(f"unknown HydroNet subset {subset!r}; choose {', '.join(SUBSETS)}")
    sizes = SUBSETS[subset]
    missing = [
        hydronet_file(raw_dir, n).name for n in sizes if not hydronet_file(raw_dir, n).is_file()
    ]
    if missing:
        raise StoreError(
            f"{raw_dir}: HydroNet subset {subset!r} needs W{sizes[0]}..W{sizes[-1]}"
            f"_geoms_all.npz; missing: {', '.join(missing)}"
        )
    parts = [_read_file(hydronet_file(raw_dir, n), n) for n in sizes]
    total = sum(len(p[2]) for p in parts)
    chosen = None
    if subset == "small":
        if total <= sample_size:
            log.warning(
                "HydroNet small: only %d medium clusters exist (< %d); taking all",
                total,
                sample_size,
            )
        else:
            chosen = np.sort(np.random.default_rng(seed).choice(total, sample_size, replace=False))
    z_parts, pos_parts, y_parts, id_parts, count_parts = [], [], [], [], []
    first = 0
    for n, (z, pos, y) in zip(sizes, parts):
        rows = np.arange(len(y))
        if chosen is not None:
            lo, hi = np.searchsorted(chosen, [first, first + len(y)])
            rows = chosen[lo:hi] - first
        first += len(y)
        z_parts.append(z[rows].reshape(-1))
        pos_parts.append(pos[rows].reshape(-1, 3))
        y_parts.append(y[rows])
        id_parts.append(n * ID_STRIDE + rows)
        count_parts.append(np.full(len(rows), 3 * n, dtype=np.int64))
    counts = np.concatenate(count_parts)
    path = write_store(
        out,
        np.concatenate(z_parts),
        np.concatenate(pos_parts),
        targets={"energy": np.concatenate(y_parts)},
        units={"energy": "kcal/mol"},
        descriptions={"energy": "total energy (TTM2.1-F)"},
        offsets=np.concatenate([[0], np.cumsum(counts)]),
        ids=np.concatenate(id_parts),
        attrs={
            "source": "hydronet",
            "source_version": "pyg-npz",
            "synthetic": False,
            "subset": subset,
            "seed": seed,
            "ids": "waters * 10**8 + row in W{waters}_geoms_all.npz",
        },
        origin=str(raw_dir),
    )
    log.info("wrote %s: HydroNet %s, %d of %d clusters", path, subset, len(counts), total)
    return path


def _read_file(path: Path, waters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z int64 [G, 3n], pos float32 [G, 3n, 3], y float64 [G]) from one npz, checked."""
    try:
        with np.load(path) as npz:
            z, pos, y = npz["z"], npz["pos"], npz["y"]
    except (OSError, ValueError, KeyError) as err:
        raise StoreError(f"{path}: unreadable HydroNet file (needs z, pos, y): {err}") from err
    atoms = 3 * waters
    if z.ndim != 2 or z.shape[1] != atoms or pos.shape != (*z.shape, 3) or y.shape != z.shape[:1]:
        raise StoreError(
            f"{path}: expected z [G, {atoms}], pos [G, {atoms}, 3], y [G]; "
            f"got {z.shape}, {pos.shape}, {y.shape}"
        )
    return z.astype(np.int64), pos.astype(np.float32), y.astype(np.float64)
