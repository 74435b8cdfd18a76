"""Forces and stress as the response of the energy: one autograd call over positions and strain.

    response = energy_response(model, batch, stress=False, create_graph=True)   # training
    response.energy, response.forces, response.stress    # [G], [N, 3], [G, 3, 3] or None
    atoms = labelled_atoms(batch)   # [N] the atoms whose frame carries target forces
    slots = labelled_slots(batch)   # [G] the slots whose frame carries target stress

The model predicts energies only; forces and stress are their derivatives, taken together in
one ``torch.autograd.grad`` over the inputs the request needs: the positions, and with
``stress`` a symmetric strain eps [G, 3, 3] (zero, but differentiable) that deforms each
molecule slot's atoms and cell together, ``pos -> pos (I + eps)`` and ``cell -> cell (I +
eps)`` (row vectors), so every edge vector ``pos[j] - pos[i] + S @ cell`` is strained alike:

    forces = -dE/dpos        [N, 3]     (zero on padding atoms)
    stress = (1 / V) dE/deps [G, 3, 3]  V = |det cell|; zero for slots without a cell

the stress in ASE's convention and sign (``ase.calculators.calculator.Calculator.
calculate_numerical_stress`` deforms the cell by ``cell @ (I + eps)`` and divides the energy
difference by the volume), in eV/Angstrom^3 when the energy is in eV. This is the idea of
schnetpack's response modules (atomistic-machine-learning/schnetpack,
``src/schnetpack/atomistic/response.py``: ``Forces`` and ``Response`` list the inputs a
request needs and differentiate the energy with respect to all of them in one ``grad``),
written here for packed batches. The losses and metrics built on it live in
:mod:`schnet_ipu.task` and :mod:`schnet_ipu.training.evaluation`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor, nn

from schnet_ipu.batch import Batch


class Response(NamedTuple):
    """Energies [G], forces [N, 3] and, when asked for, stress [G, 3, 3] of one batch."""

    energy: Tensor
    forces: Tensor
    stress: Tensor | None


def energy_response(
    model: nn.Module, batch: Batch, stress: bool = False, create_graph: bool = False
) -> Response:
    """The model's energies and their derivatives (see the module docstring).

    ``batch.pos`` is used as it is when it already requires grad (then forces are
    differentiable in it). ``stress`` needs a periodic batch (``cell`` and ``edge_shift``).
    ``create_graph=True`` keeps the graph of the derivatives so that a loss on them can be
    differentiated with respect to the parameters (training); False for evaluation.
    """
    if stress and (batch.cell is None or batch.edge_shift is None):
        raise ValueError("stress needs a periodic batch (a store with cells, radius graph)")
    pos = batch.pos if batch.pos.requires_grad else batch.pos.detach().requires_grad_(True)
    with torch.enable_grad():
        inputs = [pos]
        if stress:  # the strain, differentiated together with the positions
            inputs.append(batch.cell.new_zeros((batch.num_graphs, 3, 3)).requires_grad_(True))
            energy = model(_strained(batch, pos, inputs[1]))
        else:
            energy = model(dataclasses.replace(batch, pos=pos))
        grads = torch.autograd.grad(energy.sum(), inputs, create_graph=create_graph)
    forces = torch.where(batch.node_mask.unsqueeze(1), -grads[0], 0.0)
    return Response(energy, forces, _stress(grads[1], batch.cell) if stress else None)


def _strained(batch: Batch, pos: Tensor, strain: Tensor) -> Batch:
    """``batch`` with each slot's atoms and cell deformed by the symmetric part of ``strain``
    [G, 3, 3]: ``pos + pos @ eps`` [N, 3] and ``cell + cell @ eps`` [G, 3, 3]."""
    symmetric = 0.5 * (strain + strain.transpose(1, 2))
    per_atom = torch.cat([symmetric, symmetric.new_zeros((1, 3, 3))])[batch.graph]  # [N, 3, 3]
    strained_pos = pos + (pos.unsqueeze(-1) * per_atom).sum(1)  # pos @ eps, row vectors
    strained_cell = batch.cell + torch.bmm(batch.cell, symmetric)
    return dataclasses.replace(batch, pos=strained_pos, cell=strained_cell)


def _stress(virial: Tensor, cell: Tensor) -> Tensor:
    """dE/deps [G, 3, 3] over the cell volumes [G]; zero where a slot has no volume (padding
    slots and molecules)."""
    volume = torch.linalg.det(cell).abs()
    has_volume = (volume > 0).view(-1, 1, 1)
    return torch.where(
        has_volume, virial / torch.where(has_volume, volume.view(-1, 1, 1), 1.0), 0.0
    )


def labelled_atoms(batch: Batch) -> Tensor:
    """[N] bool: the real atoms whose frame carries target forces (every real atom unless
    the batch has a ``forces_mask``; padding atoms, of the filler slot G, never)."""
    if batch.forces_mask is None:
        return batch.node_mask
    per_slot = torch.cat([batch.forces_mask, batch.forces_mask.new_zeros(1)])  # [G + 1]
    return per_slot[batch.graph]


def labelled_slots(batch: Batch) -> Tensor:
    """[G] bool: the real slots of a periodic ``batch`` whose frame carries target stress:
    those with a cell, and of them those its ``stress_mask`` marks when it has one."""
    periodic = batch.graph_mask & (torch.linalg.det(batch.cell).abs() > 0)
    return periodic if batch.stress_mask is None else periodic & batch.stress_mask


def atoms_per_molecule(batch: Batch) -> Tensor:
    """Real atoms of each molecule slot [G] (0 for padding slots), float. A sum into G + 1
    slots (padding atoms point at the last), not ``bincount``, which sizes its output on the
    host and so cannot run inside a CUDA graph's capture."""
    ones = batch.pos.new_ones(batch.graph.shape[0])
    slots = batch.pos.new_zeros(batch.num_graphs + 1).index_add_(0, batch.graph, ones)
    return slots[: batch.num_graphs]
