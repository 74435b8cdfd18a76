"""HydroNet-scale synthetic water (sampled around templates), the streaming writer and the
streaming HydroNet import: physics checked by independent code, resume, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from schnet_ipu.data import MoleculeStore, StoreError, import_hydronet, water_sampled
from schnet_ipu.data.water_sampled import generate_water_sampled, size_counts
from schnet_ipu.data.writer import StoreWriter, partial_path
from schnet_ipu.training import dressed_atoms
from schnet_ipu.training.dressed_atoms import element_counts

SIZES = (3, 6)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> MoleculeStore:
    out = tmp_path_factory.mktemp("ws") / "water.h5"
    return MoleculeStore(generate_water_sampled(out, 600, SIZES, templates=3, progress=False))


def reference_tip3p(pos: np.ndarray) -> float:
    """TIP3P interaction energy (kcal/mol) of waters pos [3w, 3] (O, H, H each), pair by pair:
    Coulomb 332.0637 q_a q_b / r over atoms of different waters + 4 eps ((s/r)^12 - (s/r)^6)
    over O-O pairs; q = -0.834, 0.417, 0.417 e; s = 3.15061 A, eps = 0.1521 kcal/mol."""
    charges = (-0.834, 0.417, 0.417)
    waters = len(pos) // 3
    total = 0.0
    for i in range(waters):
        for j in range(i + 1, waters):
            for a in range(3):
                for b in range(3):
                    r = math.dist(pos[3 * i + a], pos[3 * j + b])
                    total += 332.0637 * charges[a] * charges[b] / r
            s6 = (3.15061 / math.dist(pos[3 * i], pos[3 * j])) ** 6
            total += 4 * 0.1521 * (s6 * s6 - s6)
    return total


def test_sampled_clusters_are_physical(sampled):
    assert sampled.attrs["synthetic"] is True and sampled.attrs["source"] == "synthetic-tip3p"
    assert sampled.unit("energy") == "kcal/mol" and len(sampled) == 600
    energies = sampled.target("energy")
    assert np.isfinite(energies).all()
    rng = np.random.default_rng(1)
    for i in rng.choice(len(sampled), 60, replace=False):
        z, pos = sampled.molecule(i)
        pos = pos.astype(np.float64)
        waters = len(z) // 3
        assert SIZES[0] <= waters <= SIZES[1] and len(z) == 3 * waters
        assert z.tolist() == [8, 1, 1] * waters  # each O followed by its 2 H
        o, h1, h2 = pos[0::3], pos[1::3], pos[2::3]
        for h in (h1, h2):
            np.testing.assert_allclose(np.linalg.norm(h - o, axis=1), 0.9572, atol=2e-5)
        cos = np.sum((h1 - o) * (h2 - o), axis=1) / (
            np.linalg.norm(h1 - o, axis=1) * np.linalg.norm(h2 - o, axis=1)
        )
        np.testing.assert_allclose(np.degrees(np.arccos(cos)), 104.52, atol=5e-3)
        dist = np.linalg.norm(pos[:, None] - pos[None], axis=-1)
        same = np.repeat(np.arange(waters), 3)
        other = same[:, None] != same[None]
        assert dist[other].min() >= 1.5
        assert dist[~np.eye(len(z), dtype=bool)].min() >= 0.8
        assert -15 * waters < energies[i] < 0  # bound: a few kcal/mol of binding per water


def test_sampled_energies_match_independent_tip3p(sampled):
    energies = sampled.target("energy")
    for i in np.random.default_rng(2).choice(len(sampled), 25, replace=False):
        _, pos = sampled.molecule(i)
        assert energies[i] == pytest.approx(reference_tip3p(pos.astype(np.float64)), abs=1e-8)


def test_sampled_clusters_differ_from_each_other(sampled):
    energies = sampled.target("energy")[sampled.num_atoms == 18]  # the 6-water clusters
    assert len(np.unique(np.round(energies, 6))) > 0.9 * len(energies)


def test_size_counts_hydronet_and_uniform():
    counts = size_counts(4_464_740, (3, 30), "hydronet")
    assert sum(counts.values()) == 4_464_740 and list(counts) == list(range(3, 31))
    assert sum(counts[w] for w in range(3, 26)) == pytest.approx(2_700_000, abs=25)
    assert counts[4] == pytest.approx(2 * counts[3], abs=2)
    assert len({counts[w] for w in range(26, 31)}) == 1
    assert size_counts(10, (3, 4)) == {3: 5, 4: 5}
    with pytest.raises(ValueError, match=r"none in 31\.\.40"):
        size_counts(10, (31, 40), "hydronet")


def test_interrupted_generation_resumes_to_the_same_store(tmp_path, monkeypatch):
    monkeypatch.setattr(water_sampled, "CHUNK_ATOMS", 200)  # several chunks per size
    whole = generate_water_sampled(tmp_path / "whole.h5", 60, (3, 4), templates=2, progress=False)
    whole = MoleculeStore(whole)
    out = tmp_path / "cut.h5"
    real_append = StoreWriter.append
    calls = []

    def disk_full_on_third(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real_append(self, *args)

    monkeypatch.setattr(StoreWriter, "append", disk_full_on_third)
    with pytest.raises(OSError, match="No space"):
        generate_water_sampled(out, 60, (3, 4), templates=2, progress=False)
    assert not out.exists() and partial_path(out).exists()
    with pytest.raises(StoreError, match="incomplete store"):
        MoleculeStore(partial_path(out))
    monkeypatch.setattr(StoreWriter, "append", real_append)
    resumed = MoleculeStore(generate_water_sampled(out, 60, (3, 4), templates=2, progress=False))
    assert not partial_path(out).exists()
    np.testing.assert_array_equal(resumed.target("energy"), whole.target("energy"))
    np.testing.assert_array_equal(resumed.concatenated()[1], whole.concatenated()[1])
    np.testing.assert_array_equal(resumed.ids, np.arange(60))


def test_writer_checks_and_discards_other_partials(tmp_path):
    path = tmp_path / "s.h5"
    writer = StoreWriter(path, np.array([3, 3]), {"energy": "kcal/mol"}, key="a")
    with pytest.raises(
        StoreError, match=r"record 0 \(molecule 0\) has a non-finite target 'energy'"
    ):
        writer.append(np.array([8, 1, 1]), np.zeros((3, 3)), {"energy": [np.nan]}, [0])
    with pytest.raises(StoreError, match="expected 3 atoms"):
        writer.append(np.array([8, 1]), np.zeros((2, 3)), {"energy": [1.0]}, [0])
    writer.append(np.array([8, 1, 1]), np.ones((3, 3)), {"energy": [1.0]}, [0])
    with pytest.raises(StoreError, match="only 1 of 2"):
        writer.finish()
    writer.close()
    again = StoreWriter(path, np.array([3, 3]), {"energy": "kcal/mol"}, key="b")
    assert again.written == 0  # another key: the old partial file is not resumed
    again.close()


def write_raw(raw, sizes, per_file: int = 5) -> None:
    raw.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for n in sizes:
        z = np.tile(np.array([8, 1, 1]), (per_file, n))
        pos = rng.normal(size=(per_file, 3 * n, 3)).astype(np.float32) * 3
        y = -10.0 * n - np.arange(per_file)
        np.savez(raw / f"W{n}_geoms_all.npz", z=z, pos=pos, y=y, num_graphs=per_file)


def test_hydronet_large_streams_and_names_a_truncated_file(tmp_path):
    raw = tmp_path / "raw"
    write_raw(raw, range(3, 31))
    large = MoleculeStore(import_hydronet(raw, tmp_path / "large.h5", "large", progress=False))
    assert len(large) == 28 * 5 and large.ids[-1] == 30 * 10**8 + 4
    with np.load(raw / "W30_geoms_all.npz") as f:
        np.testing.assert_array_equal(large.molecule(len(large) - 1)[1], f["pos"][4])
    bad = raw / "W17_geoms_all.npz"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(StoreError, match=r"W17_geoms_all\.npz"):
        import_hydronet(raw, tmp_path / "again.h5", "large", progress=False)
    assert not (tmp_path / "again.h5").exists()


@pytest.mark.parametrize("group_atoms", [1, 7, 1 << 24])  # counted in groups, or at once
def test_element_counts_match_per_molecule_bincount(monkeypatch, group_atoms):
    monkeypatch.setattr(dressed_atoms, "COUNT_ATOMS", group_atoms)
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 6, size=40)  # includes empty molecules
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    z = rng.choice(np.array([1, 6, 8, 118], dtype=np.uint8), size=offsets[-1])
    counts = element_counts(z, offsets)
    assert counts.elements.tolist() == [1, 6, 8, 118]  # the elements present, no others
    for m in range(len(sizes)):
        expected = np.bincount(z[offsets[m] : offsets[m + 1]], minlength=119)
        dense = np.zeros(119, dtype=np.int64)
        dense[counts.elements] = counts.table[m]
        np.testing.assert_array_equal(dense, expected)
    np.testing.assert_array_equal(counts.totals(), np.bincount(z, minlength=119))
