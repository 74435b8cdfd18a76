"""What a run learns and how it is scored: the target transform and the loss.

    task = make_task(cfg, data)        # schnet_ipu.training.setup: EnergyTask or EnergyForceTask
    loss = task.loss(model, batch)     # the backends' loss_fn
    task = task_from_dict(spec.task)   # from a checkpoint, no data set needed

One object per objective, in the spirit of schnetpack's tasks: it owns

* the target transform (:class:`TargetTransform`): the model learns the target minus the
  store's per-element atom references (QM9's atomisation energies), in units of its spread
  around the dressed-atom fit (the loss scale); predictions get the references back;
* the loss: standardised squared energy error, plus standardised force and stress terms
  (forces and stress from one :func:`~schnet_ipu.response.energy_response`);
* partial labels: force and stress terms count only the frames that carry them
  (:func:`~schnet_ipu.response.labelled_atoms`, :func:`~schnet_ipu.response.labelled_slots`),
  their scales come from the labelled training frames;
* its parameters, which every checkpoint holds (:meth:`Task.to_dict`), so a model file needs
  no data set to turn predictions into energies.

The task is built from the config and the data with the run's other components
(:func:`schnet_ipu.training.setup.make_task`); the metrics of a split, all from one pass, are
:mod:`schnet_ipu.training.evaluation`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from schnet_ipu.batch import Batch
from schnet_ipu.response import atoms_per_molecule, energy_response, labelled_atoms, labelled_slots


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


def masked_l1(pred: Tensor, y: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Mean over real molecules of ``|pred - y| / scale``; shapes and padding as
    :func:`masked_mse`."""
    err = torch.where(mask, (pred - y) / scale, 0.0)
    return err.abs().sum() / mask.sum().clamp(min=1)


ENERGY_LOSSES = {"mse": masked_mse, "l1": masked_l1}  # optim.energy_loss


class Task(Protocol):
    """The objective of a run (see the module docstring)."""

    transform: TargetTransform
    with_forces: bool
    with_stress: bool

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """Differentiable scalar: the backends' ``loss_fn``."""

    def objective(self, energy: float, force_mse: float, stress_mse: float) -> float:
        """:meth:`loss`'s value from a split's errors: ``energy`` the mean standardised
        squared energy error, ``force_mse`` and ``stress_mse`` the mean squared force and
        stress component errors over the frames that carry them (0 where none), in the
        store's units. Validation's ``loss`` and the divergence guard's yardstick."""

    def training_metrics(self) -> dict[str, float]:
        """Errors summed inside :meth:`loss` since :meth:`reset` (empty when none)."""

    def reset(self) -> None:
        """Start a new epoch's training sums."""

    def to_dict(self) -> dict[str, Any]:
        """The task's parameters, plain data for checkpoints."""


class EnergyTask:
    """Energies only: loss = mean over real molecules of ((E - E_ref) / scale)^2, or of
    |E - E_ref| / scale with ``energy_loss="l1"`` (the metric is the MAE)."""

    with_forces = False
    with_stress = False

    def __init__(self, transform: TargetTransform, energy_loss: str = "mse") -> None:
        self.transform = transform
        self.energy_loss = ENERGY_LOSSES[energy_loss]

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        return self.energy_loss(model(batch), batch.y, batch.graph_mask, self.transform.scale)

    def objective(self, energy: float, force_mse: float, stress_mse: float) -> float:
        return energy

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
    stress is ``dE/deps / V`` by the strain route (:mod:`schnet_ipu.response`), ASE's
    convention. A batch with no labelled atom (slot) adds 0 for that term.
    ``energy_loss="l1"`` makes the energy term ``mean |E - E_ref| / s_E``.
    """

    with_forces = True

    def __init__(
        self,
        transform: TargetTransform,
        force_scale: float,
        weight: float,
        stress_scale: float | None = None,
        stress_weight: float = 0.0,
        energy_loss: str = "mse",
    ) -> None:
        self.transform = transform
        self.energy_loss = ENERGY_LOSSES[energy_loss]
        self.force_scale = force_scale
        self.weight = weight
        self.stress_scale = stress_scale  # None: the store has no stress
        self.stress_weight = stress_weight
        self.with_stress = stress_scale is not None
        # [4]: |E err| / atoms, molecules, |F err|, components; made by the first step and
        # then only added into and zeroed in place, because a captured CUDA-graph step
        # replays its add into this same memory (rebinding it would leave the graph reading
        # a freed tensor). A graph's warm-up steps (backends.cuda_graph) add into it too.
        self._sums: Tensor | None = None

    def reset(self) -> None:
        if self._sums is not None:
            self._sums.zero_()

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        if self.weight == 0 and self.stress_weight == 0:  # energies only; the rest is scored
            return self.energy_loss(model(batch), batch.y, batch.graph_mask, self.transform.scale)
        if batch.forces is None:
            raise ValueError(
                "optim.forces_weight > 0 needs batches with forces (a store with forces)"
            )
        response = energy_response(model, batch, self.stress_weight > 0, create_graph=True)
        energy, forces = response.energy, response.forces
        energy_loss = self.energy_loss(energy, batch.y, batch.graph_mask, self.transform.scale)
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
            if self._sums is None:
                self._sums = torch.zeros_like(sums)
            self._sums.add_(sums)
        loss = energy_loss + self.weight * force_loss
        if response.stress is None:
            return loss
        return loss + self.stress_weight * self._stress_loss(response.stress, batch)

    def objective(self, energy: float, force_mse: float, stress_mse: float) -> float:
        value = energy + self.weight * force_mse / self.force_scale**2
        if self.stress_scale is None:
            return value
        return value + self.stress_weight * stress_mse / self.stress_scale**2

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
        if molecules == 0:  # no step since reset()
            return {}
        return {
            "energy_mae_per_atom": e_abs / molecules,
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
