"""The pairs file: exactly the within-cutoff pairs, and never used when stale or corrupt."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from schnet_ipu.data import MoleculeStore, edge_counts, import_qm9, radius_pairs, write_store
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.data.pairs import build_pairs, pairs_path

CUTOFF = 3.0


@pytest.fixture(scope="module")
def qm9(tmp_path_factory) -> MoleculeStore:
    path = import_qm9(tmp_path_factory.mktemp("qm9") / "qm9.h5", limit=300, progress=False)
    return MoleculeStore(path)


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in ((a.i, b.i), (a.j, b.j), (a.offsets, b.offsets)))


def test_pairs_are_each_molecules_pairs_within_the_cutoff(qm9):
    pairs = radius_pairs(qm9, CUTOFF)
    assert pairs.offsets[0] == 0 and len(pairs.offsets) == len(qm9) + 1
    for m in range(len(qm9)):
        _, pos = qm9.molecule(m)
        i, j = molecule_pairs(pos, CUTOFF)  # the per-molecule distance test
        lo, hi = pairs.offsets[m], pairs.offsets[m + 1]
        assert np.array_equal(pairs.i[lo:hi], i.numpy()) and np.array_equal(pairs.j[lo:hi], j)
        d = torch.cdist(torch.from_numpy(pos).double(), torch.from_numpy(pos).double())
        brute = torch.nonzero(torch.triu(d <= CUTOFF, diagonal=1))
        assert abs(len(brute) - (hi - lo)) <= 1  # cdist may round a boundary pair apart
    np.testing.assert_array_equal(edge_counts(qm9, CUTOFF), 2 * pairs.counts)


@pytest.mark.parametrize("damage", ["other_cutoff", "other_store", "corrupt", "truncated"])
def test_a_stale_or_corrupt_pairs_file_is_rebuilt_with_a_warning(qm9, tmp_path, damage):
    path = tmp_path / "qm9.h5"
    shutil.copy(qm9.path, path)
    store = MoleculeStore(path)
    good = radius_pairs(store, CUTOFF)
    file = pairs_path(store, CUTOFF)
    if damage == "other_cutoff":
        radius_pairs(store, 2.0)
        shutil.copy(pairs_path(store, 2.0), file)
    elif damage == "other_store":
        other = tmp_path / "other.h5"
        z, pos = store.concatenated()
        write_store(other, z, pos, {"U0": store.target("U0")}, {"U0": "eV"}, offsets=store.offsets)
        radius_pairs(other, CUTOFF)  # the same molecules, but another store (created stamp)
        shutil.copy(pairs_path(MoleculeStore(other), CUTOFF), file)
    elif damage == "corrupt":
        with np.load(file) as saved:
            arrays = dict(saved)
        arrays["j"] = arrays["j"].copy()
        arrays["j"][len(arrays["j"]) // 2] += 1  # one pair off by one atom
        np.savez(file, **arrays)
    else:
        file.write_bytes(file.read_bytes()[:1000])
    with pytest.warns(UserWarning, match="rebuilding"):
        rebuilt = radius_pairs(store, CUTOFF)
    assert same(rebuilt, good)
    assert same(radius_pairs(store, CUTOFF), good)  # the rebuilt file is valid again


def test_building_is_the_same_in_any_block_size(qm9, monkeypatch):
    from schnet_ipu.data import pairs as module

    whole = build_pairs(qm9, CUTOFF)
    monkeypatch.setattr(module, "_BLOCK_ELEMENTS", 1)  # one molecule per distance block
    assert same(build_pairs(qm9, CUTOFF), whole)
