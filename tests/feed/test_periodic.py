"""Periodic systems (issue 29): cells in the store, vesin pairs, shifts through the feed, and
the exact identities of the model's energy and stress (on untrained float64 models; the
accuracy and MD targets need the task layer's stress loss and are not tested here)."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import warnings
from pathlib import Path

import ase.io
import h5py
import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.neighborlist import neighbor_list

from schnet_ipu.backends.poptorch_ops import check_poptorch_ops
from schnet_ipu.batch import Batch
from schnet_ipu.data import MoleculeStore, StoreError, edge_counts, import_ase
from schnet_ipu.data.periodic_pairs import (
    PeriodicPairs,
    frame_pairs,
    periodic_pairs,
    periodic_pairs_path,
)
from schnet_ipu.data.writer import StoreWriter
from schnet_ipu.feed.collate import PackMolecule, collate
from schnet_ipu.feed.dataset import PackedDataset
from schnet_ipu.feed.layout import Layout
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.inference import cell_list
from schnet_ipu.model import SchNet
from schnet_ipu.packing import plan_packing
from schnet_ipu.response import energy_response
from tests.helpers import assert_same_batches, epoch_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_emt_bulk

CUTOFF = 5.0


def full_list(i, j, shift) -> set[tuple[int, int, tuple[int, ...]]]:
    """A half list (i, j, S) and its reverses (j, i, -S) as a set of (i, j, S)."""
    shift = np.asarray(shift, dtype=np.int64)
    forward = zip(i.tolist(), j.tolist(), map(tuple, shift.tolist()))
    backward = zip(j.tolist(), i.tolist(), map(tuple, (-shift).tolist()))
    return {*forward, *backward}


def ase_list(atoms: Atoms, cutoff: float) -> set[tuple[int, int, tuple[int, ...]]]:
    i, j, shift = neighbor_list("ijS", atoms, cutoff)
    return set(zip(i.tolist(), j.tolist(), map(tuple, shift.tolist())))


def triclinic(pbc, repeat=(1, 1, 1), seed: int = 0) -> Atoms:
    """Two rattled atoms (Cu, Au) in a sheared fcc primitive cell whose edges (3.2 A) are
    shorter than the cutoff, repeated ``repeat`` times."""
    shear = np.array([[0, 0, 0], [0, 0, 0], [0.4, 0.25, 0]])
    cell = bulk("Cu", "fcc", a=4.5).cell.array + shear
    scaled = [[0, 0, 0], [0.5, 0.5, 0.5]]
    atoms = Atoms("CuAu", scaled_positions=scaled, cell=cell, pbc=pbc).repeat(repeat)
    atoms.rattle(0.1, seed=seed)
    return atoms


@pytest.mark.parametrize("pbc", list(itertools.product([False, True], repeat=3)), ids=str)
def test_vesin_pairs_are_ases_neighbour_list(pbc):
    atoms = triclinic(pbc)  # cell edges ~2.5 A against a 5 A cutoff: many images of each atom
    i, j, shift = frame_pairs(atoms.positions, atoms.cell.array, atoms.pbc, CUTOFF)
    assert np.all((i < j) | ((i == j) & (shift != 0).any(axis=1)))  # the half list
    pairs = full_list(i, j, shift)
    assert pairs == ase_list(atoms, CUTOFF) and len(pairs) == 2 * len(i)
    if sum(pbc):  # self-images and several images of one neighbour
        assert np.any(i == j)
        assert len({(a, b) for a, b, _ in pairs}) < len(pairs)


@pytest.mark.parametrize("pbc", [(True, True, True), (True, False, True), (False,) * 3], ids=str)
def test_the_torch_cell_lists_bins_in_blocks_of_centres_find_every_pair(pbc):
    """The exported file's own search: bins of side cutoff, 7 centres at a time (a dozen
    blocks, a short last one) find what comparing every pair finds; and the whole search is
    ASE's neighbour list."""
    atoms = triclinic(pbc, repeat=(4, 4, 3))
    pos, cell = torch.as_tensor(atoms.positions), torch.as_tensor(atoms.cell.array)
    wrap, points, _, _ = cell_list.periodic_images(pos, cell, torch.as_tensor(pbc), CUTOFF)
    centres = pos - wrap @ cell
    every = cell_list.candidate_pairs(centres, points, CUTOFF, dense_pairs=10**9)
    binned = cell_list.candidate_pairs(centres, points, CUTOFF, dense_pairs=0, centre_block=7)

    def sorted_pairs(c: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.sort(c * len(points) + p).values

    assert torch.equal(sorted_pairs(*binned), sorted_pairs(*every)) and len(every[0]) > 0
    assert bool((binned[0][1:] >= binned[0][:-1]).all())  # blocks keep the centres' order
    i, j, shift = cell_list.neighbour_pairs(pos, cell, torch.as_tensor(pbc), CUTOFF)
    assert full_list(i.numpy(), j.numpy(), shift.numpy()) == ase_list(atoms, CUTOFF)


def emt_frames(count: int) -> list[Atoms]:
    return make_emt_bulk.make_frames(count, strain=0.03, rattle=0.05, seed=1)


@pytest.fixture(scope="module")
def emt_store(tmp_path_factory) -> Path:
    """EMT bulk, vacancy and slab frames plus two molecules, imported from extxyz."""
    folder = tmp_path_factory.mktemp("emt_bulk")
    frames = emt_frames(24)
    molecule = Atoms("Cu3", positions=[[0, 0, 0], [2.5, 0, 0], [0, 2.5, 0]])
    molecule.calc = EMT()
    frames += [make_emt_bulk.labelled(molecule)] * 2
    path = folder / "emt.extxyz"
    ase.io.write(path, frames, format="extxyz")
    return import_ase([path], folder / "emt.h5", progress=False)


def test_import_keeps_cells_pbc_and_stress(emt_store):
    store = MoleculeStore(emt_store)
    frames = ase.io.read(store.attrs["files"][0], index=":")
    cells, pbcs = store.cells()
    assert store.periodic and store.has_stress and store.stress_unit == "eV/Angstrom^3"
    for m, atoms in enumerate(frames):
        if not atoms.pbc.any():  # the molecules: no cell, pbc False, zero stress
            assert not pbcs[m].any() and not cells[m].any() and not store.stress()[m].any()
            continue
        np.testing.assert_array_equal(pbcs[m], atoms.pbc)
        np.testing.assert_array_equal(cells[m], atoms.cell.array)
        np.testing.assert_allclose(store.stress()[m], atoms.get_stress(voigt=False))
    assert {tuple(p) for p in pbcs.tolist()} == {(True,) * 3, (True, True, False), (False,) * 3}


def test_molecule_stores_open_without_cells(qm9_store):
    store = MoleculeStore(qm9_store)
    with h5py.File(qm9_store) as f:
        assert "cell" not in f and "pbc" not in f
    cells, pbc = store.cells()
    assert not store.periodic and not store.has_stress and not pbc.any() and not cells.any()
    with pytest.raises(StoreError, match="no stress"):
        store.stress()


def test_streaming_writer_stores_cells(tmp_path):
    cell = np.stack([np.eye(3) * 4, np.eye(3) * 5])
    writer = StoreWriter(
        tmp_path / "w.h5", np.array([2, 1]), {"e": "eV"}, "k", periodic=True, stress_unit="u"
    )
    with pytest.raises(StoreError, match="stress"):  # the store takes stress: it must be given
        writer.append([1, 1, 8], np.zeros((3, 3)), {"e": np.ones(2)}, [0, 1], cell, [[1] * 3] * 2)
    stress = np.arange(18.0).reshape(2, 3, 3)
    writer.append(
        [1, 1, 8], np.zeros((3, 3)), {"e": np.ones(2)}, [0, 1], cell, [[1] * 3] * 2, stress
    )
    store = MoleculeStore(writer.finish())
    np.testing.assert_array_equal(store.cells()[0], cell)
    np.testing.assert_array_equal(store.stress(), stress)


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda a: a.set_cell([[3, 0, 0], [0, 3, 0], [3, 3, 0]]), "singular cell"),
        (lambda a: a.cell.__setitem__((1, 1), np.nan), "non-finite"),
        (lambda a: a.set_cell([[3, 0, 0], [0, 3, 0], [0, 0, 0]]), "along a zero cell vector"),
    ],
    ids=["singular", "nan", "pbc_without_cell"],
)
def test_import_names_file_and_frame_of_a_bad_cell(tmp_path, change, problem):
    frames = [make_emt_bulk.labelled(a) for a in (triclinic(True), triclinic(True, seed=1))]
    change(frames[1])
    path = tmp_path / "bad.extxyz"
    ase.io.write(path, frames, format="extxyz")
    out = tmp_path / "bad.h5"
    with pytest.raises(StoreError, match=rf"{path}, frame 1: .*{problem}"):
        import_ase([path], out, progress=False)
    assert not out.exists()


