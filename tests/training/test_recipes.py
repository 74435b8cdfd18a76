"""Recipes as defaults: the data picks the measured recipe, every key the user set wins, and the
resolved config and the run's first log line say which recipe applied and why."""

from __future__ import annotations

from pathlib import Path

import ase.io
import numpy as np
import pytest
import yaml
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator

from schnet_ipu.config import Config, ConfigError, resolve_config
from schnet_ipu.config_schema import OptimConfig
from schnet_ipu.recipes import RECIPES
from tests.helpers import random_store, run_train
from tests.training.test_forces import emt_frames


def labelled_cells(count: int) -> list[Atoms]:
    """Rattled fcc Cu cells with EMT energies, forces and stress."""
    rng = np.random.default_rng(3)
    frames = []
    for _ in range(count):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
        atoms.calc = EMT()
        results = {
            "energy": atoms.get_potential_energy(),
            "forces": atoms.get_forces(),
            "stress": atoms.get_stress(),
        }
        atoms.calc = SinglePointCalculator(atoms, **results)
        frames.append(atoms)
    return frames


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("recipes")
    clusters, cells = folder / "clusters.extxyz", folder / "cells.extxyz"
    ase.io.write(clusters, emt_frames(80), format="extxyz")
    ase.io.write(cells, labelled_cells(4), format="extxyz")
    return {
        "clusters": clusters,
        "cells": cells,
        "energies": random_store(folder / "energies.h5", molecules=40, seed=1),
    }


def ase_overrides(files: Path, tmp_path: Path, *extra: str) -> list[str]:
    """A first-guess config of a user's own file: the data keys only."""
    return [
        "data.source=ase",
        f"data.files=[{files}]",
        "data.target=energy",
        f"data.path={tmp_path / 's.h5'}",
        *extra,
    ]


def value(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def test_forces_in_the_data_give_the_force_recipe(data, tmp_path):
    cfg, recipe = resolve_config(
        None, ase_overrides(data["clusters"], tmp_path, "backend.device=cpu")
    )
    assert recipe.name == cfg.recipe == "forces"
    assert "forces, no cells" in recipe.why
    for key, expected in RECIPES["forces"].items():
        assert value(cfg, key) == expected, key
    assert cfg.optim.forces_weight > 0 and not cfg.backend.compile
    assert (cfg.model.hidden_channels, cfg.model.filter_points) == (64, 128)


def test_cells_give_the_periodic_recipe(data, tmp_path):
    cfg, recipe = resolve_config(None, ase_overrides(data["cells"], tmp_path, "backend.device=cpu"))
    assert recipe.name == "periodic" and "forces and cells" in recipe.why
    assert cfg.optim.forces_weight == RECIPES["periodic"]["optim.forces_weight"]
    assert cfg.model.filter_points == 256  # the bulk recipe keeps the default table


def test_an_existing_store_is_read_not_its_files(data, tmp_path):
    """The store's header decides (a store of energies beside a force file: energies)."""
    overrides = ase_overrides(data["clusters"], tmp_path)
    overrides[3] = f"data.path={data['energies']}"
    _, recipe = resolve_config(None, overrides)
    assert recipe.name == "energies" and str(data["energies"]) in recipe.why


def test_energies_only_give_the_qm9_recipe(data):
    cfg, recipe = resolve_config(None, [f"data.path={data['energies']}", "backend.device=cpu"])
    assert recipe.name == "energies"
    assert cfg.optim.lr == 4e-3 and cfg.optim.ema_decay == 0.999 and cfg.backend.replicas == 2
    assert cfg.backend.compile and cfg.packing.packs_per_batch == 16
    assert cfg.optim.lr_reference_minutes == 0.0  # no budget: nothing to scale
    budget, _ = resolve_config(None, [f"data.path={data['energies']}", "optim.max_minutes=30"])
    assert budget.optim.lr_reference_minutes == 10.0


def test_every_key_the_user_sets_wins(data, tmp_path):
    """The issue's user: forces_weight 10 and lr 1e-3 of their own, in a file and as an
    override; the rest from the recipe."""
    path = tmp_path / "mine.yaml"
    path.write_text("optim:\n  forces_weight: 10\nmodel:\n  num_interactions: 2\n")
    cfg, recipe = resolve_config(path, ase_overrides(data["clusters"], tmp_path, "optim.lr=1e-3"))
    assert (cfg.optim.forces_weight, cfg.optim.lr, cfg.model.num_interactions) == (10, 1e-3, 2)
    assert cfg.model.hidden_channels == 64 and cfg.packing.packs_per_batch == 4
    assert "optim.lr=" not in recipe.line() and "optim.forces_weight=" not in recipe.line()
    assert "model.hidden_channels=64" in recipe.line()


def test_another_schedule_keeps_the_bare_learning_rate(data):
    cfg, _ = resolve_config(None, [f"data.path={data['energies']}", "optim.schedule=plateau"])
    bare = OptimConfig()
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.min_lr) == (
        bare.lr,
        bare.warmup_steps,
        bare.min_lr,
    )
    assert cfg.optim.ema_decay == 0.999  # the rest of the recipe still applies


def test_energy_training_of_a_force_store_takes_the_energies_recipe(data, tmp_path):
    cfg, recipe = resolve_config(
        None, ase_overrides(data["clusters"], tmp_path, "optim.forces_weight=0")
    )
    assert recipe.name == "energies" and "forces_weight=0" in recipe.why
    assert cfg.optim.forces_weight == 0 and cfg.backend.compile


def test_none_and_named_recipes(data):
    bare, recipe = resolve_config(None, [f"data.path={data['energies']}", "recipe=none"])
    expected = Config(recipe="none")
    expected.data.path = str(data["energies"])
    assert recipe.values == {} and bare == expected
    named, recipe = resolve_config(None, [f"data.path={data['energies']}", "recipe=forces"])
    assert recipe.name == "forces" and named.optim.forces_weight == 100.0
    with pytest.raises(ConfigError, match=r"recipe = 'force' is not one of .*'forces'"):
        resolve_config(None, ["recipe=force"])


def test_cpu_only_keys_stay_off_elsewhere(data):
    cfg, _ = resolve_config(None, [f"data.path={data['energies']}", "backend.device=cuda"])
    assert cfg.backend.replicas == 1 and cfg.backend.compile  # compile serves CUDA too


def test_unreadable_data_takes_no_recipe(tmp_path):
    cfg, recipe = resolve_config(None, ase_overrides(tmp_path / "missing.extxyz", tmp_path))
    assert recipe.name == "none" and "cannot be read" in recipe.why
    assert cfg.optim.forces_weight == 0.0  # the import then reports the missing file


def test_print_config_and_the_first_log_line_name_the_recipe(data, tmp_path):
    overrides = ase_overrides(data["clusters"], tmp_path, "backend.device=cpu")
    printed = run_train("--print-config", *overrides)
    first, _, rest = printed.stdout.partition("\n")
    assert first.startswith("# recipe forces: the first frame of") and "(keys you set win)" in first
    assert yaml.safe_load(rest)["recipe"] == "forces"
    run = tmp_path / "run"
    trained = run_train(
        *overrides, "optim.epochs=1", "optim.beat_baseline=false", f"logging.run_dir={run}",
        "logging.progress=false", "logging.plot=false",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-2000:]
    log_lines = [line for line in trained.stderr.splitlines() if line.strip()]
    assert "recipe forces:" in log_lines[0]
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["forces_weight"] == 100.0
