"""Splits (determinism, reuse, randomness) and pure-torch graphs (vs brute force)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from schnet_ipu.data import (
    MoleculeStore,
    edge_counts,
    import_qm9,
    knn_edges,
    load_or_make_split,
    molecule_pairs,
    radius_edges,
)
from schnet_ipu.data.splits import split_path


@pytest.fixture(scope="module")
def qm9(tmp_path_factory) -> MoleculeStore:
    path = import_qm9(tmp_path_factory.mktemp("qm9") / "qm9.h5", limit=300, progress=False)
    return MoleculeStore(path)


def test_split_fractions_counts_and_cover(tmp_path):
    split = load_or_make_split(tmp_path / "s.h5", 1000, 0.1, 50, seed=3)
    assert (len(split["val"]), len(split["test"]), len(split["train"])) == (100, 50, 850)
    together = np.concatenate(list(split.values()))
    assert np.array_equal(np.sort(together), np.arange(1000))
    assert all(v.dtype == np.int64 for v in split.values())


def test_split_is_random_not_contiguous(tmp_path):
    split = load_or_make_split(tmp_path / "s.h5", 1000, 0.1, 0.1, seed=0)
    for part in ("val", "test"):
        idx = split[part]
        assert idx.max() - idx.min() > 800  # spread over the whole range
        assert np.mean(np.diff(idx) == 1) < 0.5  # not a slice


def test_split_deterministic_saved_and_reused(tmp_path):
    store = tmp_path / "s.h5"
    first = load_or_make_split(store, 500, 0.2, 0.2, seed=1, subset=300)
    path = split_path(store, 500, 0.2, 0.2, 1, 300)
    assert path.is_file() and path.name.endswith(".split.json")
    assert sum(len(v) for v in first.values()) == 300
    saved = json.loads(path.read_text())
    saved["train"] = saved["train"][:5]  # reuse must read the file, not redraw
    path.write_text(json.dumps(saved))
    reused = load_or_make_split(store, 500, 0.2, 0.2, seed=1, subset=300)
    assert len(reused["train"]) == 5
    path.unlink()
    again = load_or_make_split(store, 500, 0.2, 0.2, seed=1, subset=300)
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    other = load_or_make_split(store, 500, 0.2, 0.2, seed=2, subset=300)
    assert not np.array_equal(other["val"], first["val"])
    assert split_path(store, 500, 0.2, 0.2, 2, 300) != path


def test_split_rejects_no_training_data(tmp_path):
    with pytest.raises(ValueError, match="leave no training"):
        load_or_make_split(tmp_path / "s.h5", 10, 5, 5, seed=0)


def brute_force_radius(pos: torch.Tensor, batch: torch.Tensor, cutoff: float) -> set:
    out = set()
    for i in range(len(pos)):
        for j in range(len(pos)):
            same = batch[i] == batch[j]
            if i != j and same and torch.dist(pos[i], pos[j]) <= cutoff:
                out.add((j, i))
    return out


def random_molecules(seed: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 9, (6,), generator=gen)
    batch = torch.repeat_interleave(torch.arange(6), sizes)
    batch = batch[torch.randperm(len(batch), generator=gen)]  # atoms of a molecule interleaved
    pos = torch.rand(len(batch), 3, generator=gen) * 4
    return pos, batch


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_radius_edges_match_brute_force(seed):
    pos, batch = random_molecules(seed)
    edges = radius_edges(pos, 2.0, batch)
    got = set(map(tuple, edges.t().tolist()))
    assert len(got) == edges.shape[1]
    assert got == brute_force_radius(pos, batch, 2.0)
    assert torch.all(batch[edges[0]] == batch[edges[1]])


@pytest.mark.parametrize("seed", [0, 1])
def test_knn_edges_match_brute_force(seed):
    pos, batch = random_molecules(seed)
    k, cutoff = 3, 2.5
    edges = knn_edges(pos, k, cutoff, batch)
    assert torch.all(batch[edges[0]] == batch[edges[1]])
    for i in range(len(pos)):
        others = [j for j in range(len(pos)) if j != i and batch[j] == batch[i]]
        others.sort(key=lambda j: torch.dist(pos[i], pos[j]).item())
        want = {j for j in others[:k] if torch.dist(pos[i], pos[j]) <= cutoff}
        assert set(edges[0, edges[1] == i].tolist()) == want


def test_molecule_pairs_and_edge_counts(qm9):
    counts = edge_counts(qm9, 3.0)
    assert counts.dtype == np.int64 and counts.shape == (len(qm9),)
    assert qm9.path.with_name("qm9.h5.pairs-cutoff3.npz").is_file()
    for i in range(0, len(qm9), 37):
        _, pos = qm9.molecule(i)
        a, b = molecule_pairs(pos, 3.0)
        assert torch.all(a < b)
        assert counts[i] == 2 * len(a) == radius_edges(torch.from_numpy(pos), 3.0).shape[1]
    np.testing.assert_array_equal(edge_counts(qm9.path, 3.0), counts)  # from the cache
    full = edge_counts(qm9, 100.0)
    np.testing.assert_array_equal(full, qm9.num_atoms * (qm9.num_atoms - 1))
