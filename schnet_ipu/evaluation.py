"""The evaluation loop, and finished runs on their data: errors, pictures, predictions.

    metrics = evaluate(task, backend, loader, "val", world_size)   # every metric, one pass
    result = evaluate_run(Path("runs/qm9_quickstart"), "test")   # metrics + parity plots
    result = evaluate_ensemble([Path("runs/seed0"), Path("runs/seed1")], "test")  # their mean
    rows = predict_run(Path("runs/qm9_quickstart"), "test", Path("preds.csv"))

One loop (:func:`predictions`) serves training's validation and test and the finished runs:
each batch's energies by the backend, or for force tasks energies, forces and stress from
one :func:`~schnet_ipu.response.energy_response`; the errors are summed per batch
(:func:`error_sums`, which add up over replicas) and turned into metrics once
(:func:`metrics_from_sums`). Force and stress metrics count only the frames that carry those
labels, and each comes with the frames it covered (``force_frames``, ``stress_frames``).

For a finished run, the model comes from the run's checkpoint alone
(:mod:`schnet_ipu.model_file`); the store is read only for the split's molecules and
targets. Whatever trained the run (PopTorch included), evaluation runs the host model: on
CUDA when the run trained there and CUDA is here, else on the CPU, with the op flavour the
run trained with.
"""

from __future__ import annotations

import csv
import errno
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from schnet_ipu.batch import Batch
from schnet_ipu.components import restore_config
from schnet_ipu.config import Config, ConfigError
from schnet_ipu.model_file import load_trained
from schnet_ipu.pipeline import PreparedData, make_loader, prepare_data
from schnet_ipu.plots import evaluation_plots
from schnet_ipu.response import atoms_per_molecule, energy_response, labelled_atoms, labelled_slots
from schnet_ipu.task import Task, task_from_dict


@dataclass
class Predictions:
    """One batch's real molecules: float64 numpy arrays (forces only for force tasks)."""

    index: np.ndarray  # [M] store indices
    energy: np.ndarray  # [M] predicted model target
    energy_true: np.ndarray  # [M]
    atoms: np.ndarray  # [M] atoms per molecule
    forces: np.ndarray | None = None  # [A, 3] predicted, atoms of frames with target forces
    forces_true: np.ndarray | None = None  # [A, 3]
    force_frames: int = 0  # frames those atoms belong to
    stress: np.ndarray | None = None  # [P, 3, 3] predicted, frames with target stress
    stress_true: np.ndarray | None = None  # [P, 3, 3]


class Evaluator(Protocol):
    """What evaluation needs of a backend: device predictions, and the host model for
    forces by autograd (on ``device``: the CPU for PopTorch runs)."""

    model: nn.Module
    device: torch.device

    def predict(self, batch: Batch) -> Tensor:
        """Predictions [G] for one batch."""


def predictions(task: Task, backend: Evaluator, loader) -> Iterator[Predictions]:
    """Each batch's predictions over one pass of ``loader``: energies by ``backend.predict``
    for energy tasks; energies, forces and (stores with stress) stress in one autograd
    evaluation for force tasks."""
    for call in loader.epoch(0):
        for batch in call:
            if task.with_forces:  # energies, forces and any stress: one autograd call
                backend.model.eval()
                on_device = batch.to(backend.device)
                response = energy_response(backend.model, on_device, task.with_stress)
                energy, forces = response.energy.detach(), response.forces.detach()
                stress = None if response.stress is None else response.stress.detach()
            else:
                energy, forces, stress = backend.predict(batch), None, None
            batch = batch.to("cpu")  # (device-resident batches live on the GPU)
            mol, atoms = batch.graph_mask.numpy(), labelled_atoms(batch).numpy()
            frames = mol if batch.forces_mask is None else mol & batch.forces_mask.numpy()
            slots = None if stress is None else labelled_slots(batch).numpy()
            yield Predictions(
                index=batch.molecule_index.numpy()[mol],
                energy=energy.double().cpu().numpy()[mol],
                energy_true=batch.y.double().numpy()[mol],
                atoms=atoms_per_molecule(batch).double().numpy()[mol],
                forces=None if forces is None else forces.double().cpu().numpy()[atoms],
                forces_true=None if forces is None else batch.forces.double().numpy()[atoms],
                force_frames=int(frames.sum()),
                stress=None if stress is None else stress.double().cpu().numpy()[slots],
                stress_true=None if stress is None else batch.stress.double().numpy()[slots],
            )


