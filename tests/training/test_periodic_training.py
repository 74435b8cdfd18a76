"""Periodic data end to end: stress in the loss and the metrics, and trained models on
periodic Atoms (calculator stress against ASE's finite differences, supercells, predict)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.calculators.fd import calculate_numerical_stress

from schnet_ipu.config import ConfigError, load_config
from schnet_ipu.inference.calculator import SchNetCalculator
from schnet_ipu.training.log import read_records
from schnet_ipu.training.loop import train
from tests.helpers import load_script, tiny_model

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("restore_threads")


@pytest.fixture(scope="module")
def frames_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bulk") / "bulk.extxyz"
    ase.io.write(
        path,
        load_script("scripts/make_emt_bulk.py").make_frames(48, 0.03, 0.05, seed=1),
        format="extxyz",
    )
    return path


def bulk_config(frames: Path, root: Path, *extra: str):
    return load_config(
        ROOT / "configs/emt_bulk.yaml",
        [
            f"data.files=[{frames}]",
            f"data.path={root / 'bulk.h5'}",
            "data.val=8",
            "data.test=8",
            "packing.packs_per_batch=2",
            *tiny_model(16),
            "optim.epochs=2",
            "optim.warmup_steps=0",
            "optim.beat_baseline=false",  # a smoke run, too short to learn
            "logging.progress=false",
            "logging.plot=false",
            f"logging.run_dir={root / 'run'}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def trained(frames_file, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    train(bulk_config(frames_file, root, "optim.stress_weight=1.0"))
    return root / "run"


def test_stress_is_trained_and_scored(trained):
    for record in read_records(trained / "metrics.jsonl", "epoch"):
        assert math.isfinite(record["val_stress_mae"]) and record["val_stress_mae"] > 0
    [final] = read_records(trained / "metrics.jsonl", "final")
    assert final["test_stress_mae"] > 0 and final["baseline_stress_mae"] > 0
    state = torch.load(trained / "checkpoints/best.pt", weights_only=True)
    assert state["model_spec"]["task"]["stress_weight"] == 1.0


def test_calculator_stress_is_the_strain_derivative_and_supercells_agree(trained):
    """float64: stress equals ASE's finite-difference stress; a 2x2x2 supercell has the
    cell's energy per atom and stress (a cell of 2.5 A edges, shorter than the 5 A cutoff)."""
    atoms = bulk("Cu", "fcc", a=3.6)  # primitive cell: 1 atom, edges 2.55 A
    atoms.set_cell(
        atoms.cell.array @ (np.eye(3) + np.array([[0.01, 0.02, 0], [0.02, -0.01, 0], [0, 0, 0]])),
        scale_atoms=True,
    )
    atoms.calc = SchNetCalculator(trained)
    stress = atoms.get_stress()
    numeric = calculate_numerical_stress(atoms, eps=1e-5)
    np.testing.assert_allclose(stress, numeric, rtol=1e-2, atol=1e-6)
    big = atoms.repeat((2, 2, 2))
    big.calc = SchNetCalculator(trained)
    assert big.get_potential_energy() / len(big) == pytest.approx(
        atoms.get_potential_energy() / len(atoms), abs=1e-6
    )
    np.testing.assert_allclose(big.get_stress(), stress, atol=1e-7)


def test_predict_writes_stress_of_periodic_frames(trained, frames_file, tmp_path):
    out = tmp_path / "out.extxyz"
    model = trained / "checkpoints/best.pt"
    command = [sys.executable, str(ROOT / "train.py"), "predict", "--model", str(model),
               "--input", str(frames_file), "--out", str(out)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    written = ase.io.read(out, index=":")
    first = ase.io.read(frames_file, index=0)
    first.calc = SchNetCalculator(model, dtype=torch.float32)
    np.testing.assert_allclose(written[0].get_stress(), first.get_stress(), rtol=1e-4, atol=1e-6)


def test_stress_weight_without_stress_is_refused(tmp_path):
    from tests.training.test_forces import emt_frames

    path = tmp_path / "clusters.extxyz"
    ase.io.write(path, emt_frames(24), format="extxyz")
    cfg = bulk_config(path, tmp_path, "optim.stress_weight=1.0")
    with pytest.raises(ConfigError, match="holds no stress"):
        train(cfg)
