"""Partial labels (issue 43): frames without stress or forces are imported and kept, their
masks travel through the packed batches, and the loss and the metrics count only the frames
that carry each label; a weight on a label no training frame carries, and knn graphs on a
periodic store, are one-line refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
from ase.calculators.singlepoint import SinglePointCalculator

from schnet_ipu.batch import stack_batches
from schnet_ipu.config import ConfigError
from schnet_ipu.data import MoleculeStore, import_ase
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.inference.predictor import predict_file
from schnet_ipu.model import SchNet
from schnet_ipu.response import energy_response
from schnet_ipu.task import EnergyForceTask, TargetTransform
from schnet_ipu.training.data import prepare_data
from schnet_ipu.training.evaluation import (
    ErrorSums,
    error_sums,
    metrics_from_sums,
    predictions,
)
from schnet_ipu.training.finished_runs import HostModel, evaluate_run, predict_split
from schnet_ipu.training.log import read_records
from schnet_ipu.training.loop import train
from schnet_ipu.training.setup import force_rms, make_task
from tests.feed.test_periodic import make_emt_bulk, periodic_dataset
from tests.helpers import assert_same_batches, epoch_batches
from tests.training.test_forces import emt_frames
from tests.training.test_periodic_training import bulk_config

pytestmark = pytest.mark.usefixtures("restore_threads")


def mixed_frames() -> list:
    """EMT bulk and vacancy cells with stress, slabs without it (all with forces); clusters
    with forces, and clusters with an energy only."""
    periodic = make_emt_bulk.make_frames(15, 0.03, 0.05, seed=3, slab_stress=False)
    with_forces = emt_frames(6, seed=4)
    energy_only = emt_frames(6, seed=5)
    for atoms in energy_only:
        atoms.calc = SinglePointCalculator(atoms, energy=atoms.get_potential_energy())
    return [*periodic, *with_forces, *energy_only]


def carries(atoms, label: str) -> bool:
    return label in atoms.calc.results


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("partial") / "mixed.extxyz"
    ase.io.write(path, mixed_frames(), format="extxyz")
    return path


@pytest.fixture(scope="module")
def mixed_store(mixed_file) -> Path:
    return import_ase([mixed_file], mixed_file.with_suffix(".h5"), progress=False)


def test_import_keeps_frames_with_partial_labels(mixed_file, mixed_store):
    frames = ase.io.read(mixed_file, index=":")
    store = MoleculeStore(mixed_store)
    assert store.attrs["schema_version"] == 2 and store.partial_labels == ("forces", "stress")
    has_forces = [carries(a, "forces") for a in frames]
    has_stress = [carries(a, "stress") for a in frames]
    assert 0 < sum(has_stress) < sum(a.pbc.any() for a in frames) < len(frames)
    assert 0 < sum(has_forces) < len(frames)
    np.testing.assert_array_equal(store.forces_mask(), has_forces)
    np.testing.assert_array_equal(store.stress_mask(), has_stress)
    forces, stress = store.forces(), store.stress()
    for m, atoms in enumerate(frames):
        own = forces[store.offsets[m] : store.offsets[m + 1]]
        expected = atoms.get_forces() if has_forces[m] else np.zeros((len(atoms), 3))
        np.testing.assert_allclose(own, expected, rtol=1e-6, atol=1e-6)
        expected = atoms.get_stress(voigt=False) if has_stress[m] else np.zeros((3, 3))
        np.testing.assert_allclose(stress[m], expected)


def test_stores_without_partial_labels_stay_version_1(tmp_path, qm9_store):
    frames = make_emt_bulk.make_frames(6, 0.03, 0.05, seed=3)  # slabs with stress
    path = tmp_path / "full.extxyz"
    ase.io.write(path, frames, format="extxyz")
    store = MoleculeStore(import_ase([path], tmp_path / "full.h5", progress=False))
    assert store.attrs["schema_version"] == 1 and store.partial_labels == ()
    assert store.forces_mask().all()
    np.testing.assert_array_equal(store.stress_mask(), [a.pbc.any() for a in frames])
    old = MoleculeStore(qm9_store)  # a version-1 molecule store: no forces, no stress
    assert not old.forces_mask().any() and not old.stress_mask().any()


def test_masks_travel_through_packed_batches(mixed_store):
    store = MoleculeStore(mixed_store)
    data = periodic_dataset(store)
    batches = {}
    for compiled in (True, False):
        data.compiled = compiled
        batches[compiled] = epoch_batches(PackedLoader(data, chunk_batches=2), 0)
    assert_same_batches(batches[True], batches[False])
    seen = 0
    for batch in batches[True]:
        real = batch.graph_mask
        index = batch.molecule_index[real].numpy()
        for name, mask in [
            ("forces_mask", store.forces_mask()),
            ("stress_mask", store.stress_mask()),
        ]:
            carried = getattr(batch, name)
            assert carried.shape == batch.graph_mask.shape and carried.dtype == torch.bool
            np.testing.assert_array_equal(carried[real].numpy(), mask[index])
            assert not carried[~real].any()  # padding slots carry nothing
        seen += len(index)
    assert seen == len(store)


def float64(batch):
    return dataclasses.replace(
        batch,
        pos=batch.pos.double(),
        cell=batch.cell.double(),
        y=batch.y.double(),
        forces=batch.forces.double(),
        stress=batch.stress.double(),
    )


def test_loss_is_the_masked_loss_by_hand(mixed_store):
    """Every frame in one batch; the expected loss sums over frames as the store marks them."""
    store = MoleculeStore(mixed_store)
    batch = float64(stack_batches(epoch_batches(PackedLoader(periodic_dataset(store)), 0)))
    torch.manual_seed(0)
    model = SchNet(8, 8, 1, 6, 5.0, graph="radius", ops="torch", mean=-3.0, std=0.5).double()
    task = EnergyForceTask(TargetTransform((0.0,) * 119, 2.0), 0.7, 1.5, 0.02, 3.0)
    loss = float(task.loss(model, batch).detach())

    energy, forces, stress = energy_response(model, batch, stress=True, create_graph=False)
    true_forces, true_stress = store.forces(), store.stress()
    targets = store.target("energy")
    sums = dict.fromkeys(["energy", "molecules", "forces", "components", "stress", "entries"], 0.0)
    for slot in torch.nonzero(batch.graph_mask).flatten().tolist():
        m = int(batch.molecule_index[slot])
        sums["energy"] += ((float(energy[slot]) - targets[m]) / 2.0) ** 2
        sums["molecules"] += 1
        if store.forces_mask()[m]:
            own = true_forces[store.offsets[m] : store.offsets[m + 1]]
            error = forces[batch.graph == slot].detach().numpy() - own
            sums["forces"] += float(np.square(error).sum())
            sums["components"] += own.size
        if store.stress_mask()[m]:
            sums["stress"] += float(np.square(stress[slot].detach().numpy() - true_stress[m]).sum())
            sums["entries"] += 9
    assert 0 < sums["components"] < 3 * int(batch.node_mask.sum())
    assert 0 < sums["entries"] < 9 * int(batch.graph_mask.sum())
    expected = (
        sums["energy"] / sums["molecules"]
        + 1.5 * sums["forces"] / (sums["components"] * 0.7**2)
        + 3.0 * sums["stress"] / (sums["entries"] * 0.02**2)
    )
    assert loss == pytest.approx(expected, rel=1e-5)


def test_validation_loss_is_the_training_objective(mixed_store):
    """Evaluation's ``loss`` (the divergence guard's yardstick) is the training loss on the
    same frames, force and stress terms included, not the energy term alone."""
    store = MoleculeStore(mixed_store)
    loader = PackedLoader(periodic_dataset(store))
    torch.manual_seed(0)
    per_atom = float(np.mean(store.target("energy") / store.num_atoms))
    model = SchNet(8, 8, 1, 6, 5.0, graph="radius", ops="torch", mean=per_atom, std=0.5)
    task = EnergyForceTask(TargetTransform((0.0,) * 119, 2.0), 0.7, 100.0, 0.02, 100.0)
    training = float(task.loss(model, stack_batches(epoch_batches(loader, 0))))
    sums = error_sums(task, predictions(task, HostModel(model, torch.device("cpu")), loader))
    loss = metrics_from_sums(task, sums, "val")["loss"]
    energy_only = EnergyForceTask(TargetTransform((0.0,) * 119, 2.0), 0.7, 0.0, 0.02, 0.0)
    energy_term = metrics_from_sums(energy_only, sums, "val")["loss"]
    assert loss == pytest.approx(training, rel=1e-5)
    assert loss > 1.5 * energy_term > 0  # the force and stress terms count


def test_metrics_count_the_frames_that_carry_each_label(mixed_store):
    store = MoleculeStore(mixed_store)
    torch.manual_seed(0)
    model = SchNet(8, 8, 1, 6, 5.0, graph="radius", ops="torch")
    task = EnergyForceTask(TargetTransform((0.0,) * 119, 2.0), 0.7, 1.0, 0.02, 1.0)
    parts = predictions(
        task, HostModel(model, torch.device("cpu")), PackedLoader(periodic_dataset(store))
    )
    metrics = metrics_from_sums(task, error_sums(task, parts), "test")
    assert metrics["molecules"] == len(store)
    assert metrics["force_frames"] == store.forces_mask().sum() < len(store)
    assert metrics["stress_frames"] == store.stress_mask().sum() < store.cells()[1].any(1).sum()
    assert metrics["force_mae"] > 0 and metrics["stress_mae"] > 0


def test_error_sums_of_shares_add_up_to_the_whole_through_one_tensor(mixed_store):
    """Two replicas' shares of a pass: their named sums added field by field, or as the one
    float64 tensor each would all-reduce, are the sums of the whole pass, metrics alike."""
    store = MoleculeStore(mixed_store)
    torch.manual_seed(0)
    model = SchNet(8, 8, 1, 6, 5.0, graph="radius", ops="torch")
    task = EnergyForceTask(TargetTransform((0.0,) * 119, 2.0), 0.7, 1.0, 0.02, 1.0)
    host = HostModel(model, torch.device("cpu"))
    parts = list(predictions(task, host, PackedLoader(periodic_dataset(store))))
    assert len(parts) >= 2
    first, second = error_sums(task, parts[::2]), error_sums(task, parts[1::2])
    added = first + second
    reduced = ErrorSums.from_tensor(first.as_tensor() + second.as_tensor())
    assert reduced == added and first.as_tensor().dtype == torch.float64
    whole = error_sums(task, parts)
    assert whole.molecules == len(store) == first.molecules + second.molecules
    assert first.force_frames > 0 and second.force_frames > 0
    assert dataclasses.astuple(added) == pytest.approx(dataclasses.astuple(whole), rel=1e-12)
    assert metrics_from_sums(task, added, "val") == pytest.approx(
        metrics_from_sums(task, whole, "val"), rel=1e-12
    )


def test_training_and_evaluation_say_how_many_frames_each_metric_covered(mixed_file, tmp_path):
    cfg = bulk_config(
        mixed_file,
        tmp_path,
        "data.val=6",
        "data.test=10",
        "optim.epochs=1",
        "optim.stress_weight=1.0",
    )
    final = train(cfg)
    data = prepare_data(cfg)
    test = data.split["test"]
    forces, stress = data.store.forces_mask()[test].sum(), data.store.stress_mask()[test].sum()
    assert final["test_force_frames"] == forces and final["test_stress_frames"] == stress
    assert final["test_molecules"] == len(test) > forces
    if stress:
        assert final["test_stress_mae"] > 0 and final["baseline_stress_mae"] > 0
    run = Path(cfg.logging.run_dir)
    [record] = read_records(run / "metrics.jsonl", "epoch")
    assert record["val_force_frames"] == data.store.forces_mask()[data.split["val"]].sum()
    evaluated = evaluate_run(run, "test")
    assert (evaluated["force_frames"], evaluated["stress_frames"]) == (forces, stress)
    assert predict_split(run, "test", tmp_path / "test.csv") == len(test)
    frames = len(ase.io.read(mixed_file, index=":"))
    assert predict_file([run], mixed_file, tmp_path / "predicted.extxyz") == frames
    # the training split's labelled frames alone set the scales
    task = make_task(cfg, data)
    train_split = data.split["train"]
    labelled = train_split[data.store.stress_mask()[train_split]]
    scale = np.sqrt(np.mean(data.store.stress()[labelled] ** 2))
    assert task.stress_scale == pytest.approx(scale)
    store, labelled = data.store, train_split[data.store.forces_mask()[train_split]]
    atoms = np.concatenate([np.arange(store.offsets[m], store.offsets[m + 1]) for m in labelled])
    scale = np.sqrt(np.mean(store.forces()[atoms].astype(np.float64) ** 2))
    assert task.force_scale == pytest.approx(scale)
    assert task.force_scale != pytest.approx(force_rms(store, train_split))  # zeros left out
    data.split["train"] = train_split[~data.store.stress_mask()[train_split]]
    with pytest.raises(ConfigError, match=r"no frame of the training split .* carries stress"):
        make_task(cfg, data)


@pytest.mark.parametrize(
    ("frames", "setting", "message"),
    [
        ("energy_only", "optim.forces_weight=1.0", "holds no forces"),
        ("clusters", "optim.stress_weight=1.0", "holds no stress"),
        ("mixed", "model.graph=knn packing.algorithm=lpfhp", "model.graph=knn ignores cells"),
    ],
)
def test_refusals_are_one_line(frames, setting, message, tmp_path, mixed_file, capsys):
    import train as cli

    path = mixed_file
    if frames != "mixed":
        made = emt_frames(12)
        if frames == "energy_only":
            for atoms in made:
                atoms.calc = SinglePointCalculator(atoms, energy=atoms.get_potential_energy())
        path = tmp_path / f"{frames}.extxyz"
        ase.io.write(path, made, format="extxyz")
    code = cli.main(
        ["--config", str(Path(cli.__file__).parent / "configs/emt_bulk.yaml"),
         f"data.files=[{path}]", f"data.path={tmp_path / 'store.h5'}", "optim.forces_weight=0",
         "data.val=2", "data.test=2", *setting.split(), f"logging.run_dir={tmp_path / 'run'}"]
    )  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
