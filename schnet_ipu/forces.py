"""Forces as ``-dE/dpos`` through the model: the energy + force loss and its metrics.

    loss_fn = EnergyForceLoss(energy_scale=data.residual_std, force_scale=1.2, weight=1.0)
    loss = loss_fn(model, batch)  # differentiable in the parameters (double backward)

The loss is ``mean over real molecules ((E - E_ref) / s_E)^2 + w * mean over real atoms of
|F - F_ref|^2 / (3 s_F^2)``: both terms are standardised, so a zero-force prediction scores
about 1 when ``s_F`` is the RMS force component of the training split, as a mean-energy
prediction does for ``s_E``. Padding atoms have zero force and no term in the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor, nn

from schnet_ipu.batch import Batch
from schnet_ipu.data import MoleculeStore
from schnet_ipu.model import masked_mse


def energy_and_forces(model: nn.Module, batch: Batch, create_graph: bool) -> tuple[Tensor, Tensor]:
    """Energies [G] and forces [N, 3] = -dE/dpos (zero on padding atoms); ``batch.pos`` is
    used as it is when it already requires grad (then forces are differentiable in it).

    ``create_graph=True`` keeps the graph of the forces so that a loss on them can be
    differentiated with respect to the parameters (training); False for evaluation.
    """
    pos = batch.pos if batch.pos.requires_grad else batch.pos.detach().requires_grad_(True)
    with torch.enable_grad():
        energy = model(dataclasses.replace(batch, pos=pos))
        (grad,) = torch.autograd.grad(energy.sum(), pos, create_graph=create_graph)
    forces = torch.where(batch.node_mask.unsqueeze(1), -grad, 0.0)
    return energy, forces


def atoms_per_molecule(batch: Batch) -> Tensor:
    """Real atoms of each molecule slot [G] (0 for padding slots), float."""
    counts = torch.bincount(batch.graph, minlength=batch.num_graphs + 1)[: batch.num_graphs]
    return counts.to(batch.pos.dtype)


class EnergyForceLoss:
    """``loss_fn(model, batch)`` for energy + force training (see the module docstring).

    Also sums the training errors of the epoch for the progress bar: :meth:`progress` reads
    them, :meth:`reset` starts again.
    """

    def __init__(self, energy_scale: float, force_scale: float, weight: float) -> None:
        self.energy_scale = energy_scale
        self.force_scale = force_scale
        self.weight = weight
        self.reset()

    def reset(self) -> None:
        self._sums: Tensor | None = None  # [4] as in error_sums, on the model's device

    def __call__(self, model: nn.Module, batch: Batch) -> Tensor:
        if batch.forces is None:
            raise ValueError(
                "optim.forces_weight > 0 needs batches with forces (a store with forces)"
            )
        energy, forces = energy_and_forces(model, batch, create_graph=True)
        energy_loss = masked_mse(energy, batch.y, batch.graph_mask, self.energy_scale)
        real = batch.node_mask.unsqueeze(1)
        error = torch.where(real, forces - batch.forces, 0.0)  # [N, 3]
        components = 3 * batch.node_mask.sum().clamp(min=1)
        force_loss = error.square().sum() / (components * self.force_scale**2)
        with torch.no_grad():
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
        return energy_loss + self.weight * force_loss

    def metrics(self) -> dict[str, float]:
        """Training energy MAE per atom and force MAE so far this epoch (empty before any)."""
        return {} if self._sums is None else metrics_from_sums(self._sums.double().cpu())

    def progress(self) -> dict[str, str]:
        """:meth:`metrics` for the progress bar."""
        short = {"energy_mae_per_atom": "e_mae_atom", "force_mae": "f_mae"}
        return {short[k]: f"{v:.4f}" for k, v in self.metrics().items()}


def force_rms(store: MoleculeStore, molecules: np.ndarray) -> float:
    """RMS force component over the atoms of ``molecules`` [M] (the force loss scale)."""
    atoms = np.concatenate(
        [np.arange(store.offsets[i], store.offsets[i + 1]) for i in molecules.tolist()]
    )
    forces = store.forces()[atoms].astype(np.float64)
    return float(np.sqrt(np.mean(forces**2))) or 1.0


@dataclasses.dataclass
class ForcePredictions:
    """Energies and forces of the real molecules of one batch, float64 numpy arrays."""

    index: np.ndarray  # [M] store indices
    energy: np.ndarray  # [M] predicted
    energy_true: np.ndarray  # [M]
    atoms: np.ndarray  # [M] atoms per molecule
    forces: np.ndarray  # [A, 3] predicted, real atoms only
    forces_true: np.ndarray  # [A, 3]


def force_predictions(model: nn.Module, loader, device: torch.device) -> Iterator[ForcePredictions]:
    """Yields the predictions of every batch of one pass over ``loader`` (eval mode)."""
    model.eval()
    for call in loader.epoch(0):
        for batch in call:
            on_device = batch.to(device)
            energy, forces = energy_and_forces(model, on_device, create_graph=False)
            batch = batch.to("cpu")  # (device-resident batches live on the GPU)
            mol, real = batch.graph_mask.numpy(), batch.node_mask.numpy()
            yield ForcePredictions(
                index=batch.molecule_index.numpy()[mol],
                energy=energy.detach().double().cpu().numpy()[mol],
                energy_true=batch.y.double().numpy()[mol],
                atoms=atoms_per_molecule(batch).numpy()[mol],
                forces=forces.detach().double().cpu().numpy()[real],
                forces_true=batch.forces.double().numpy()[real],
            )


def error_sums(parts: list[ForcePredictions]) -> Tensor:
    """float64 [4]: sum of |energy error| / atoms, molecules, sum of |force component
    error|, force components; sums add up over batches and replicas."""
    sums = torch.zeros(4, dtype=torch.float64)
    for p in parts:
        sums += torch.tensor(
            [
                (np.abs(p.energy - p.energy_true) / p.atoms).sum(),
                len(p.energy),
                np.abs(p.forces - p.forces_true).sum(),
                p.forces.size,
            ],
            dtype=torch.float64,
        )
    return sums


def metrics_from_sums(sums: Tensor) -> dict[str, float]:
    """Energy MAE per atom and force MAE (per component) from :func:`error_sums`."""
    e_abs, molecules, f_abs, components = sums.tolist()
    return {
        "energy_mae_per_atom": e_abs / max(molecules, 1),
        "force_mae": f_abs / max(components, 1),
    }


def trivial_baselines(
    store: MoleculeStore, targets: np.ndarray, train: np.ndarray, split: np.ndarray
) -> dict[str, float]:
    """Errors of the trivial predictors on ``split``: energy = atoms x the training mean
    energy per atom (MAE per atom), forces = 0 (MAE per component)."""
    atoms = store.num_atoms
    mean_per_atom = float(np.mean(targets[train] / atoms[train]))
    energy_error = np.abs(targets[split] / atoms[split] - mean_per_atom)
    forces = store.forces()
    components = np.concatenate(
        [forces[store.offsets[i] : store.offsets[i + 1]] for i in split.tolist()]
    )
    return {
        "baseline_energy_mae_per_atom": float(energy_error.mean()),
        "baseline_force_mae": float(np.abs(components).mean()),
    }


def evaluate_forces(backend, loader, replica) -> dict[str, float]:
    """Energy MAE per atom and force MAE over a split (each replica its share, then summed);
    ``backend`` is a :class:`~schnet_ipu.backends.TorchBackend` (its model and device)."""
    sums = error_sums(list(force_predictions(backend.model, loader, backend.device)))
    if replica.world_size > 1:
        torch.distributed.all_reduce(sums)
    return metrics_from_sums(sums)
