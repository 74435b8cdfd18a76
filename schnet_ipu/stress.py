"""Energy, forces and stress of periodic batches by autograd (the virial route).

    energy, forces, stress = energy_forces_stress(model, batch, create_graph=False)
    slots = labelled_slots(batch)  # [G] the slots whose frame carries target stress

A symmetric strain eps [G, 3, 3] (zero, but differentiable) deforms each molecule slot's
atoms and cell together, ``pos -> pos (I + eps)`` and ``cell -> cell (I + eps)`` (row
vectors), so every edge vector ``pos[j] - pos[i] + S @ cell`` is strained alike. Then

    forces = -dE/dpos        [N, 3]  (zero on padding atoms)
    stress = (1 / V) dE/deps [G, 3, 3]  V = |det cell|; zero for slots without a cell

which is ASE's convention and sign (``ase.calculators.calculator.Calculator.
calculate_numerical_stress`` deforms the cell by ``cell @ (I + eps)`` and divides the
energy difference by the volume), in eV/Angstrom^3 when the energy is in eV.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from schnet_ipu.batch import Batch


def labelled_slots(batch: Batch) -> Tensor:
    """[G] bool: the real slots of a periodic ``batch`` whose frame carries target stress:
    those with a cell, and of them those its ``stress_mask`` marks when it has one."""
    periodic = batch.graph_mask & (torch.linalg.det(batch.cell).abs() > 0)
    return periodic if batch.stress_mask is None else periodic & batch.stress_mask


def energy_forces_stress(
    model: nn.Module, batch: Batch, create_graph: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Energies [G], forces [N, 3] and stress [G, 3, 3] of a periodic ``batch`` (one with
    ``cell`` and ``edge_shift``); ``create_graph=True`` keeps the graph of forces and stress so
    a loss on them can be differentiated with respect to the parameters (training)."""
    if batch.cell is None or batch.edge_shift is None:
        raise ValueError("stress needs a periodic batch (a store with cells, radius graph)")
    num_graphs = batch.num_graphs
    pos = batch.pos if batch.pos.requires_grad else batch.pos.detach().requires_grad_(True)
    with torch.enable_grad():
        strain = batch.cell.new_zeros((num_graphs, 3, 3)).requires_grad_(True)
        symmetric = 0.5 * (strain + strain.transpose(1, 2))
        per_atom = torch.cat([symmetric, symmetric.new_zeros((1, 3, 3))])[batch.graph]  # [N,3,3]
        strained_pos = pos + (pos.unsqueeze(-1) * per_atom).sum(1)  # pos @ eps, row vectors
        strained_cell = batch.cell + torch.bmm(batch.cell, symmetric)
        strained = dataclasses.replace(batch, pos=strained_pos, cell=strained_cell)
        energy = model(strained)
        grad_pos, virial = torch.autograd.grad(
            energy.sum(), (pos, strain), create_graph=create_graph
        )
    forces = torch.where(batch.node_mask.unsqueeze(1), -grad_pos, 0.0)
    volume = torch.linalg.det(batch.cell).abs()  # [G]; 0 for padding slots and molecules
    has_volume = (volume > 0).view(-1, 1, 1)
    stress = torch.where(
        has_volume, virial / torch.where(has_volume, volume.view(-1, 1, 1), 1.0), 0.0
    )
    return energy, forces, stress
