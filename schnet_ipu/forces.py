"""Forces as ``-dE/dpos`` through the model, by autograd on the packed batch.

    energy, forces = energy_and_forces(model, batch, create_graph=True)  # training
    atoms = labelled_atoms(batch)  # [N] the atoms whose frame carries target forces

The losses and metrics built on them live in :mod:`schnet_ipu.task`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor, nn

from schnet_ipu.batch import Batch
from schnet_ipu.data import MoleculeStore


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


def labelled_atoms(batch: Batch) -> Tensor:
    """[N] bool: the real atoms whose frame carries target forces (every real atom unless
    the batch has a ``forces_mask``; padding atoms, of the filler slot G, never)."""
    if batch.forces_mask is None:
        return batch.node_mask
    per_slot = torch.cat([batch.forces_mask, batch.forces_mask.new_zeros(1)])  # [G + 1]
    return per_slot[batch.graph]


def atoms_per_molecule(batch: Batch) -> Tensor:
    """Real atoms of each molecule slot [G] (0 for padding slots), float."""
    counts = torch.bincount(batch.graph, minlength=batch.num_graphs + 1)[: batch.num_graphs]
    return counts.to(batch.pos.dtype)


def force_rms(store: MoleculeStore, molecules: np.ndarray) -> float:
    """RMS force component over the atoms of ``molecules`` [M] (the force loss scale; those
    that carry forces); 1 when there are none."""
    if not len(molecules):
        return 1.0
    atoms = np.concatenate(
        [np.arange(store.offsets[i], store.offsets[i + 1]) for i in molecules.tolist()]
    )
    forces = store.forces()[atoms].astype(np.float64)
    return float(np.sqrt(np.mean(forces**2))) or 1.0
