"""``bench forces``' own pieces, without schnetpack: the frames and split the suite hands to
its peer are the store's, in the files' order, and our side's row on a tiny EMT set."""

from __future__ import annotations

import math
from pathlib import Path

import ase.io
import numpy as np
import pytest

from schnet_ipu.bench import force_step
from schnet_ipu.bench.forces import (
    force_config,
    store_frames,
    train_ours,
    with_units,
    write_split,
)
from schnet_ipu.errors import UserError
from schnet_ipu.training.data import prepare_data
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("restore_threads")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 24-frame EMT cluster set and a small force config on it."""
    root = tmp_path_factory.mktemp("emt")
    frames = load_script("scripts/make_emt_clusters.py").make_frames(
        6, 4, rattle=0.1, seed=3, sizes=(4, 8)
    )
    ase.io.write(root / "emt.extxyz", frames, format="extxyz")
    overrides = [
        f"data.files=[{root / 'emt.extxyz'}]",
        f"data.path={root / 'emt.h5'}",
        "data.val=4",
        "data.test=4",
        "model.hidden_channels=16",
        "model.num_filters=16",
        "model.num_interactions=1",
        "model.num_gaussians=8",
        "optim.warmup_steps=0",
        "optim.beat_baseline=false",  # a 3-second smoke run, too short to learn
        "packing.max_nodes=16",
        "packing.packs_per_batch=2",
    ]
    cfg = force_config(ROOT / "configs/emt_forces.yaml", overrides)
    return cfg, frames, root, overrides


def test_the_peer_gets_the_files_frames_and_our_split(tiny):
    cfg, frames, root, _ = tiny
    data = prepare_data(cfg)
    got = store_frames(data, cfg.data.target)
    assert len(got["z"]) == len(frames)
    for i, atoms in enumerate(frames):
        np.testing.assert_array_equal(got["z"][i], atoms.numbers)
        np.testing.assert_allclose(got["pos"][i], atoms.positions, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["energy"][i], atoms.get_potential_energy(), rtol=1e-12)
        np.testing.assert_allclose(got["forces"][i], atoms.get_forces(), rtol=1e-6, atol=1e-6)
        assert not got["pbc"][i].any()
    write_split(data, root / "split.npz")
    split = np.load(root / "split.npz")
    for ours, theirs in (("train", "train_idx"), ("val", "val_idx"), ("test", "test_idx")):
        np.testing.assert_array_equal(split[theirs], data.split[ours])
    everything = np.concatenate([split["train_idx"], split["val_idx"], split["test_idx"]])
    assert sorted(everything.tolist()) == list(range(len(frames)))


def test_our_side_reports_a_row(tiny):
    cfg, _, root, _ = tiny
    row = with_units(train_ours(cfg, minutes=0.05, run_dir=root / "ours"), 0.05)
    for key in ("test_energy_mae_eV", "test_force_mae", "structures_per_s", "structures_seen"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["test_energy_mae_meV_per_atom"] == pytest.approx(
        1000 * row["test_energy_mae_per_atom"]
    )
    assert row["curve"] and all(len(point) == 3 for point in row["curve"])
    assert 0 < row["seconds"] < 60


def test_an_energy_only_config_is_refused():
    with pytest.raises(UserError, match="force config"):
        force_config(ROOT / "configs/emt_forces.yaml", ["optim.forces_weight=0"])


def test_force_step_times_every_variant(tiny):
    _, _, _, overrides = tiny
    report = force_step.run(ROOT / "configs/emt_forces.yaml", overrides, **force_step.QUICK)
    assert set(report["step_ms"]) == set(force_step.VARIANTS) - set(force_step.CUDA_ONLY)
    assert report["ratio_to_energy"]["energy"] == 1.0 and report["atoms_per_batch"] > 0
    assert all(row["step_ms"] > 0 for row in report["results"])


def test_force_step_times_the_chosen_variants_beside_energy(tiny):
    _, _, _, overrides = tiny
    config = ROOT / "configs/emt_forces.yaml"
    report = force_step.run(config, overrides, rounds=1, steps=1, variants=["forces_table"])
    assert set(report["step_ms"]) == {"energy", "forces_table"}
    assert report["forces_table_over_exact"] is None  # "forces" did not run
    with pytest.raises(UserError, match="no variant forces_everywhere"):
        force_step.run(config, overrides, variants=["forces_everywhere"])
