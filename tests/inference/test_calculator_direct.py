"""The calculator's hand-derived energy + forces (schnet_ipu.model.direct_forces, no
autograd) against the autograd path over the same table read in torch ops, and its
molecule pair search against ASE's neighbour list."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.neighborlist import neighbor_list

from schnet_ipu.inference.calculator import SchNetCalculator
from schnet_ipu.inference.force_paths import DirectPath, EdgeListPath, half_list
from schnet_ipu.inference.model_file import load_trained
from schnet_ipu.inference.portable import FusedTableInteraction, PortableSchNet
from schnet_ipu.inference.predictor import Predictor
from schnet_ipu.model.ops import pair_loops
from tests.inference.test_export_periodic import CUTOFF, copper_slab, sheared_bulk, write_model


def structures() -> dict[str, Atoms]:
    """A molecule (a rattled Cu/H/O cluster), a slab (periodic in two directions, triclinic)
    and a sheared bulk cell."""
    rng = np.random.default_rng(4)
    grid = np.array([(a, b, c) for a in range(3) for b in range(3) for c in range(2)])
    cluster = Atoms(
        numbers=rng.choice([1, 8, 29], size=len(grid)),
        positions=1.6 * grid + rng.uniform(-0.2, 0.2, grid.shape),
    )
    return {"molecule": cluster, "slab": copper_slab(), "sheared bulk": sheared_bulk()}


@pytest.mark.parametrize("readout", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_direct_energy_and_forces_equal_the_exported_torch_ops(tmp_path, dtype, readout):
    """Energy, forces and virial of the calculator's path (hand-derived backward, numba
    loops) equal the exported module's (the same table and backward in torch ops) on the
    same half list: 1e-10 (float64) or 1e-5 (float32) relative to the largest entry."""
    trained = load_trained(write_model(tmp_path, "table", readout))
    predictor = Predictor(trained.path, dtype=dtype)
    [path] = predictor.paths
    assert isinstance(path, DirectPath)
    direct = path.model
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
    assert [type(path) for path in table.predictor.paths] == [DirectPath]
    assert [type(path) for path in exact.predictor.paths] == [EdgeListPath]
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
