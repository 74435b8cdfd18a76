"""Finished runs on their data: ``train.py evaluate`` and ``train.py predict --run``.

    result = evaluate_run(Path("runs/qm9_quickstart"), "test")   # metrics + parity plots
    result = evaluate_ensemble([Path("runs/seed0"), Path("runs/seed1")], "test")  # their mean
    rows = predict_split(Path("runs/qm9_quickstart"), "test", Path("preds.csv"))

The model comes from the run's checkpoint alone (:mod:`schnet_ipu.inference.model_file`); the
store is read only for the split's molecules and targets. Whatever trained the run (PopTorch
included), it runs as a host model: on CUDA when the run trained there and CUDA is here, else
on the CPU, with the op flavour the run trained with. Its errors come from the evaluation loop
of :mod:`schnet_ipu.training.evaluation`. (New structures, without a run's data, are
:mod:`schnet_ipu.inference`'s.)
"""

from __future__ import annotations

import csv
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from schnet_ipu.batch import Batch
from schnet_ipu.config import Config, ConfigError
from schnet_ipu.files import check_output
from schnet_ipu.inference.model_file import checkpoint_path, load_trained
from schnet_ipu.task import Task, task_from_dict
from schnet_ipu.training.data import PreparedData, make_loader, prepare_data
from schnet_ipu.training.evaluation import (
    error_sums,
    metrics_from_sums,
    predictions,
    trivial_baselines,
)
from schnet_ipu.training.plots import evaluation_plots
from schnet_ipu.training.setup import restore_config


@dataclass
class HostModel:
    """A model evaluated outside any training backend (the :class:`Evaluator` of finished
    runs)."""

    model: nn.Module
    device: torch.device

    def predict(self, batch: Batch) -> Tensor:
        with torch.no_grad():
            return self.model(batch.to(self.device))


def load_run(
    run_dir: Path, checkpoint: str = "best"
) -> tuple[Config, PreparedData, HostModel, Task]:
    """Config, data, host model and task of a run's checkpoint, for one process."""
    trained = load_trained(run_dir, checkpoint)
    cfg = restore_config({"config": trained.config}, trained.path)
    data = prepare_data(cfg)
    on_cuda = cfg.backend.device in ("cuda", "auto") and torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    return cfg, data, HostModel(trained.model.to(device), device), task_from_dict(trained.spec.task)


def evaluate_run(run_dir: Path, split: str = "test") -> dict:
    """Errors of a run's best weights on a split, and its parity plot and error histogram."""
    cfg, data, host, task = load_run(run_dir)
    parts = list(predictions(task, host, make_loader(cfg, data, split)))  # one pass
    metrics = metrics_from_sums(task, error_sums(task, parts), split)
    result = {
        "split": split,
        **metrics,
        **trivial_baselines(data, split, task.with_forces, task.with_stress),
    }
    result["unit"] = data.unit
    energy = tuple(
        np.concatenate([getattr(p, k) for p in parts]) for k in ("energy", "energy_true")
    )
    forces = None
    if task.with_forces:
        forces = tuple(
            np.concatenate([getattr(p, k) for p in parts]) for k in ("forces", "forces_true")
        )
    pictures = evaluation_plots(run_dir, split, energy, data.unit, forces, data.store.forces_unit)
    result["pictures"] = [str(p) for p in pictures]
    return result


def evaluate_ensemble(run_dirs: list[Path], split: str = "test") -> dict:
    """Errors of the mean energy of several runs' best weights on a split they share (members
    trained with different seeds and one ``data.split_seed``), beside each member's own.
    The members must predict one target of one store (hence one unit). Energies only: a
    force task's ensemble is evaluated through the calculator."""
    predicted, targets, indices, target_of = [], None, None, None
    for run_dir in run_dirs:
        cfg, data, host, task = load_run(run_dir)
        if task.with_forces:
            raise ConfigError(f"{run_dir} trains forces: evaluate an ensemble of energy runs")
        target = (Path(data.store.path).resolve(), cfg.data.target)
        if target_of is None:
            indices, target_of = data.split[split], target
        elif target != target_of:
            raise ConfigError(
                f"{run_dir} predicts {target[1]} of {target[0]}, {run_dirs[0]} {target_of[1]} "
                f"of {target_of[0]}: the members of an ensemble share one target"
            )
        elif not np.array_equal(data.split[split], indices):
            raise ConfigError(
                f"{run_dir}'s {split} split differs from {run_dirs[0]}'s: train the members "
                "of an ensemble with one data.split_seed (and the same data settings)"
            )
        by_index = np.empty((2, len(data.store)))  # predicted, true
        for index, prediction, truth in store_energies(cfg, data, host, task, split):
            by_index[:, index] = prediction, truth
        predicted.append(by_index[0, indices])
        targets = by_index[1, indices]
    errors = np.mean(predicted, axis=0) - targets
    return {
        "split": split,
        "members": [str(r) for r in run_dirs],
        "molecules": len(errors),
        "mae": float(np.abs(errors).mean()),
        "rmse": float(np.sqrt(np.square(errors).mean())),
        "member_mae": [float(np.abs(p - targets).mean()) for p in predicted],
        "unit": data.unit,
    }


def store_energies(
    cfg: Config, data: PreparedData, host: HostModel, task: Task, split: str
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each batch's store indices, predicted and true energies [M] in the store's own target
    (the atom references the model's target subtracts, added back)."""
    raw = data.store.target(cfg.data.target)
    for part in predictions(task, host, make_loader(cfg, data, split)):
        shift = raw[part.index] - part.energy_true
        yield part.index, part.energy + shift, part.energy_true + shift


def predict_split(run_dir: Path, split: str, out: Path) -> int:
    """``train.py predict --run RUN``: the run's own ``split``, one CSV row per molecule
    (index, target, prediction, error in the store's own target). New structures, without
    the run's data, are :func:`schnet_ipu.inference.predictor.predict_file`'s. ``out`` may
    not be a folder or a file the run reads (checkpoint, store, source files)."""
    if not out.parent.is_dir():  # before the slow part, and naming ``out``, not a temp file
        raise FileNotFoundError(errno.ENOENT, "no such folder", str(out))
    check_output(out, [("checkpoint", checkpoint_path(run_dir))])
    cfg, data, host, task = load_run(run_dir)
    stored = [("data store", Path(cfg.data.path))]
    check_output(out, [*stored, *(("data file", Path(f)) for f in cfg.data.files)])
    rows = 0
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # out appears whole or not at all
    try:
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", "target", "prediction", "error", "unit"])
            for index, prediction, target in store_energies(cfg, data, host, task, split):
                for i, p, t in zip(index, prediction, target):
                    writer.writerow([int(i), f"{t:.6f}", f"{p:.6f}", f"{p - t:.6f}", data.unit])
                    rows += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return rows
