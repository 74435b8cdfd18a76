"""Structures the exported file and the calculator must refuse by name, or survive: a NaN or
infinite cell, a pbc without three entries and integer positions are one clear error each;
two atoms at one place give finite forces, as the direct (numba) path always did."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms

from schnet_ipu.inference.calculator import SchNetCalculator
from schnet_ipu.inference.export import export_model
from tests.inference.test_export_periodic import write_model

BOX = 6.0 * torch.eye(3, dtype=torch.float64)
PBC = torch.tensor([True, True, True])


@pytest.fixture(scope="module", params=["table", "exact"])
def model(request, tmp_path_factory) -> tuple[Path, torch.jit.ScriptModule]:
    """A small random model (checkpoint) and its float64 export."""
    folder = tmp_path_factory.mktemp("bad_structures")
    path = write_model(folder, request.param)
    exported = folder / "model.torchscript.pt"
    export_model(path, exported, dtype=torch.float64)
    return path, torch.jit.load(str(exported))


def apart() -> tuple[torch.Tensor, torch.Tensor]:
    """Three atoms at distinct places (z, pos float64)."""
    pos = torch.tensor([[0.0, 0.0, 0.0], [1.6, 0.2, 0.0], [0.3, 1.4, 0.5]], dtype=torch.float64)
    return torch.tensor([29, 29, 1]), pos


def coincident() -> tuple[torch.Tensor, torch.Tensor]:
    """Four atoms, the first two at one place."""
    pos = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [2.4, 1.3, 1.0], [1.2, 2.6, 1.9]]
    return torch.tensor([29, 29, 1, 8]), torch.tensor(pos, dtype=torch.float64)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_cell_is_refused_by_name(model, bad):
    _, module = model
    z, pos = apart()
    cell = BOX.clone()
    cell[1, 2] = bad
    for pbc in (PBC, torch.tensor([True, False, False])):
        with pytest.raises(Exception, match="cell must be finite"):
            module(z, pos, cell, pbc)


@pytest.mark.parametrize("pbc", [[True, True], [True, True, True, True], [[True, True, True]]])
def test_a_pbc_without_three_entries_is_refused_by_name(model, pbc):
    _, module = model
    z, pos = apart()
    with pytest.raises(Exception, match="pbc must have 3 entries"):
        module(z, pos, BOX, torch.tensor(pbc))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float16])
def test_positions_of_another_dtype_are_refused_by_name(model, dtype):
    _, module = model
    z, pos = apart()
    with pytest.raises(Exception, match="pos must be float32 or float64"):
        module(z, (pos * 2).to(dtype))
    edges, offsets = torch.tensor([[0, 0], [1, 2]]), torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(Exception, match="pos must be float32 or float64"):
        module.forward_edges(z, (pos * 2).to(dtype), edges, offsets, False)


def test_atoms_at_one_place_give_finite_forces_like_the_calculators(model):
    """Exported file (molecule and cell) and calculator: energy, forces and stress finite,
    no net force, and the exported file's values equal the calculator's (for a table model
    the direct numba path, whose zero-length pair adds no force)."""
    path, module = model
    z, pos = coincident()
    calculator = SchNetCalculator(path, dtype=torch.float64)
    for cell in (None, BOX):
        atoms = Atoms(numbers=z.numpy(), positions=pos.numpy())
        got = module(z, pos) if cell is None else module(z, pos, cell, PBC)
        if cell is not None:
            atoms.cell, atoms.pbc = cell.numpy(), True
        atoms.calc = calculator
        forces = atoms.get_forces()
        for values in (got[1].numpy(), forces, *(s.numpy() for s in got[2:])):
            assert np.isfinite(values).all()
        assert np.abs(got[1].numpy()).max() > 0
        np.testing.assert_allclose(got[1].numpy().sum(0), 0.0, atol=1e-10)
        np.testing.assert_allclose(got[1].numpy(), forces, rtol=1e-9, atol=1e-10)
        assert abs(float(got[0]) - atoms.get_potential_energy()) <= 1e-9 * abs(float(got[0]))
        if cell is not None:
            stress = atoms.get_stress(voigt=False)
            np.testing.assert_allclose(got[2].numpy(), stress, rtol=1e-9, atol=1e-12)


def test_a_pair_at_one_place_adds_no_force(model):
    """The coincident pair's own force is zero: moving the second atom of the pair away by a
    hair changes each force by at most what that pair's slope gives (finite), and with the
    pair at one place the forces are the mean of the two sides' (a symmetric choice)."""
    _, module = model
    z, pos = coincident()
    step = 1e-7
    forces = [
        module(z, pos + torch.tensor([[0.0, 0, 0], [sign * step, 0, 0], [0, 0, 0], [0, 0, 0]],
                                     dtype=torch.float64))[1]
        for sign in (1.0, -1.0)
    ]  # fmt: skip
    at_one_place = module(z, pos)[1]
    np.testing.assert_allclose(
        at_one_place.numpy(), (forces[0] + forces[1]).numpy() / 2, rtol=1e-5, atol=1e-6
    )
