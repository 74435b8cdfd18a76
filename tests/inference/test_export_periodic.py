"""The exported model on periodic cells: energy, forces and stress against the packed training
model and the ASE calculator, for every pbc combination, triclinic cells, cells thinner than
the cutoff, slabs, supercells, an engine's own neighbour list, and float32/float64 inputs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, fcc111
from ase.neighborlist import neighbor_list

from schnet_ipu.checkpoint import save_checkpoint
from schnet_ipu.config import ModelConfig
from schnet_ipu.data.periodic_pairs import frame_pairs
from schnet_ipu.feed.collate import PackMolecule, collate
from schnet_ipu.feed.layout import Layout
from schnet_ipu.inference import force_paths
from schnet_ipu.inference.calculator import SchNetCalculator
from schnet_ipu.inference.export import export_model
from schnet_ipu.inference.model_file import ModelSpec, load_trained
from schnet_ipu.inference.portable import FusedTableInteraction, PortableSchNet
from schnet_ipu.inference.predictor import Predictor
from schnet_ipu.response import energy_response
from schnet_ipu.task import EnergyTask, TargetTransform

CUTOFF = 5.0
ENERGY, FORCES, STRESS = 1e-4, 1e-3, 1e-5  # eV, eV/A, eV/A^3: the tolerances


def write_model(folder: Path, filter_kind: str, readout: str = "sum") -> Path:
    """A small model with random weights (atom references too) as a checkpoint file."""
    reference = np.zeros(119)
    reference[[1, 8, 29]] = [-13.6, -2042.6, -1.2]
    arch = ModelConfig(
        hidden_channels=16, num_filters=12, num_interactions=2, num_gaussians=10,
        cutoff=CUTOFF, graph="radius", filter=filter_kind, readout=readout,
    )  # fmt: skip
    spec = ModelSpec(
        model=dataclasses.asdict(arch),
        max_nodes_per_pack=64,
        mean=-0.4,
        std=1.3,
        task=EnergyTask(TargetTransform(tuple(reference.tolist()), 1.0)).to_dict(),
        unit="eV",
        forces_unit="eV/Angstrom",
        target="energy",
        pack={"max_nodes": 64, "max_graphs": 1, "max_edges": None, "packs_per_batch": 1},
        elements=[1, 8, 29],
    )
    torch.manual_seed(5)
    model = spec.build_model()
    torch.nn.init.normal_(model.atomref.weight, std=0.5)
    path = folder / f"model-{filter_kind}-{readout}.pt"
    state = {"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "rng": {}}
    state.update(epoch=0, call=0, best_mae=0.0, config={}, model_spec=spec.to_dict())
    save_checkpoint(path, state)
    return path


@pytest.fixture(scope="module", params=["table", "exact"])
def model_path(request, tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("export"), request.param)


@pytest.fixture(scope="module")
def exported(model_path) -> dict[str, torch.jit.ScriptModule]:
    out = {}
    for dtype in (torch.float32, torch.float64):
        path = model_path.with_name(f"{model_path.stem}-{dtype}.torchscript.pt")
        export_model(model_path, path, dtype=dtype)
        out[str(dtype)] = torch.jit.load(str(path))
    return out


def packed_reference(model_path: Path, atoms: Atoms) -> tuple[float, np.ndarray, np.ndarray]:
    """(energy, forces, stress) of the packed training model in float64, vesin's pairs."""
    trained = load_trained(model_path)
    z, pos, cell, pbc = atoms.numbers, atoms.positions, atoms.cell.array, atoms.pbc
    pairs = len(frame_pairs(pos, cell, pbc, CUTOFF)[0])
    layout = Layout(1, len(z), 1, max(2 * pairs, 2), CUTOFF)
    batch = collate([[PackMolecule(z, pos, 0.0, 0, cell=cell, pbc=pbc)]], layout, False)
    batch = dataclasses.replace(
        batch, pos=torch.as_tensor(pos), cell=torch.as_tensor(cell).unsqueeze(0)
    )
    model = trained.model.double()
    model.max_nodes_per_pack = len(z)
    energy, forces, stress = energy_response(model, batch, stress=True, create_graph=False)
    total = energy[0].item() + trained.spec.transform.reference(z)
    return total, forces.detach().numpy(), stress[0].detach().numpy()