def test_pairs_file_is_kept_and_rebuilt_when_stale(tmp_path, emt_store):
    store = MoleculeStore(emt_store)
    built = periodic_pairs(store, CUTOFF, progress=False)
    assert isinstance(built, PeriodicPairs)
    np.testing.assert_array_equal(edge_counts(store, CUTOFF), 2 * built.counts)  # via radius
    path = periodic_pairs_path(store, CUTOFF)
    stamp = path.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a valid file loads without a warning
        loaded = periodic_pairs(store, CUTOFF)
    assert path.stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(loaded.shift, built.shift)
    with np.load(path) as saved:  # one shift flipped: the checksum no longer matches
        damaged = dict(saved)
    damaged["shift"] = damaged["shift"].copy()
    damaged["shift"][0, 0] += 1
    np.savez(path, **damaged)
    with pytest.warns(UserWarning, match="checksum"):
        rebuilt = periodic_pairs(store, CUTOFF)
    np.testing.assert_array_equal(rebuilt.shift, built.shift)
    for m in (0, 1, 2, len(store) - 1):  # every frame's pairs are ASE's
        atoms = Atoms(*store.molecule(m)[:1], positions=store.molecule(m)[1])
        atoms.numbers = store.molecule(m)[0]
        atoms.cell, atoms.pbc = store.cells()[0][m], store.cells()[1][m]
        lo, hi = built.offsets[m], built.offsets[m + 1]
        pairs = full_list(built.i[lo:hi], built.j[lo:hi], built.shift[lo:hi])
        assert pairs == ase_list(atoms, CUTOFF)


