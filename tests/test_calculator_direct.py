"""The calculator's hand-derived energy + forces (schnet_ipu.model.direct_forces, no
autograd) against the autograd path over the same table read in torch ops, and its
molecule pair search against ASE's neighbour list."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, fcc111, molecule
from ase.neighborlist import neighbor_list

from schnet_ipu.calculator import SchNetCalculator
from schnet_ipu.checkpoint import save_checkpoint
from schnet_ipu.config import ModelConfig
from schnet_ipu.inference import Predictor, half_list
from schnet_ipu.model.ops import pair_loops
from schnet_ipu.model_file import ModelSpec, load_trained
from schnet_ipu.portable import FusedTableInteraction, PortableSchNet
from schnet_ipu.task import EnergyTask, TargetTransform

CUTOFF = 4.5
ELEMENTS = [1, 6, 8, 29]


def write_model(folder: Path, filter_kind: str, readout: str) -> Path:
    """A small model with random weights (atom references and atomref too), as a checkpoint."""
    reference = np.zeros(119)
    reference[ELEMENTS] = [-13.6, -1029.8, -2042.6, -1.2]
    arch = ModelConfig(
        hidden_channels=24, num_filters=20, num_interactions=3, num_gaussians=12,
        cutoff=CUTOFF, graph="radius", filter=filter_kind, readout=readout,
    )  # fmt: skip
    spec = ModelSpec(
        model=dataclasses.asdict(arch),
        max_nodes_per_pack=64,
        mean=-0.3,
        std=1.7,
        task=EnergyTask(TargetTransform(tuple(reference.tolist()), 1.0)).to_dict(),
        unit="eV",
        forces_unit="eV/Angstrom",
        target="energy",
        pack={"max_nodes": 64, "max_graphs": 1, "max_edges": None, "packs_per_batch": 1},
        elements=ELEMENTS,
    )
    torch.manual_seed(11)
    model = spec.build_model()
    torch.nn.init.normal_(model.atomref.weight, std=0.5)
    path = folder / f"model-{filter_kind}-{readout}.pt"
    state = {"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "rng": {}}
    state.update(epoch=0, call=0, best_mae=0.0, config={}, model_spec=spec.to_dict())
    save_checkpoint(path, state)
    return path


def structures() -> dict[str, Atoms]:
    """A molecule, a slab (periodic in two directions) and a sheared bulk cell."""
    slab = fcc111("Cu", size=(2, 2, 3), vacuum=5.0, a=3.61)
    slab.cell[1] += [0.6, 0.0, 0.0]
    slab.rattle(0.08, seed=2)
    cell = bulk("Cu", "fcc", a=3.61).repeat((2, 2, 2))
    cell.set_cell(cell.cell.array + np.array([[0.0, 0.4, 0.2], [0.3, 0.0, 0.0], [0.0] * 3]))
    cell.rattle(0.1, seed=3)
    ethanol = molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=4)
    return {"molecule": ethanol, "slab": slab, "sheared bulk": cell}


@pytest.mark.parametrize("readout", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_direct_energy_and_forces_equal_autograd_over_the_torch_table(tmp_path, dtype, readout):
    """Energy, forces and virial of the calculator's path (hand-derived backward, numba
    loops) equal autograd through the unfused module (the same table in torch ops) on the
    same half list: 1e-10 (float64) or 1e-5 (float32) relative to the largest entry."""
    trained = load_trained(write_model(tmp_path, "table", readout))
    predictor = Predictor(trained.path, dtype=dtype)
    direct = predictor.direct[0]
    assert direct is not None
    reference = PortableSchNet.from_trained(trained, dtype)
    assert not isinstance(reference.interactions[0], FusedTableInteraction)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    for name, atoms in structures().items():
        z, pos = atoms.numbers.astype(np.int64), atoms.positions
        periodic = bool(atoms.pbc.any())
        box = atoms.cell.array if periodic else np.zeros((3, 3))
        i, j, shift = half_list(pos, box, atoms.pbc, CUTOFF, periodic)
        got = direct.energy_forces(z, pos, i, j, shift, box)
        offsets = shift @ box if periodic else np.zeros((len(i), 3))
        edges = torch.from_numpy(np.stack([i, j]))
        want = reference.forward_edges(
            torch.from_numpy(z), torch.from_numpy(pos), edges, torch.from_numpy(offsets), False
        )
        assert abs(got[0] - want[0].item()) <= tolerance * abs(want[0].item()), name
        checks = (("forces", got[1], want[1]), ("virial", got[2], want[2]))
        for quantity, a, b in checks[: 2 if periodic else 1]:
            b = b.double().numpy()
            assert np.abs(b).max() > 0
            error = np.abs(a - b).max() / np.abs(b).max()
            assert error <= tolerance, (name, quantity, error)


def test_the_calculator_takes_the_direct_path_for_table_models_only(tmp_path):
    """A table model's calculator runs the direct path and agrees with the finite
    differences of its own energy; an exact-filter model keeps autograd."""
    table = SchNetCalculator(write_model(tmp_path, "table", "sum"))
    exact = SchNetCalculator(write_model(tmp_path, "exact", "sum"))
    assert table.predictor.direct[0] is not None
    assert exact.predictor.direct == [None]
    atoms = structures()["sheared bulk"]
    atoms.calc = table
    forces = atoms.get_forces()
    step = 1e-5
    for atom, axis in ((0, 0), (3, 2), (5, 1)):
        moved = [atoms.copy() for _ in range(2)]
        for sign, frame in zip((1, -1), moved):
            frame.positions[atom, axis] += sign * step
            frame.calc = table
        slope = (moved[0].get_potential_energy() - moved[1].get_potential_energy()) / (2 * step)
        assert abs(-slope - forces[atom, axis]) <= 1e-6 * max(1.0, abs(slope))


def test_molecule_pairs_are_ases_half_list():
    """Every pair i < j within the cutoff, once, as ASE's neighbour list finds them."""
    rng = np.random.default_rng(0)
    pos = rng.uniform(0.0, 9.0, (150, 3))
    i, j = pair_loops.molecule_pairs(pos, CUTOFF)
    atoms = Atoms(numbers=[6] * len(pos), positions=pos)
    ase_i, ase_j = neighbor_list("ij", atoms, CUTOFF)
    keep = ase_i < ase_j
    assert len(i) > 1000 and np.all(i < j)
    assert sorted(zip(i.tolist(), j.tolist())) == sorted(zip(ase_i[keep], ase_j[keep]))
