"""Synthetic TIP3P water clusters, HydroNet npz import, ensure_store and the CLI."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from schnet_ipu.config import DataConfig
from schnet_ipu.data import MoleculeStore, StoreError, ensure_store, generate_water, import_hydronet
from schnet_ipu.data.__main__ import main as cli
from schnet_ipu.data.water import tip3p_energy, water_atoms


@pytest.fixture(scope="module")
def water(tmp_path_factory) -> MoleculeStore:
    path = generate_water(tmp_path_factory.mktemp("w") / "water.h5", 6, sizes=(2, 4), seed=0)
    return MoleculeStore(path)


def test_dimer_energy_by_hand():
    """Coulomb over the 9 intermolecular charge pairs plus O-O Lennard-Jones, written out."""
    atoms = water_atoms(
        torch.tensor([[[0.0, 0.0, 0.0], [2.9, 0.3, -0.2]]], dtype=torch.float64),
        torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.3, 0.5, -0.2, 0.8]]], dtype=torch.float64),
    )[0]
    charges = [-0.834, 0.417, 0.417]
    expected = 0.0
    for a, b in itertools.product(range(3), range(3)):
        expected += 332.0637 * charges[a] * charges[b] / float(torch.dist(atoms[0, a], atoms[1, b]))
    r = float(torch.dist(atoms[0, 0], atoms[1, 0]))
    expected += 4 * 0.1521 * ((3.15061 / r) ** 12 - (3.15061 / r) ** 6)
    assert float(tip3p_energy(atoms[None])[0]) == pytest.approx(expected, rel=1e-12)
    oh = float(torch.dist(atoms[1, 0], atoms[1, 1]))
    hoh = torch.nn.functional.cosine_similarity(
        atoms[1, 1] - atoms[1, 0], atoms[1, 2] - atoms[1, 0], 0
    )
    assert oh == pytest.approx(0.9572) and math.degrees(math.acos(hoh)) == pytest.approx(104.52)


def test_water_clusters_are_physical(water):
    assert water.attrs["synthetic"] is True and water.attrs["source"] == "synthetic-tip3p"
    assert water.unit("energy") == "kcal/mol"
    energies = water.target("energy")
    for i in range(len(water)):
        z, pos = water.molecule(i)
        waters = len(z) // 3
        assert 2 <= waters <= 4 and z.tolist() == [8, 1, 1] * waters
        atoms = torch.from_numpy(pos.astype(np.float64)).reshape(1, waters, 3, 3)
        # stored energy is the model's energy of the stored structure (float32 positions)
        assert float(tip3p_energy(atoms)[0]) == pytest.approx(energies[i], abs=1e-3)
        oxygens = atoms[0, :, 0]
        dist = torch.cdist(oxygens, oxygens) + torch.eye(waters) * 100
        nearest = dist.min(dim=1).values
        assert torch.all((nearest > 2.55) & (nearest < 3.05)), nearest
        assert -7 * waters < energies[i] < -2 * waters  # bound: a few kcal/mol per water


def test_water_deterministic_and_size_weights(tmp_path, water):
    again = MoleculeStore(generate_water(tmp_path / "a.h5", 6, sizes=(2, 4), seed=0))
    np.testing.assert_array_equal(again.target("energy"), water.target("energy"))
    np.testing.assert_array_equal(again.molecule(5)[1], water.molecule(5)[1])
    only_three = MoleculeStore(
        generate_water(tmp_path / "b.h5", 4, sizes=(2, 4), seed=1, weights=[0, 1, 0])
    )
    assert set(only_three.num_atoms.tolist()) == {9}


def write_hydronet(raw, sizes, per_file: int = 7) -> None:
    raw.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for n in sizes:
        z = np.tile(np.array([8, 1, 1], dtype=np.int8), (per_file, n))
        pos = rng.normal(size=(per_file, 3 * n, 3)).astype(np.float16) * 3
        y = (-10.0 * n - np.arange(per_file)).astype(np.float32)
        np.savez(raw / f"W{n}_geoms_all.npz", z=z, pos=pos, y=y, num_graphs=per_file)


def test_hydronet_subsets(tmp_path, caplog):
    raw = tmp_path / "raw"
    write_hydronet(raw, range(3, 31))
    large = MoleculeStore(import_hydronet(raw, tmp_path / "large.h5", "large"))
    medium = MoleculeStore(import_hydronet(raw, tmp_path / "medium.h5", "medium"))
    assert len(large) == 28 * 7 and len(medium) == 23 * 7
    assert large.num_atoms.max() == 90 and medium.num_atoms.max() == 75
    assert large.unit("energy") == "kcal/mol" and large.attrs["source"] == "hydronet"
    assert large.ids[7] == 4 * 10**8 and large.target("energy")[7] == pytest.approx(-40.0)
    with np.load(raw / "W5_geoms_all.npz") as f:
        row = int(np.flatnonzero(large.ids == 5 * 10**8 + 3)[0])
        np.testing.assert_array_equal(large.molecule(row)[1], f["pos"][3].astype(np.float32))
    with caplog.at_level("WARNING"):
        small_all = MoleculeStore(import_hydronet(raw, tmp_path / "all.h5", "small"))
    assert len(small_all) == len(medium) and "taking all" in caplog.text
    small = MoleculeStore(import_hydronet(raw, tmp_path / "s.h5", "small", seed=1, sample_size=50))
    again = MoleculeStore(import_hydronet(raw, tmp_path / "s2.h5", "small", seed=1, sample_size=50))
    assert len(small) == 50 and len(set(small.ids.tolist())) == 50
    assert small.num_atoms.max() <= 75
    np.testing.assert_array_equal(small.ids, again.ids)


def test_hydronet_missing_files(tmp_path):
    write_hydronet(tmp_path, [3, 4, 5])
    with pytest.raises(StoreError, match=r"missing: W6_geoms_all\.npz, W7_geoms_all\.npz"):
        import_hydronet(tmp_path, tmp_path / "out.h5", "medium")
    assert not (tmp_path / "out.h5").exists()


def test_ensure_store_and_cli(tmp_path, capsys):
    cfg = DataConfig(source="water", path=str(tmp_path / "w.h5"), water_clusters=3)
    cfg.water_sizes = [2, 3]
    path = ensure_store(cfg)
    assert len(MoleculeStore(path)) == 3
    assert ensure_store(cfg) == path  # present: reused, not regenerated
    sampled = DataConfig(source="water", path=str(tmp_path / "s.h5"), water_clusters=40)
    sampled.water_sizes, sampled.water_templates = [3, 4], 2  # the water_4m5.yaml path
    store = MoleculeStore(ensure_store(sampled, progress=False))
    assert len(store) == 40 and store.attrs["synthetic"]
    with pytest.raises(StoreError, match=r"needs data\.raw_dir"):
        ensure_store(DataConfig(source="hydronet", path=str(tmp_path / "h.h5")))
    assert cli(["import", "qm9", "--limit", "20", "--out", str(tmp_path / "q.h5")]) == 0
    png = tmp_path / "stats.png"
    assert cli(["stats", str(tmp_path / "q.h5"), "--cutoff", "6", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "20 molecules" in out and "sparsity" in out and png.stat().st_size > 1000
    assert cli(["stats", str(tmp_path / "nope.h5")]) == 2