def periodic_dataset(store: MoleculeStore) -> PackedDataset:
    nodes, edges = store.num_atoms, edge_counts(store, CUTOFF)
    plan = plan_packing(nodes, edges, "tuple", target_efficiency=0.8)
    layout = Layout.from_plan(plan, 3, CUTOFF)
    return PackedDataset(
        store, np.arange(len(store)), store.target("energy"), plan, layout, 0, edges
    )


def test_compiled_loop_and_torch_program_write_the_same_periodic_bytes(emt_store):
    data = periodic_dataset(MoleculeStore(emt_store))
    batches = {}
    for compiled in (True, False):
        data.compiled = compiled
        batches[compiled] = epoch_batches(PackedLoader(data, chunk_batches=2), 1)
    assert len(batches[True]) > 2
    assert all(None not in (b.edge_shift, b.cell, b.stress) for b in batches[True])
    assert any(b.edge_shift.abs().sum() > 0 for b in batches[True])
    assert_same_batches(batches[True], batches[False])


def edge_vectors(batch: Batch) -> torch.Tensor:
    """pos[receiver] - pos[source] + shift @ cell [E, 3] (the batch's convention)."""
    source, receiver = batch.edge_index
    cell = torch.cat([batch.cell, batch.cell.new_zeros(1, 3, 3)])[batch.graph[receiver]]
    offset = (batch.edge_shift.to(cell.dtype).unsqueeze(-1) * cell).sum(1)
    return batch.pos[receiver] - batch.pos[source] + offset


def test_periodic_batches_hold_each_pair_both_ways(emt_store):
    store = MoleculeStore(emt_store)
    cells, stress = store.cells()[0].astype(np.float32), store.stress().astype(np.float32)
    for batch in epoch_batches(PackedLoader(periodic_dataset(store)), 0):
        half = batch.edge_index.shape[1] // 2
        vectors = edge_vectors(batch)
        torch.testing.assert_close(vectors[half:], -vectors[:half], rtol=0, atol=0)
        real = batch.edge_mask
        assert torch.all(vectors[real].norm(dim=1) <= CUTOFF + 1e-4)
        assert torch.all(batch.edge_shift[~real] == 0)
        real_slots = batch.graph_mask
        index = batch.molecule_index[real_slots]
        np.testing.assert_array_equal(batch.cell[real_slots].numpy(), cells[index])
        np.testing.assert_array_equal(batch.stress[real_slots].numpy(), stress[index])
        assert not batch.cell[~real_slots].any() and not batch.stress[~real_slots].any()


