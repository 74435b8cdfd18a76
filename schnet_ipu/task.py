"""What a run learns and how it is scored: the target transform, the loss and the metrics.

    task = make_task(cfg, data)            # EnergyTask, or EnergyForceTask with forces_weight > 0
    loss = task.loss(model, batch)          # the backends' loss_fn
    metrics = evaluate(task, backend, loader, replica)   # every metric of a split, one pass

One object per objective, in the spirit of schnetpack's tasks: it owns

* the target transform (:class:`TargetTransform`): the model learns the target minus the
  store's per-element atom references (QM9's atomisation energies), in units of its spread
  around the dressed-atom fit (the loss scale); predictions get the references back;
* the loss: standardised squared energy error, plus standardised force and stress terms;
* the metrics, all from one pass over a split (with forces, energies come from the same
  autograd evaluation that gives the forces);
* partial labels: force and stress terms and metrics count only the frames that carry
  them (:func:`~schnet_ipu.forces.labelled_atoms`, :func:`~schnet_ipu.stress.labelled_slots`),
  their scales come from the labelled training frames, and every force or stress metric
  comes with the frames it covered (``force_frames``, ``stress_frames``);
* its parameters, which every checkpoint holds (:meth:`Task.to_dict`), so a model file needs
  no data set to turn predictions into energies.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from schnet_ipu.batch import Batch
from schnet_ipu.config import Config, ConfigError
from schnet_ipu.forces import atoms_per_molecule, energy_and_forces, force_rms, labelled_atoms
from schnet_ipu.pipeline import PreparedData
from schnet_ipu.stress import energy_forces_stress, labelled_slots

NUM_REFERENCE_ELEMENTS = 119  # atom references are indexed by atomic number 0..118


@dataclass(frozen=True)
class TargetTransform:
    """model target = raw target - sum over atoms of ``atom_reference[z]``; the loss measures
    errors in units of ``scale`` (the training targets' spread around the dressed-atom fit)."""

    atom_reference: tuple[float, ...]  # [119], 0 where the store has none or they are off
    scale: float

    def reference(self, z: np.ndarray) -> float:
        """Sum of the atom references of one structure's atomic numbers ``z`` [n]."""
        return float(np.asarray(self.atom_reference, dtype=np.float64)[z].sum())

    def to_dict(self) -> dict[str, Any]:
        return {"atom_reference": list(self.atom_reference), "scale": self.scale}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TargetTransform:
        return cls(tuple(float(v) for v in raw["atom_reference"]), float(raw["scale"]))


def masked_mse(pred: Tensor, y: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Mean over real molecules of ``((pred - y) / scale) ** 2``.

    pred, y, mask: [G]; padding slots (``mask == False``) are excluded whatever their target
    holds, and a batch without real molecules gives 0 (not NaN). Returns a scalar [].
    """
    err = torch.where(mask, (pred - y) / scale, 0.0)
    return err.square().sum() / mask.sum().clamp(min=1)


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


class Task(Protocol):
    """The objective of a run (see the module docstring)."""

    transform: TargetTransform
    with_forces: bool
    with_stress: bool

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """Differentiable scalar: the backends' ``loss_fn``."""

    def training_metrics(self) -> dict[str, float]:
        """Errors summed inside :meth:`loss` since :meth:`reset` (empty when none)."""

    def reset(self) -> None:
        """Start a new epoch's training sums."""

    def to_dict(self) -> dict[str, Any]:
        """The task's parameters, plain data for checkpoints."""


class EnergyTask:
    """Energies only: loss = mean over real molecules of ((E - E_ref) / scale)^2."""

    with_forces = False
    with_stress = False

    def __init__(self, transform: TargetTransform) -> None:
        self.transform = transform

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        return masked_mse(model(batch), batch.y, batch.graph_mask, self.transform.scale)

    def training_metrics(self) -> dict[str, float]:
        return {}

    def reset(self) -> None:
        pass

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "energy", "transform": self.transform.to_dict()}


class EnergyForceTask:
    """Energies and forces (any store with forces; ``weight`` 0 trains energies only and
    still scores the forces): ``mean over real molecules ((E - E_ref) / s_E)^2 + w * mean over
    labelled atoms of |F - F_ref|^2 / (3 s_F^2)``, the labelled atoms being those of frames
    that carry forces (all, unless the store has partial labels). Both terms are
    standardised, so a zero-force prediction scores about 1 when ``s_F`` is the RMS force
    component of the training split's labelled frames, as a mean-energy prediction does for
    ``s_E``. Padding atoms have zero force and no term. Forces are ``-dE/dpos`` by double
    backward, differentiable in the parameters.

    Stores with stress (periodic frames) are scored on it too, and with ``stress_weight``
    > 0 the loss gains ``w_s * mean over slots with target stress of |S - S_ref|^2 / (9
    s_S^2)``, ``s_S`` the RMS stress component of the training frames that carry stress;
    stress is ``dE/deps / V`` by the strain route (:mod:`schnet_ipu.stress`), ASE's
    convention. A batch with no labelled atom (slot) adds 0 for that term.
    """

    with_forces = True

    def __init__(
        self,
        transform: TargetTransform,
        force_scale: float,
        weight: float,
        stress_scale: float | None = None,
        stress_weight: float = 0.0,
    ) -> None:
        self.transform = transform
        self.force_scale = force_scale
        self.weight = weight
        self.stress_scale = stress_scale  # None: the store has no stress
        self.stress_weight = stress_weight
        self.with_stress = stress_scale is not None
        self.reset()

    def reset(self) -> None:
        self._sums: Tensor | None = None  # [4]: |E err| / atoms, molecules, |F err|, components

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        if self.weight == 0 and self.stress_weight == 0:  # energies only; the rest is scored
            return masked_mse(model(batch), batch.y, batch.graph_mask, self.transform.scale)
        if batch.forces is None:
            raise ValueError(
                "optim.forces_weight > 0 needs batches with forces (a store with forces)"
            )
        stress_loss = None
        if self.stress_weight > 0:
            energy, forces, stress = energy_forces_stress(model, batch, create_graph=True)
            stress_loss = self._stress_loss(stress, batch)
        else:
            energy, forces = energy_and_forces(model, batch, create_graph=True)
        energy_loss = masked_mse(energy, batch.y, batch.graph_mask, self.transform.scale)
        labelled = labelled_atoms(batch)
        error = torch.where(labelled.unsqueeze(1), forces - batch.forces, 0.0)  # [N, 3]
        components = 3 * labelled.sum()
        force_loss = error.square().sum() / (components.clamp(min=1) * self.force_scale**2)
        with torch.no_grad():  # the epoch's training errors, read by the progress bar
            per_atom = (energy - batch.y).abs() / atoms_per_molecule(batch).clamp(min=1)
            sums = torch.stack(
                [
                    torch.where(batch.graph_mask, per_atom, 0.0).sum(),
                    batch.graph_mask.sum().to(per_atom.dtype),
                    error.abs().sum(),
                    components.to(per_atom.dtype),
                ]
            )
            self._sums = sums if self._sums is None else self._sums + sums
        loss = energy_loss + self.weight * force_loss
        return loss if stress_loss is None else loss + self.stress_weight * stress_loss

    def _stress_loss(self, stress: Tensor, batch: Batch) -> Tensor:
        """Mean over the slots with target stress of |S - S_ref|^2 / (9 s_S^2)."""
        if batch.stress is None or batch.cell is None:
            raise ValueError("optim.stress_weight > 0 needs batches with stress (a store with it)")
        labelled = labelled_slots(batch)
        error = torch.where(labelled.view(-1, 1, 1), stress - batch.stress, 0.0)
        slots = 9 * labelled.sum().clamp(min=1)
        return error.square().sum() / (slots * self.stress_scale**2)

    def training_metrics(self) -> dict[str, float]:
        if self._sums is None:
            return {}
        e_abs, molecules, f_abs, components = self._sums.double().cpu().tolist()
        return {
            "energy_mae_per_atom": e_abs / max(molecules, 1),
            "force_mae": f_abs / max(components, 1),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "energy_forces",
            "transform": self.transform.to_dict(),
            "force_scale": self.force_scale,
            "weight": self.weight,
            "stress_scale": self.stress_scale,
            "stress_weight": self.stress_weight,
        }


def make_task(cfg: Config, data: PreparedData) -> EnergyTask | EnergyForceTask:
    """The run's task: references and scales from the training split (force and stress
    scales from its frames that carry them); forces scored when the store has them, trained
    with ``optim.forces_weight > 0``. A force or stress weight > 0 with no training frame
    carrying that label is a ConfigError."""
    atomref = data.store.atomref(cfg.data.target)
    reference = np.zeros(NUM_REFERENCE_ELEMENTS)
    if cfg.data.atomrefs and atomref is not None:
        reference[: len(atomref)] = atomref
    transform = TargetTransform(tuple(reference.tolist()), data.residual_std)
    if cfg.optim.stress_weight > 0 and not data.store.has_stress:
        raise ConfigError(
            f"optim.stress_weight > 0, but {data.store.path} holds no stress; import frames "
            "with stress (atoms.info['stress'] or the calculator's) or set optim.stress_weight=0"
        )
    if not data.store.has_forces:
        for key in ("forces_weight", "stress_weight"):
            if getattr(cfg.optim, key) > 0:
                raise ConfigError(f"optim.{key} > 0, but {data.store.path} holds no forces")
        return EnergyTask(transform)
    train = data.split["train"]
    forces_frames = train[data.store.forces_mask()[train]]
    _check_labelled(cfg.optim.forces_weight, "forces", forces_frames, data)
    scale = force_rms(data.store, forces_frames)  # forces are scored even at weight 0
    stress_scale = None
    if data.store.has_stress:
        stress_frames = train[data.store.stress_mask()[train]]
        _check_labelled(cfg.optim.stress_weight, "stress", stress_frames, data)
        stress = data.store.stress()[stress_frames]
        stress_scale = float(np.sqrt(np.mean(stress**2))) if len(stress) else 0.0
        stress_scale = stress_scale or 1.0  # no training frame with stress, or all zero
    return EnergyForceTask(
        transform, scale, cfg.optim.forces_weight, stress_scale, cfg.optim.stress_weight
    )


def _check_labelled(weight: float, label: str, frames: np.ndarray, data: PreparedData) -> None:
    """ConfigError when ``weight`` > 0 trains ``label`` but no training frame carries it
    (``frames``: those that do)."""
    if weight > 0 and not len(frames):
        key = "forces_weight" if label == "forces" else "stress_weight"
        raise ConfigError(
            f"optim.{key} > 0, but no frame of the training split of {data.store.path} "
            f"carries {label} ({len(data.split['train'])} frames); set optim.{key}=0 or "
            f"import frames with {label}"
        )


class Evaluator(Protocol):
    """What evaluation needs of a backend: device predictions, and the host model for
    forces by autograd (on ``device``: the CPU for PopTorch runs)."""

    model: nn.Module
    device: torch.device

    def predict(self, batch: Batch) -> Tensor:
        """Predictions [G] for one batch."""


def predictions(task: Task, backend: Evaluator, loader) -> Iterator[Predictions]:
    """Each batch's predictions over one pass of ``loader``: energies by ``backend.predict``
    for energy tasks; energies and forces in one autograd evaluation for force tasks."""
    for call in loader.epoch(0):
        for batch in call:
            stress = None
            if task.with_stress:
                backend.model.eval()
                on_device = batch.to(backend.device)
                energy, forces, stress = energy_forces_stress(backend.model, on_device, False)
                energy, forces, stress = energy.detach(), forces.detach(), stress.detach()
            elif task.with_forces:
                backend.model.eval()
                energy, forces = energy_and_forces(
                    backend.model, batch.to(backend.device), create_graph=False
                )
                energy, forces = energy.detach(), forces.detach()
            else:
                energy, forces = backend.predict(batch), None
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
    """float64 [11]: sums of |error|, error^2, (error / scale)^2, molecules, |error| / atoms,
    |force component error|, force components, frames with forces, |stress component
    error|, stress components, frames with stress; they add up over batches and replicas."""
    sums = torch.zeros(11, dtype=torch.float64)
    for p in parts:
        error = p.energy - p.energy_true
        force_error = 0.0 if p.forces is None else np.abs(p.forces - p.forces_true).sum()
        stress_error = 0.0 if p.stress is None else np.abs(p.stress - p.stress_true).sum()
        sums += torch.tensor(
            [
                np.abs(error).sum(),
                (error**2).sum(),
                ((error / task.transform.scale) ** 2).sum(),
                len(error),
                (np.abs(error) / p.atoms).sum(),
                force_error,
                0 if p.forces is None else p.forces.size,
                0 if p.forces is None else p.force_frames,
                stress_error,
                0 if p.stress is None else p.stress.size,
                0 if p.stress is None else len(p.stress),
            ],
            dtype=torch.float64,
        )
    return sums


def metrics_from_sums(task: Task, sums: Tensor, split: str) -> dict[str, float]:
    """mae, rmse, loss (the standardised energy error, comparable with the training loss),
    molecules; with forces also energy_mae_per_atom, force_frames (frames with target
    forces) and force_mae over their atoms; with stress, stress_frames and stress_mae. An
    MAE over no frame is left out (its frame count, 0, says why)."""
    abs_sum, sq_sum, loss_sum, count, per_atom = sums[:5].tolist()
    f_abs, components, f_frames, s_abs, s_count, s_frames = sums[5:].tolist()
    if count == 0:
        raise ConfigError(f"the {split} split has no molecules to evaluate")
    metrics = {
        "mae": abs_sum / count,
        "rmse": math.sqrt(sq_sum / count),
        "loss": loss_sum / count,
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


def task_from_dict(raw: dict[str, Any]) -> EnergyTask | EnergyForceTask:
    """A task rebuilt from :meth:`Task.to_dict` (a checkpoint's ``task``)."""
    transform = TargetTransform.from_dict(raw["transform"])
    if raw["kind"] == "energy":
        return EnergyTask(transform)
    stress_scale = raw.get("stress_scale")
    return EnergyForceTask(
        transform,
        float(raw["force_scale"]),
        float(raw["weight"]),
        None if stress_scale is None else float(stress_scale),
        float(raw.get("stress_weight", 0.0)),
    )