def run_export(module, atoms: Atoms, dtype: torch.dtype = torch.float64) -> list[np.ndarray]:
    args = [torch.as_tensor(atoms.numbers), torch.as_tensor(atoms.positions, dtype=dtype)]
    args += [torch.as_tensor(atoms.cell.array, dtype=dtype), torch.as_tensor(atoms.pbc)]
    return [t.detach().double().numpy() for t in module(*args)]


def thin_triclinic_cell() -> Atoms:
    """Three atoms in a sheared cell whose plane spacings (2.4-3.1 A) are below the cutoff:
    every atom sees several of its own images."""
    cell = np.array([[2.7, 0.0, 0.0], [0.9, 2.6, 0.0], [0.4, -0.5, 3.1]])
    frac = np.array([[0.1, 0.2, 0.05], [0.55, 0.4, 0.6], [0.8, 0.9, 0.3]])
    return Atoms("Cu2H", scaled_positions=frac, cell=cell, pbc=True)


@pytest.mark.parametrize("pbc", list(itertools.product([False, True], repeat=3)))
def test_every_pbc_on_a_thin_triclinic_cell_equals_the_training_model(model_path, exported, pbc):
    atoms = thin_triclinic_cell()
    atoms.pbc = pbc
    atoms.positions += [0.3, -4.2, 7.7]  # outside the cell: the search wraps
    if not any(pbc):
        atoms.positions[2] += [0.6, 0.0, 0.0]  # a cluster: keep H off a Cu
    energy, forces, stress = packed_reference(model_path, atoms) if any(pbc) else (None,) * 3
    for name, module in exported.items():
        for dtype in (torch.float32, torch.float64):  # either input precision, any export
            got = run_export(module, atoms, dtype)
            assert got[1].shape == (3, 3) and got[2].shape == (3, 3)
            if energy is None:  # no periodic direction: compare with the molecule call
                molecule = module(torch.as_tensor(atoms.numbers), torch.as_tensor(atoms.positions))
                assert len(molecule) == 2
                assert abs(got[0] - molecule[0].item()) <= ENERGY
                np.testing.assert_allclose(got[1], molecule[1].numpy(), atol=FORCES)
                continue
            assert abs(got[0] - energy) <= ENERGY, (name, dtype)
            np.testing.assert_allclose(got[1], forces, atol=FORCES, err_msg=f"{name} {dtype}")
            np.testing.assert_allclose(got[2], stress, atol=STRESS, err_msg=f"{name} {dtype}")


def copper_slab() -> Atoms:
    slab = fcc111("Cu", size=(3, 3, 3), vacuum=6.0, a=3.61)
    slab.cell[1] += [0.7, 0.0, 0.0]  # triclinic in-plane too
    slab.rattle(0.08, seed=2)
    return slab


