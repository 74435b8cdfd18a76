"""The evaluation loop: every error metric of a split in one pass, and the trivial baselines.

    metrics = evaluate(task, backend, loader, "val", world_size)   # every metric, one pass

One loop (:func:`predictions`) serves training's validation and test and the finished runs
(:mod:`schnet_ipu.training.finished_runs`): each batch's energies by the backend, or for
force tasks energies, forces and stress from one :func:`~schnet_ipu.response.energy_response`;
the errors are summed per batch into named :class:`ErrorSums` (:func:`error_sums`; they add
up over replicas) and turned into metrics once (:func:`metrics_from_sums`). Force and stress
metrics count only the frames that carry those labels, and each comes with the frames it
covered (``force_frames``, ``stress_frames``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from schnet_ipu.batch import Batch
from schnet_ipu.config import ConfigError
from schnet_ipu.response import atoms_per_molecule, energy_response, labelled_atoms, labelled_slots
from schnet_ipu.task import Task
from schnet_ipu.training.data import PreparedData


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


@dataclass
class ErrorSums:
    """A split's errors as sums that add up over batches and replicas (``+``); one float64
    tensor (:meth:`as_tensor`, fields in order) is what replicas all-reduce."""

    abs_error: float = 0.0  # sum over frames of |energy error|
    squared_error: float = 0.0  # of energy error^2
    scaled_squared_error: float = 0.0  # of (energy error / the task's loss scale)^2
    molecules: float = 0.0  # frames evaluated
    abs_error_per_atom: float = 0.0  # of |energy error| / atoms
    force_abs_error: float = 0.0  # over force components of frames with target forces
    force_components: float = 0.0
    force_frames: float = 0.0  # frames with target forces
    stress_abs_error: float = 0.0  # over stress components of frames with target stress
    stress_components: float = 0.0
    stress_frames: float = 0.0  # frames with target stress
    force_squared_error: float = 0.0
    stress_squared_error: float = 0.0

    def __add__(self, other: ErrorSums) -> ErrorSums:
        return ErrorSums(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def as_tensor(self) -> Tensor:
        """float64 [fields], in the fields' order."""
        return torch.tensor(astuple(self), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, sums: Tensor) -> ErrorSums:
        return cls(*sums.tolist())


def error_sums(task: Task, parts: Iterator[Predictions]) -> ErrorSums:
    """The :class:`ErrorSums` of a pass's batches."""
    sums = ErrorSums()
    for p in parts:
        error = p.energy - p.energy_true
        force_error = np.zeros(0) if p.forces is None else (p.forces - p.forces_true).ravel()
        stress_error = np.zeros(0) if p.stress is None else (p.stress - p.stress_true).ravel()
        sums += ErrorSums(
            abs_error=float(np.abs(error).sum()),
            squared_error=float((error**2).sum()),
            scaled_squared_error=float(((error / task.transform.scale) ** 2).sum()),
            molecules=float(len(error)),
            abs_error_per_atom=float((np.abs(error) / p.atoms).sum()),
            force_abs_error=float(np.abs(force_error).sum()),
            force_components=float(force_error.size),
            force_frames=float(0 if p.forces is None else p.force_frames),
            stress_abs_error=float(np.abs(stress_error).sum()),
            stress_components=float(stress_error.size),
            stress_frames=float(0 if p.stress is None else len(p.stress)),
            force_squared_error=float(np.square(force_error).sum()),
            stress_squared_error=float(np.square(stress_error).sum()),
        )
    return sums


def metrics_from_sums(task: Task, sums: ErrorSums, split: str) -> dict[str, float]:
    """mae, rmse, loss (the task's objective, :meth:`~schnet_ipu.task.Task.objective`: the
    training loss on the split, force and stress terms included; its energy term is the
    squared error also under ``optim.energy_loss=l1``), molecules; with forces
    also energy_mae_per_atom, force_frames (frames with target forces) and force_mae over
    their atoms; with stress, stress_frames and stress_mae. An MAE over no frame is left
    out (its frame count, 0, says why)."""
    count, components, s_count = sums.molecules, sums.force_components, sums.stress_components
    if count == 0:
        raise ConfigError(f"the {split} split has no molecules to evaluate")
    force_mse = sums.force_squared_error / components if components else 0.0
    stress_mse = sums.stress_squared_error / s_count if s_count else 0.0
    metrics = {
        "mae": sums.abs_error / count,
        "rmse": math.sqrt(sums.squared_error / count),
        "loss": task.objective(sums.scaled_squared_error / count, force_mse, stress_mse),
        "molecules": int(count),
    }
    if task.with_forces:
        metrics["energy_mae_per_atom"] = sums.abs_error_per_atom / count
        metrics["force_frames"] = int(sums.force_frames)
        if components:
            metrics["force_mae"] = sums.force_abs_error / components
    if task.with_stress:
        metrics["stress_frames"] = int(sums.stress_frames)
        if s_count:
            metrics["stress_mae"] = sums.stress_abs_error / s_count
    return metrics


def evaluate(task: Task, backend: Evaluator, loader, split: str, world_size: int = 1) -> dict:
    """Every metric of a split in one pass (each replica its share, then summed)."""
    sums = error_sums(task, predictions(task, backend, loader))
    if world_size > 1:  # on the replica's device: NCCL reduces CUDA tensors only
        summed = sums.as_tensor().to(backend.device)
        dist.all_reduce(summed)
        sums = ErrorSums.from_tensor(summed.cpu())
    return metrics_from_sums(task, sums, split)


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