def error_sums(task: Task, parts: Iterator[Predictions]) -> Tensor:
    """float64 [13]: sums of |error|, error^2, (error / scale)^2, molecules, |error| / atoms,
    |force component error|, force components, frames with forces, |stress component
    error|, stress components, frames with stress, force component error^2, stress
    component error^2; they add up over batches and replicas."""
    sums = torch.zeros(13, dtype=torch.float64)
    for p in parts:
        error = p.energy - p.energy_true
        force_error = np.zeros(0) if p.forces is None else (p.forces - p.forces_true).ravel()
        stress_error = np.zeros(0) if p.stress is None else (p.stress - p.stress_true).ravel()
        sums += torch.tensor(
            [
                np.abs(error).sum(),
                (error**2).sum(),
                ((error / task.transform.scale) ** 2).sum(),
                len(error),
                (np.abs(error) / p.atoms).sum(),
                np.abs(force_error).sum(),
                force_error.size,
                0 if p.forces is None else p.force_frames,
                np.abs(stress_error).sum(),
                stress_error.size,
                0 if p.stress is None else len(p.stress),
                np.square(force_error).sum(),
                np.square(stress_error).sum(),
            ],
            dtype=torch.float64,
        )
    return sums


def metrics_from_sums(task: Task, sums: Tensor, split: str) -> dict[str, float]:
    """mae, rmse, loss (the task's objective, :meth:`~schnet_ipu.task.Task.objective`: the
    training loss on the split, force and stress terms included; its energy term is the
    squared error also under ``optim.energy_loss=l1``), molecules; with forces
    also energy_mae_per_atom, force_frames (frames with target forces) and force_mae over
    their atoms; with stress, stress_frames and stress_mae. An MAE over no frame is left
    out (its frame count, 0, says why)."""
    abs_sum, sq_sum, loss_sum, count, per_atom = sums[:5].tolist()
    f_abs, components, f_frames, s_abs, s_count, s_frames, f_sq, s_sq = sums[5:].tolist()
    if count == 0:
        raise ConfigError(f"the {split} split has no molecules to evaluate")
    force_mse = f_sq / components if components else 0.0
    stress_mse = s_sq / s_count if s_count else 0.0
    metrics = {
        "mae": abs_sum / count,
        "rmse": math.sqrt(sq_sum / count),
        "loss": task.objective(loss_sum / count, force_mse, stress_mse),
        "molecules": int(count),
    }
    if task.with_forces:
        metrics["energy_mae_per_atom"] = per_atom / count
        metrics["force_frames"] = int(f_frames)
        if components:
            metrics["force_mae"] = f_abs / components
    if task.with_stress:
        metrics["stress_frames"] = int(s_frames)
        if s_count:
            metrics["stress_mae"] = s_abs / s_count
    return metrics


def evaluate(task: Task, backend: Evaluator, loader, split: str, world_size: int = 1) -> dict:
    """Every metric of a split in one pass (each replica its share, then summed)."""
    sums = error_sums(task, predictions(task, backend, loader))
    if world_size > 1:  # on the replica's device: NCCL reduces CUDA tensors only
        sums = sums.to(backend.device)
        dist.all_reduce(sums)
    return metrics_from_sums(task, sums.cpu(), split)


def trivial_baselines(
    data: PreparedData, split: str, with_forces: bool, with_stress: bool = False
) -> dict[str, float]:
    """Errors of trivial predictors on ``split``: the dressed-atom fit (``baseline_mae``);
    with forces also energy = atoms x the training mean energy per atom (MAE per atom) and
    forces = 0 (MAE per component, over the frames with forces); with stress the training
    frames' mean stress (over the frames with stress). A baseline over no frame is left out."""
    baselines = {"baseline_mae": float(np.abs(data.baseline_errors(split)).mean())}
    if not with_forces:
        return baselines
    store, targets, train, index = data.store, data.targets, data.split["train"], data.split[split]
    atoms = store.num_atoms
    mean_per_atom = float(np.mean(targets[train] / atoms[train]))
    baselines["baseline_energy_mae_per_atom"] = float(
        np.abs(targets[index] / atoms[index] - mean_per_atom).mean()
    )
    forces = store.forces()
    labelled = index[store.forces_mask()[index]]
    if len(labelled):
        components = np.concatenate(
            [forces[store.offsets[i] : store.offsets[i + 1]] for i in labelled.tolist()]
        )
        baselines["baseline_force_mae"] = float(np.abs(components).mean())
    if with_stress:  # the mean stress of the training frames that carry it
        stress, mask = store.stress(), store.stress_mask()
        train_s, split_s = train[mask[train]], index[mask[index]]
        if len(train_s) and len(split_s):
            mean = stress[train_s].mean(axis=0)
            baselines["baseline_stress_mae"] = float(np.abs(stress[split_s] - mean).mean())
    return baselines


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


def predict_run(run_dir: Path, split: str, out: Path) -> int:
    """Write index, target, prediction, error per molecule (the store's own target) to CSV."""
    if not out.parent.is_dir():  # before the slow part, and naming ``out``, not a temp file
        raise FileNotFoundError(errno.ENOENT, "no such folder", str(out))
    cfg, data, host, task = load_run(run_dir)
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