def test_qm9_batches_have_no_periodic_fields(qm9_store):
    store = MoleculeStore(qm9_store)
    nodes, edges = store.num_atoms, edge_counts(store, CUTOFF)
    plan = plan_packing(nodes, edges, "tuple", target_efficiency=0.9)
    layout = Layout.from_plan(plan, 2, CUTOFF)
    data = PackedDataset(store, np.arange(len(store)), store.target("U0"), plan, layout, 0, edges)
    batch = data[0, 0]
    assert batch.edge_shift is None and batch.cell is None
    assert batch.present_fields() == (
        "z", "pos", "graph", "node_mask", "y", "graph_mask", "molecule_index", "edge_index",
        "edge_mask",
    )  # fmt: skip
    assert layout.batch_bytes() == layout.batch_bytes(periodic=False)


# --- the model's exact identities (float64, untrained) ---------------------------------------


def as_float32(atoms: Atoms) -> Atoms:
    """``atoms`` with positions and cell rounded to float32 values (the batch's dtype), so the
    float64 batch below holds exactly the frame's geometry."""
    atoms = atoms.copy()
    atoms.set_cell(atoms.cell.array.astype(np.float32).astype(np.float64))
    atoms.positions = atoms.positions.astype(np.float32).astype(np.float64)
    return atoms


def batch_of(atoms: Atoms) -> Batch:
    """A float64 batch of one periodic frame (one pack, one padding atom)."""
    atoms = as_float32(atoms)
    molecule = PackMolecule(
        atoms.numbers, atoms.positions.astype(np.float32), 0.0, 0, cell=atoms.cell.array,
        pbc=atoms.pbc,
    )  # fmt: skip
    pairs = len(frame_pairs(atoms.positions, atoms.cell.array, atoms.pbc, CUTOFF)[0])
    layout = Layout(1, len(atoms) + 1, 1, max_edges=2 * pairs + 2, cutoff=CUTOFF)
    batch = collate([[molecule]], layout)
    return dataclasses.replace(batch, pos=batch.pos.double(), cell=batch.cell.double())


@pytest.fixture(params=["torch", "ipu"])
def model(request) -> SchNet:
    torch.manual_seed(0)
    net = SchNet(16, 16, 2, 20, CUTOFF, graph="radius", ops=request.param, mean=-3.0, std=0.5)
    return net.double()


def energy(model: SchNet, atoms: Atoms) -> float:
    return float(model(batch_of(atoms))[0].detach())


@pytest.mark.parametrize("pair_symmetric", [True, False])
def test_energy_per_atom_of_a_small_cell_and_its_supercell(model, pair_symmetric):
    model.pair_symmetric = pair_symmetric
    cell = triclinic(True)  # edges of ~2.5 A, shorter than the 5 A cutoff
    supercell = cell.repeat((2, 2, 2))
    per_atom, super_per_atom = energy(model, cell) / 2, energy(model, supercell) / 16
    assert abs(per_atom - super_per_atom) < 1e-6  # float32 positions; the target is 1e-5
    other = cell.copy()
    other.positions[0] += [0.2, 0.0, 0.0]  # the test can fail: another geometry differs
    assert abs(energy(model, other) / 2 - per_atom) > 1e-4


@pytest.mark.parametrize("pbc", [(True, True, True), (True, True, False)], ids=["bulk", "slab"])
def test_energy_is_unchanged_by_translation_with_wrapping(model, pbc):
    atoms = triclinic(pbc, repeat=(2, 2, 1))
    moved = atoms.copy()
    moved.translate([1.3, -2.2, 0.0 if not pbc[2] else 0.7])
    moved.wrap()
    assert not np.allclose(moved.positions, atoms.positions)
    # within float32 rounding of the wrapped positions: 1e-6 eV per atom
    assert energy(model, moved) == pytest.approx(energy(model, atoms), rel=0, abs=1e-6 * len(atoms))


