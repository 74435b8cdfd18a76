"""``bench forces --peer mace``: MACE's side trains for a few seconds on a handful of EMT frames
beside ours, each in its own process, and reports finite errors and a validation curve."""

from __future__ import annotations

import math
from pathlib import Path

import ase.io
import pytest

from schnet_ipu.bench import forces
from schnet_ipu.errors import UserError
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 3.0


def tiny_overrides(root: Path) -> list[str]:
    """A 24-frame EMT cluster set and a small model of ours on it."""
    frames = load_script("scripts/make_emt_clusters.py").make_frames(
        6, 4, rattle=0.1, seed=3, sizes=(4, 8)
    )
    ase.io.write(root / "emt.extxyz", frames, format="extxyz")
    return [f"data.files=[{root / 'emt.extxyz'}]", f"data.path={root / 'emt.h5'}",
            "data.val=4", "data.test=4", "model.hidden_channels=16", "model.num_filters=16",
            "model.num_interactions=1", "model.num_gaussians=8", "optim.warmup_steps=0",
            "optim.beat_baseline=false", "packing.max_nodes=16",
            "packing.packs_per_batch=2"]  # fmt: skip


def test_an_unknown_peer_is_refused():
    with pytest.raises(UserError, match="--peer nequip: not a peer"):
        forces.run(minutes=0.01, peer="nequip")


def test_the_mace_side_trains_beside_ours(tmp_path):
    pytest.importorskip("mace", reason="mace-torch is a bench-only extra: pip install -e .[bench]")
    report = forces.run(minutes=SECONDS / 60, config=ROOT / "configs/emt_forces.yaml",
                        overrides=tiny_overrides(tmp_path), peer="mace",
                        out_dir=tmp_path / "out")  # fmt: skip
    theirs, ours = report["results"]
    assert theirs["name"].startswith("MACE ") and ours["name"] == "ours"
    for key in ("test_energy_mae_eV", "test_energy_mae_per_atom", "test_force_mae"):
        assert math.isfinite(theirs[key]) and theirs[key] > 0, key
    assert theirs["structures_seen"] > 0 and theirs["structures_per_s"] > 0
    assert theirs["epochs"] == pytest.approx(theirs["structures_seen"] / 16)  # 16 train frames
    assert SECONDS <= theirs["seconds"] < 60  # it trains until its budget is spent
    curve = theirs["curve"]
    assert len(curve) >= 1 and all(len(point) == 3 for point in curve)
    assert all(math.isfinite(value) and value > 0 for point in curve for value in point)
    assert [point[0] for point in curve] == sorted(point[0] for point in curve)
    assert "64x0e" in theirs["recipe"] and "float32" in theirs["recipe"]
    assert report["ratios"]["force_mae_ours_over_mace"] == pytest.approx(
        ours["test_force_mae"] / theirs["test_force_mae"]
    )
    assert (tmp_path / "out" / "forces_vs_time.png").stat().st_size > 0
