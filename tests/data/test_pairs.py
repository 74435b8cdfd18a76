"""The pairs file: exactly the within-cutoff pairs, and never used when stale or corrupt."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from schnet_ipu.config import load_config
from schnet_ipu.data import MoleculeStore, edge_counts, import_qm9, radius_pairs, write_store
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.data.pairs import build_pairs, pairs_path
from schnet_ipu.data.pairs_file import RadiusPairs
from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.training.data import prepare_data

CUTOFF = 3.0


pytestmark = pytest.mark.usefixtures("feed_program")  # every test on both programs


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


def per_molecule(positions: list[np.ndarray], cutoff: float) -> RadiusPairs:
    """The reference: each molecule alone through within_cutoff on its [1, n, 3] block, then
    the nonzero of the upper triangle (:func:`molecule_pairs`)."""
    found = [molecule_pairs(pos, cutoff) for pos in positions]
    offsets = np.concatenate([[0], np.cumsum([len(i) for i, _ in found])])
    i = np.concatenate([i.numpy() for i, _ in found])
    j = np.concatenate([j.numpy() for _, j in found])
    return RadiusPairs(i, j, offsets, cutoff)


def assert_same(built: RadiusPairs, reference: RadiusPairs) -> None:
    np.testing.assert_array_equal(built.offsets, reference.offsets)
    np.testing.assert_array_equal(built.i, reference.i)
    np.testing.assert_array_equal(built.j, reference.j)


@pytest.mark.parametrize("block", [None, 2000], ids=["one-run", "runs-of-5"])
@pytest.mark.parametrize("cutoff", [6.0, 2.5])
def test_the_build_equals_each_molecule_alone_on_real_qm9(qm9_store, monkeypatch, cutoff, block):
    from schnet_ipu.data import pairs as module

    if block is not None:  # runs of a few molecules of mixed sizes, each padded differently
        monkeypatch.setattr(module, "_BLOCK_ELEMENTS", block)
    store = MoleculeStore(qm9_store)
    reference = per_molecule([store.molecule(m)[1] for m in range(len(store))], cutoff)
    built = build_pairs(store, cutoff)
    assert_same(built, reference)
    sizes = store.num_atoms
    assert built.i.dtype == np.uint8 and 0 < len(built.i) < (sizes * (sizes - 1) // 2).sum()
    assert_same(build_pairs(store, cutoff, store.concatenated()[1]), reference)


def on_cutoff_spheres(rng: np.random.Generator, sizes, cutoff: float) -> list[np.ndarray]:
    """float32 [n, 3] molecules whose atoms 1..n-1 lie on spheres of radius cutoff, cutoff / 2
    and cutoff / sqrt(2) around atom 0 before rounding to float32, so that many pairs (to
    atom 0 and between the others) are within rounding of the cutoff."""
    molecules = []
    for n in sizes:
        centre = rng.uniform(-20, 20, 3)
        direction = rng.normal(size=(n - 1, 3))
        direction /= np.linalg.norm(direction, axis=1, keepdims=True)
        radius = cutoff * rng.choice([1.0, 0.5, 0.5**0.5], size=(n - 1, 1))
        molecules.append(np.concatenate([centre[None], centre + radius * direction]))
    return [m.astype(np.float32) for m in molecules]


def float32_test(pos: np.ndarray, cutoff: float, order: str = "xyz", wide: bool = False):
    """bool [n(n-1)/2] pairs i < j (i, then j) within the cutoff, by float32 numpy: squares
    summed in ``order``; ``wide``: compared with cutoff**2 in float64 instead."""
    i, j = np.triu_indices(len(pos), 1)
    square = (pos[i] - pos[j]) ** 2  # float32 [P, 3]
    x, y, z = square.T
    total = (x + y) + z if order == "xyz" else x + (y + z)
    limit = cutoff * cutoff
    return total.astype(np.float64) <= limit if wide else total <= np.float32(limit)


@pytest.mark.parametrize("cutoff", [6.0, 3.3])  # 3.3**2 is not a float32
def test_the_build_keeps_the_float32_arithmetic_at_the_cutoff(tmp_path, monkeypatch, cutoff):
    """Pairs at the cutoff up to float32 rounding: the build must find exactly the pairs of
    squares summed x, then y, then z in float32 and compared with cutoff**2 in float32."""
    from schnet_ipu.data import pairs as module

    rng = np.random.default_rng(0)
    molecules = on_cutoff_spheres(rng, [1, 2, 3, *rng.integers(2, 40, 200)], cutoff)
    exact = np.array([[0, 0, 0], [6, 0, 0], [0, -6, 0], [2, 4, 4], [2, 4, 4], [0, 0, 6]])
    exact = exact.astype(np.float32)
    exact[4, 2] = np.nextafter(np.float32(4), np.float32(5))  # just beyond 6 from atom 0
    if cutoff == 6.0:
        molecules.insert(5, exact)
    test = [float32_test(pos, cutoff) for pos in molecules]
    # the set tells the arithmetic apart: other ways of computing differ on some pairs
    for other in ({"order": "zyx"}, {"wide": True}):
        changed = [float32_test(pos, cutoff, **other) for pos in molecules]
        if other == {"wide": True} and cutoff == 6.0:
            continue  # 36 is a float32: comparing in float64 changes nothing
        assert sum(int((a != b).sum()) for a, b in zip(test, changed)) > 0, other
    distance = [np.linalg.norm(p[:, None].astype(np.float64) - p[None], axis=-1) for p in molecules]
    in_float64 = [d[np.triu_indices(len(d), 1)] <= cutoff for d in distance]
    assert sum(int((a != b).sum()) for a, b in zip(test, in_float64)) > 0
    if cutoff == 6.0:  # distance exactly the cutoff is within it, a float32 step more is not
        i, j = np.triu_indices(len(exact), 1)
        within = dict(zip(zip(i.tolist(), j.tolist()), float32_test(exact, cutoff).tolist()))
        assert within[0, 1] and within[0, 2] and within[0, 3] and within[0, 5]
        assert not within[0, 4]

    path = tmp_path / "spheres.h5"
    z = [np.ones(len(pos), dtype=np.uint8) for pos in molecules]
    write_store(path, z, molecules, {"U0": np.zeros(len(molecules))}, {"U0": "eV"})
    store = MoleculeStore(path)
    expected = RadiusPairs(
        np.concatenate([np.triu_indices(len(p), 1)[0][t] for p, t in zip(molecules, test)]),
        np.concatenate([np.triu_indices(len(p), 1)[1][t] for p, t in zip(molecules, test)]),
        np.concatenate([[0], np.cumsum([t.sum() for t in test])]),
        cutoff,
    )
    assert_same(per_molecule(molecules, cutoff), expected)  # within_cutoff itself
    assert_same(build_pairs(store, cutoff), expected)
    monkeypatch.setattr(module, "_BLOCK_ELEMENTS", 1000)  # many runs, mixed widths
    assert_same(build_pairs(store, cutoff), expected)


def test_a_cold_radius_run_reads_the_atoms_once_and_feeds_the_same(
    qm9_store, tmp_path, monkeypatch
):
    path = tmp_path / "qm9.h5"
    shutil.copy(qm9_store, path)  # no pairs file yet: preparing builds it
    reads = []
    read_all = MoleculeStore._read_all

    def counted(self, name):
        reads.append(name)
        return read_all(self, name)

    monkeypatch.setattr(MoleculeStore, "_read_all", counted)
    overrides = [f"data.path={path}", "data.subset=0", "data.val=100", "data.test=100"]
    cfg = load_config(None, [*overrides, "model.graph=radius", f"logging.run_dir={tmp_path}"])
    data = prepare_data(cfg)
    feed = data.feed_arrays("cpu")
    assert sorted(reads) == ["pos", "z"] and data.atoms is None  # dropped once fed
    assert pairs_path(data.store, cfg.model.cutoff).is_file()

    store = MoleculeStore(path)
    fresh = FeedArrays.from_store(store, data.targets, radius_pairs(store, cfg.model.cutoff))
    for field in dataclasses.fields(FeedArrays):
        ours, theirs = getattr(feed, field.name), getattr(fresh, field.name)
        if isinstance(ours, torch.Tensor):
            assert torch.equal(ours, theirs), field.name
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=field.name)