def sheared_bulk() -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.61).repeat((3, 2, 2))
    shear = np.array([[0.0, 0.4, 0.2], [0.3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    atoms.set_cell(atoms.cell.array + shear)
    atoms.rattle(0.1, seed=3)
    return atoms


@pytest.mark.parametrize("make", [copper_slab, sheared_bulk])
def test_export_equals_the_calculator_on_slabs_and_triclinic_cells(model_path, exported, make):
    atoms = make()
    atoms.calc = SchNetCalculator(model_path, dtype=torch.float64)
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    stress = atoms.get_stress(voigt=False)
    reference = packed_reference(model_path, atoms)
    assert abs(energy - reference[0]) <= 1e-9 * max(1.0, abs(energy))
    np.testing.assert_allclose(stress, reference[2], atol=1e-10)
    for name, module in exported.items():
        got = run_export(module, atoms)
        assert abs(got[0] - energy) <= ENERGY, name
        np.testing.assert_allclose(got[1], forces, atol=FORCES, err_msg=name)
        np.testing.assert_allclose(got[2], stress, atol=STRESS, err_msg=name)


@pytest.mark.parametrize("make", [copper_slab, sheared_bulk])
def test_without_vesin_the_calculator_searches_with_the_torch_cell_list(
    model_path, make, monkeypatch
):
    """Python < 3.10 has no vesin wheel (the IPU SDK's 3.8): the calculator then finds its
    pairs with the exported file's torch-ops cell list, and predicts the same."""
    atoms = make()
    with_vesin = Predictor(model_path, dtype=torch.float64).predict(
        atoms.numbers, atoms.positions, cell=atoms.cell.array, pbc=atoms.pbc
    )
    monkeypatch.setattr(force_paths, "vesin", None)
    without = Predictor(model_path, dtype=torch.float64).predict(
        atoms.numbers, atoms.positions, cell=atoms.cell.array, pbc=atoms.pbc
    )
    assert abs(without.energy - with_vesin.energy) <= 1e-9 * max(1.0, abs(with_vesin.energy))
    np.testing.assert_allclose(without.forces, with_vesin.forces, atol=1e-10)
    np.testing.assert_allclose(without.stress, with_vesin.stress, atol=1e-12)


def test_atoms_without_neighbours_have_their_own_energy_and_no_force(model_path, exported):
    """One atom, two atoms farther apart than the cutoff, one atom in a cell wider than
    twice the cutoff: no pair at all; each atom's energy is the model's for its element
    alone (as the packed model gives it), forces and stress are zero."""
    reference = PortableSchNet.from_trained(load_trained(model_path), torch.float64)
    alone = {z: float(reference(torch.tensor([z]), torch.zeros(1, 3, dtype=torch.float64))[0])
             for z in (8, 29)}  # fmt: skip
    far = torch.tensor([[0.0, 0.0, 0.0], [2 * CUTOFF, 0.0, 0.0]], dtype=torch.float64)
    cell, pbc = torch.eye(3, dtype=torch.float64) * 2.5 * CUTOFF, torch.tensor([True] * 3)
    for name, module in exported.items():
        energy, forces = module(torch.tensor([8, 29]), far)
        assert float(energy) == pytest.approx(alone[8] + alone[29], abs=1e-4), name
        assert float(forces.abs().max()) == 0.0
        energy, forces, stress = module(torch.tensor([29]), far[:1], cell, pbc)
        assert float(energy) == pytest.approx(alone[29], abs=1e-4), name
        assert float(forces.abs().max()) == 0.0 and float(stress.abs().max()) == 0.0
    energy, _, _ = packed_reference(model_path, Atoms("O", positions=[[0, 0, 0]]))
    assert alone[8] == pytest.approx(energy, abs=1e-9)


def test_a_supercell_has_the_same_energy_per_atom(exported):
    cell = thin_triclinic_cell()
    big = cell.repeat((2, 2, 2))
    for name, module in exported.items():
        small_e, _, small_s = run_export(module, cell)
        big_e, big_f, big_s = run_export(module, big)
        assert abs(big_e / len(big) - small_e / len(cell)) <= 1e-5, name
        np.testing.assert_allclose(big_s, small_s, atol=STRESS, err_msg=name)
        np.testing.assert_allclose(big_f[: len(cell)], run_export(module, cell)[1], atol=FORCES)


def test_edges_in_many_chunks_give_what_one_pass_gives(model_path):
    """The torch-ops convolution walks the edges in chunks (``edge_chunk`` for the exact
    filter, ``chunk_bytes`` of the table's workspace): 7 edges at a time (dozens of chunks,
    a short last one) equals one pass, to 1e-12 in float64."""
    one_pass = PortableSchNet.from_trained(load_trained(model_path), torch.float64)
    chunked = PortableSchNet.from_trained(load_trained(model_path), torch.float64)
    chunked.chunk_bytes = 7 * 8 * chunked.num_filters  # float64 rows of F filters
    for block in chunked.interactions:
        block.edge_chunk = 7
    atoms = sheared_bulk()
    pairs = len(frame_pairs(atoms.positions, atoms.cell.array, atoms.pbc, CUTOFF)[0])
    assert pairs > 20 * 7 and pairs % 7
    whole = run_export(one_pass, atoms)
    for got, want in zip(run_export(torch.jit.script(chunked), atoms), whole):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_export_compiles_with_torch_geometric_imported(tmp_path):
    """PyG replaces ``torch.index_select`` with a Python function when imported
    (``torch_geometric/hash_tensor.py``), which TorchScript cannot compile; the export calls
    the aten op itself. In a fresh process: TorchScript keeps a class compiled once."""
    path = write_model(tmp_path, "table")
    script = (
        "import sys, torch, torch_geometric\n"
        "from pathlib import Path\n"
        "from schnet_ipu.inference.export import export_model\n"
        "export_model(Path(sys.argv[1]), Path(sys.argv[2]))\n"
        "module = torch.jit.load(sys.argv[2])\n"
        "pos = torch.tensor([[0, 0, 0.0], [0.96, 0, 0], [0, 0.96, 0]])\n"
        "print(float(module(torch.tensor([8, 1, 1]), pos)[0]))\n"
    )
    out = tmp_path / "exported.pt"
    done = subprocess.run(
        [sys.executable, "-c", script, str(path), str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    want = PortableSchNet.from_trained(load_trained(path))
    z, pos = torch.tensor([8, 1, 1]), torch.tensor([[0, 0, 0.0], [0.96, 0, 0], [0, 0.96, 0]])
    assert float(done.stdout.split()[-1]) == pytest.approx(float(want(z, pos)[0]), abs=1e-6)


@pytest.mark.parametrize("full_list", [True, False])
def test_an_engines_neighbour_list_gives_the_same_energy_forces_and_virial(exported, full_list):
    """ASE's ``neighbor_list("ijD")`` (a full list, as LAMMPS's) or its half, through
    ``forward_edges``: the energy and forces of the model's own search, virial = -V stress."""
    atoms = sheared_bulk()
    i, j, shift, vectors = neighbor_list("ijSD", atoms, CUTOFF)
    if not full_list:  # each pair once: i < j, or an atom and its image at a positive shift
        positive = [tuple(s) > (0, 0, 0) for s in shift]
        keep = (i < j) | ((i == j) & np.array(positive))
        i, j, vectors = i[keep], j[keep], vectors[keep]
    offsets = vectors - (atoms.positions[j] - atoms.positions[i])
    volume = atoms.get_volume()
    for name, module in exported.items():
        energy, forces, stress = run_export(module, atoms)
        edge_index = torch.as_tensor(np.stack([i, j]))
        got = module.forward_edges(
            torch.as_tensor(atoms.numbers), torch.as_tensor(atoms.positions),
            edge_index, torch.as_tensor(offsets), full_list,
        )  # fmt: skip
        assert abs(got[0].item() - energy) <= ENERGY, name
        np.testing.assert_allclose(got[1].numpy(), forces, atol=FORCES, err_msg=name)
        np.testing.assert_allclose(-got[2].numpy() / volume, stress, atol=STRESS, err_msg=name)


@pytest.mark.parametrize("full_list", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_the_calculators_fused_loops_equal_the_torch_ops(tmp_path, dtype, full_list):
    """The calculator's modules (numba's fused table loops, parameters frozen: no coefficient
    gradient) against the same table read in torch ops, on one pair list (half: the loops'
    pair-symmetric layout; full: one edge per filter): energy, forces and virial equal to
    1e-10 (float64) or 1e-5 (float32) of the largest entry."""
    trained = load_trained(write_model(tmp_path, "table"))
    fused = force_paths.portable_module(trained, dtype)
    reference = PortableSchNet.from_trained(trained, dtype)
    assert isinstance(fused.interactions[0], FusedTableInteraction)
    assert not isinstance(reference.interactions[0], FusedTableInteraction)
    atoms = sheared_bulk()
    i, j, shift, vectors = neighbor_list("ijSD", atoms, CUTOFF)
    if not full_list:
        keep = (i < j) | ((i == j) & np.array([tuple(s) > (0, 0, 0) for s in shift]))
        i, j, vectors = i[keep], j[keep], vectors[keep]
    offsets = torch.as_tensor(vectors - (atoms.positions[j] - atoms.positions[i]))
    args = (torch.as_tensor(atoms.numbers), torch.as_tensor(atoms.positions))
    edges = torch.as_tensor(np.stack([i, j]))
    got = fused.forward_edges(*args, edges, offsets, full_list)
    want = reference.forward_edges(*args, edges, offsets, full_list)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    assert abs(got[0].item() - want[0].item()) <= tolerance * abs(want[0].item())
    for name, a, b in (("forces", got[1], want[1]), ("virial", got[2], want[2])):
        assert b.abs().max() > 0
        error = float((a - b).abs().max() / b.abs().max())
        assert error <= tolerance, (name, error)


def test_finite_differences_of_the_export_are_its_forces_and_stress(model_path, tmp_path):
    """float64 export: forces = -dE/dpos and stress = (1/V) dE/dstrain, numerically."""
    path = tmp_path / "model64.pt"
    export_model(model_path, path, dtype=torch.float64)
    module = torch.jit.load(str(path))
    atoms = thin_triclinic_cell()
    _, forces, stress = run_export(module, atoms)
    h = 1e-5
    for atom, axis in [(0, 0), (2, 1)]:
        moved = []
        for sign in (1, -1):
            shifted = atoms.copy()
            shifted.positions[atom, axis] += sign * h
            moved.append(run_export(module, shifted)[0])
        assert abs(-(moved[0] - moved[1]) / (2 * h) - forces[atom, axis]) < 1e-6
    for a, b in [(0, 0), (1, 2)]:
        strained = []
        for sign in (1, -1):
            eps = np.zeros((3, 3))
            eps[a, b] = eps[b, a] = sign * h
            deformed = atoms.copy()
            deformed.set_cell(atoms.cell.array @ (np.eye(3) + eps), scale_atoms=True)
            strained.append(run_export(module, deformed)[0])
        numeric = (strained[0] - strained[1]) / (2 * h) / atoms.get_volume()
        assert abs(numeric / (1 if a == b else 2) - stress[a, b]) < 1e-7


PLAIN_TORCH = """
import json, sys
import torch
model = torch.jit.load(sys.argv[1])
z, pos, cell, pbc = json.loads(sys.argv[2])
out = model(torch.tensor(z), torch.tensor(pos, dtype=torch.float64), torch.tensor(cell),
            torch.tensor(pbc))
leaked = [m for m in sys.modules if m.startswith("schnet_ipu")]
print(json.dumps({"out": [t.tolist() for t in out], "leaked": leaked}))
"""


def test_the_periodic_export_runs_in_plain_torch(model_path, tmp_path):
    """A process that never imports schnet_ipu (no vesin either) evaluates a slab."""
    path = tmp_path / "model.pt"
    export_model(model_path, path)
    atoms = copper_slab()
    payload = json.dumps(
        [atoms.numbers.tolist(), atoms.positions.tolist(), atoms.cell.array.tolist(),
         atoms.pbc.tolist()]
    )  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", PLAIN_TORCH, str(path), payload],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["leaked"] == []
    energy, forces, stress = packed_reference(model_path, atoms)
    assert abs(report["out"][0] - energy) <= ENERGY
    np.testing.assert_allclose(report["out"][1], forces, atol=FORCES)
    np.testing.assert_allclose(report["out"][2], stress, atol=STRESS)
