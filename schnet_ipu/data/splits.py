"""Train/val/test splits: random over molecules, drawn from a seed, saved beside the store.

A saved split is checked before use: every index an integer in range, no duplicates, no
molecule in two parts. A damaged file is refused with a message naming it (never trained on).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from .checks import StoreError

log = logging.getLogger(__name__)


def split_path(
    store_path: str | Path, num_molecules: int, val: float, test: float, seed: int, subset: int
) -> Path:
    """The JSON file for these parameters, beside the store (different parameters never collide)."""
    store_path = Path(store_path)
    name = f"{store_path.stem}_n{num_molecules}_val{val:g}_test{test:g}_seed{seed}_sub{subset}"
    return store_path.with_name(name + ".split.json")


def make_split(
    num_molecules: int, val: float, test: float, seed: int, subset: int = 0
) -> dict[str, np.ndarray]:
    """Draw sorted int64 index arrays ``train``, ``val``, ``test`` over ``range(num_molecules)``.

    ``val`` and ``test`` are fractions of the (subset of) molecules when < 1, else counts.
    ``subset > 0`` first draws that many molecules at random; the rest are unused.
    """
    if subset > num_molecules:
        raise ValueError(f"subset={subset} is larger than the {num_molecules} molecules")
    order = np.random.default_rng(seed).permutation(num_molecules)
    if subset > 0:
        order = order[:subset]
    total = len(order)
    n_val, n_test = (round(v * total) if v < 1 else int(v) for v in (val, test))
    if n_val + n_test >= total:
        raise ValueError(
            f"val={val} ({n_val}) + test={test} ({n_test}) leave no training molecules out of "
            f"{total}; lower them"
        )
    parts = {
        "val": order[:n_val],
        "test": order[n_val : n_val + n_test],
        "train": order[n_val + n_test :],
    }
    return {name: np.sort(part).astype(np.int64) for name, part in parts.items()}


def check_split(path: Path, parts: dict[str, object], num_molecules: int) -> dict[str, np.ndarray]:
    """The saved ``parts`` as int64 arrays, or :class:`StoreError` naming ``path`` and what is
    wrong: non-integers, indices out of range, duplicates, overlap between parts."""
    arrays: dict[str, np.ndarray] = {}
    for name, values in parts.items():
        array = np.asarray(values)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            _refuse(path, f"the {name} part is not a list of integer indices")
        array = array.astype(np.int64)
        outside = array[(array < 0) | (array >= num_molecules)]
        if outside.size:
            _refuse(
                path,
                f"the {name} part holds index {int(outside[0])}, outside the store's "
                f"0..{num_molecules - 1}",
            )
        unique, counts = np.unique(array, return_counts=True)
        if np.any(counts > 1):
            _refuse(path, f"the {name} part holds index {int(unique[counts > 1][0])} twice")
        for other, indices in arrays.items():
            both = np.intersect1d(indices, array)
            if both.size:
                _refuse(path, f"index {int(both[0])} is in both the {other} and {name} parts")
        arrays[name] = np.sort(array)
    return arrays


def _refuse(path: Path, problem: str) -> None:
    raise StoreError(f"{path}: damaged split file: {problem}; delete it to draw the split again")


def load_or_make_split(
    store_path: str | Path,
    num_molecules: int,
    val: float,
    test: float,
    seed: int,
    subset: int = 0,
) -> dict[str, np.ndarray]:
    """Reuse the saved split for these parameters, or draw it and save it atomically."""
    path = split_path(store_path, num_molecules, val, test, seed, subset)
    params = {"num_molecules": num_molecules, "val": val, "test": test, "seed": seed}
    params["subset"] = subset
    if path.is_file():
        parts = None
        try:
            saved = json.loads(path.read_text())
            if saved["params"] == params:
                parts = {k: saved[k] for k in ("train", "val", "test")}
            else:
                log.warning("%s holds a split for %s; drawing it again", path, saved["params"])
        except (ValueError, KeyError, TypeError) as err:
            log.warning("%s is unreadable (%s); drawing the split again", path, err)
        if parts is not None:
            return check_split(path, parts, num_molecules)
    split = make_split(num_molecules, val, test, seed, subset)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"params": params, **{k: v.tolist() for k, v in split.items()}}))
    os.replace(tmp, path)
    log.info(
        "split saved to %s: train %d, val %d, test %d",
        path,
        *(len(split[k]) for k in ("train", "val", "test")),
    )
    return split