def test_energy_is_unchanged_by_rotating_atoms_and_cell(model):
    atoms = triclinic(True, repeat=(2, 2, 1))
    rotated = atoms.copy()
    rotated.rotate(37.0, (1.0, 2.0, 0.5), rotate_cell=True)
    assert energy(model, rotated) == pytest.approx(
        energy(model, atoms), rel=0, abs=1e-6 * len(atoms)
    )


@pytest.mark.parametrize("pbc", [(True, True, True), (True, True, False)], ids=["bulk", "slab"])
def test_stress_is_the_strain_derivative_of_the_energy(model, pbc):
    atoms = as_float32(triclinic(pbc, repeat=(2, 2, 1)))
    _, forces, stress = energy_response(model, batch_of(atoms), stress=True, create_graph=False)
    volume, step = atoms.get_volume(), 1e-5
    numeric = np.zeros((3, 3))
    for a, b in itertools.product(range(3), repeat=2):
        energies = []
        for sign in (1.0, -1.0):
            strain = np.zeros((3, 3))
            strain[a, b] += sign * step / 2
            strain[b, a] += sign * step / 2
            deformed = atoms.copy()
            deformed.set_cell(atoms.cell.array @ (np.eye(3) + strain), scale_atoms=True)
            energies.append(float(model(batch_of_exact(deformed))[0].detach()))
        numeric[a, b] = (energies[0] - energies[1]) / (2 * step * volume)
    error = np.abs(stress[0].detach().numpy() - numeric).max()
    assert error <= 0.01 * np.abs(numeric).max()
    assert torch.all(forces[len(atoms) :] == 0)  # the padding atom


def batch_of_exact(atoms: Atoms) -> Batch:
    """:func:`batch_of` without rounding the geometry to float32 (a strain of 1e-5 is
    below float32's resolution of a position): the pairs come from the rounded frame, the
    float64 positions and cell from ``atoms`` itself."""
    batch = batch_of(atoms)
    pos = batch.pos.clone()
    pos[: len(atoms)] = torch.from_numpy(atoms.positions)
    return dataclasses.replace(batch, pos=pos, cell=torch.from_numpy(atoms.cell.array)[None])


def test_the_ipu_flavour_runs_periodic_batches_with_ops_poptorch_lowers():
    torch.manual_seed(0)
    net = SchNet(16, 16, 2, 20, CUTOFF, graph="radius", ops="ipu")
    batch = batch_of(triclinic(True, repeat=(2, 1, 1)))
    batch = dataclasses.replace(batch, pos=batch.pos.float(), cell=batch.cell.float())
    energy = check_poptorch_ops(lambda: net(batch).sum())
    assert torch.isfinite(energy)


def test_pairs_are_put_in_canonical_form_whatever_order_vesin_gives():
    """vesin 0.6's half list is already canonical; the pairs file must not depend on it."""
    from schnet_ipu.data.periodic_pairs import _canonical

    atoms = triclinic(True, repeat=(2, 1, 1))
    i, j, shift = frame_pairs(atoms.positions, atoms.cell.array, atoms.pbc, CUTOFF)
    reverse = np.arange(len(i)) % 2 == 0  # every other pair given as (j, i, -S)
    given_i, given_j = np.where(reverse, j, i), np.where(reverse, i, j)
    given_shift = np.where(reverse[:, None], -shift.astype(np.int32), shift)
    frame = np.zeros(len(i), dtype=np.int64)
    again = _canonical(given_i, given_j, given_shift, frame, CUTOFF)
    for ours, expected in zip(again, (i, j, shift)):
        np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("pair_symmetric", [True, False])
def test_stacked_periodic_batches_give_each_batchs_energies(model, pair_symmetric):
    from schnet_ipu.batch import stack_batches

    model.pair_symmetric = pair_symmetric  # False: the reversed half's shifts are read too

    batches = [batch_of(triclinic(True, seed=0)), batch_of(triclinic((True, True, False), seed=1))]
    stacked = stack_batches(batches)
    assert stacked.edge_shift is not None and stacked.cell is not None
    expected = torch.cat([model(b) for b in batches])
    torch.testing.assert_close(model(stacked), expected, rtol=0, atol=1e-12)
