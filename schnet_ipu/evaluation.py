"""Finished runs on their data: errors of a split, pictures, per-molecule predictions.

    result = evaluate_run(Path("runs/qm9_quickstart"), "test")   # metrics + parity plots
    rows = predict_run(Path("runs/qm9_quickstart"), "test", Path("preds.csv"))

The model comes from the run's checkpoint alone (:mod:`schnet_ipu.model_file`); the store
is read only for the split's molecules and targets. Whatever trained the run (PopTorch
included), evaluation runs the host model: on CUDA when the run trained there and CUDA is
here, else on the CPU, with the op flavour the run trained with.
"""

from __future__ import annotations

import csv
import errno
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from schnet_ipu.batch import Batch
from schnet_ipu.components import restore_config
from schnet_ipu.config import Config
from schnet_ipu.model_file import load_trained
from schnet_ipu.pipeline import PreparedData, make_loader, prepare_data
from schnet_ipu.plots import evaluation_plots
from schnet_ipu.task import (
    Task,
    error_sums,
    metrics_from_sums,
    predictions,
    task_from_dict,
    trivial_baselines,
)


@dataclass
class HostModel:
    """A model evaluated outside any training backend (the :class:`~schnet_ipu.task.Evaluator`
    of finished runs)."""

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


def predict_run(run_dir: Path, split: str, out: Path) -> int:
    """Write index, target, prediction, error per molecule (the store's own target) to CSV."""
    if not out.parent.is_dir():  # before the slow part, and naming ``out``, not a temp file
        raise FileNotFoundError(errno.ENOENT, "no such folder", str(out))
    cfg, data, host, task = load_run(run_dir)
    raw = data.store.target(cfg.data.target)
    rows = 0
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # out appears whole or not at all
    try:
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", "target", "prediction", "error", "unit"])
            for part in predictions(task, host, make_loader(cfg, data, split)):
                shift = raw[part.index] - part.energy_true  # the atom references subtracted
                prediction, target = part.energy + shift, part.energy_true + shift
                for i, p, t in zip(part.index, prediction, target):
                    writer.writerow([int(i), f"{t:.6f}", f"{p:.6f}", f"{p - t:.6f}", data.unit])
                    rows += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return rows
