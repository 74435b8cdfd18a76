"""A trained model is a file: model specs in checkpoints, the portable model, TorchScript
export, ensembles, float64, and the errors of each (real QM9 rows, tiny models)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
from ase import Atoms

from schnet_ipu.config import ConfigError, ModelConfig, load_config
from schnet_ipu.data import MoleculeStore, import_qm9
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.errors import CheckpointError
from schnet_ipu.feed.collate import PackMolecule, collate
from schnet_ipu.feed.layout import Layout
from schnet_ipu.inference.calculator import SchNetCalculator
from schnet_ipu.inference.export import export_model
from schnet_ipu.inference.model_file import ModelSpec, TrainedModel, load_trained
from schnet_ipu.inference.portable import PortableSchNet
from schnet_ipu.inference.predictor import Predictor
from schnet_ipu.response import energy_response
from schnet_ipu.task import EnergyTask, TargetTransform
from schnet_ipu.training.loop import train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qm9") / "qm9_300.h5"
    import_qm9(path, limit=300, progress=False)
    return path


def run_config(store: Path, run_dir: Path, seed: int):
    return load_config(
        None,
        [
            f"seed={seed}",
            f"data.path={store}",
            "data.val=40",
            "data.test=40",
            "model.hidden_channels=16",
            "model.num_filters=16",
            "model.num_interactions=2",
            "model.num_gaussians=8",
            "packing.packs_per_batch=4",
            "optim.epochs=2",
            "optim.schedule=constant",
            "optim.beat_baseline=false",  # a smoke run, too short to learn
            "logging.progress=false",
            "logging.plot=false",
            f"logging.run_dir={run_dir}",
            "backend.device=cpu",
        ],
    )


@pytest.fixture(scope="module")
def runs(store, tmp_path_factory) -> list[Path]:
    """Two tiny QM9 runs that differ only in their seed (an ensemble of two)."""
    root = tmp_path_factory.mktemp("runs")
    for seed in (0, 1):
        train(run_config(store, root / f"seed{seed}", seed))
    return [root / "seed0", root / "seed1"]


def qm9_molecules(store: Path, count: int, first: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    opened = MoleculeStore(store)
    return [opened.molecule(i) for i in range(first, first + count)]


# --- the portable model is the trained model ----------------------------------------------


def random_trained(
    graph: str, readout: str, max_nodes: int, filter_kind: str = "exact"
) -> TrainedModel:
    """A model with random weights (atom references too) and the spec that describes it."""
    reference = np.zeros(119)
    reference[[1, 6, 7, 8, 9]] = [-13.6, -1029.8, -1485.3, -2042.6, -2713.5]
    arch = ModelConfig(
        hidden_channels=16, num_filters=12, num_interactions=2, num_gaussians=10, cutoff=5.0,
        graph=graph, k=6, readout=readout,
        filter=filter_kind, filter_points=64,
    )  # fmt: skip
    spec = ModelSpec(
        model=dataclasses.asdict(arch),
        max_nodes_per_pack=max_nodes,
        mean=0.3,
        std=1.7,
        task=EnergyTask(TargetTransform(tuple(reference), 2.0)).to_dict(),
        unit="eV",
        forces_unit="eV/Angstrom",
        target="U0",
        pack={"max_nodes": max_nodes, "max_graphs": 1, "max_edges": None, "packs_per_batch": 6},
        elements=[1, 6, 7, 8, 9],
    )
    torch.manual_seed(3)
    model = spec.build_model()
    torch.nn.init.normal_(model.atomref.weight, std=0.5)
    return TrainedModel(model.eval(), spec, Path("memory"), {})


@pytest.mark.parametrize(
    "graph,readout,filter_kind",
    [("radius", "sum", "exact"), ("knn", "sum", "exact"), ("radius", "mean", "exact"),
     ("radius", "sum", "table"), ("knn", "mean", "table")],
)  # fmt: skip
def test_portable_model_equals_the_packed_model_in_float64(store, graph, readout, filter_kind):
    """Energies and forces of each molecule alone (no packs, own neighbour search) equal the
    packed training model's on a batch of real QM9 molecules with padding; with the table
    filter the portable model's backward is the written-out one (no autograd), the packed
    model's autograd's, over the same table."""
    molecules = qm9_molecules(store, 6, first=40)
    max_nodes = max(len(z) for z, _ in molecules) + 2  # padding atoms in every pack
    trained = random_trained(graph, readout, max_nodes, filter_kind)
    cutoff = trained.spec.cutoff
    edges = [2 * len(molecule_pairs(pos, cutoff)[0]) for _, pos in molecules]
    layout = Layout(
        packs_per_batch=len(molecules) + 1,  # and one all-padding pack
        max_nodes=max_nodes,
        max_graphs=1,
        max_edges=max(edges) + 4 if graph == "radius" else None,
        cutoff=cutoff if graph == "radius" else None,
    )
    batch = collate(
        [[PackMolecule(z, pos, 0.0, i)] for i, (z, pos) in enumerate(molecules)], layout
    )
    batch = dataclasses.replace(batch, pos=batch.pos.double())
    packed = trained.model.double()
    energy, forces, _ = energy_response(packed, batch)
    portable = PortableSchNet.from_trained(trained, torch.float64)
    reference = np.asarray(trained.spec.transform.atom_reference)
    for p, (z, pos) in enumerate(molecules):
        e, f = portable(
            torch.as_tensor(z.astype(np.int64)), torch.as_tensor(pos, dtype=torch.float64)
        )
        expected = energy[p].item() + reference[z].sum()
        assert abs(e.item() - expected) < 1e-9 * max(1.0, abs(expected))
        rows = forces[p * max_nodes : p * max_nodes + len(z)].detach()
        torch.testing.assert_close(f, rows, rtol=1e-9, atol=1e-10)


def test_float64_forces_are_the_energy_derivatives(store):
    trained = random_trained("radius", "sum", 32)
    predictor_module = PortableSchNet.from_trained(trained, torch.float64)
    z, pos = qm9_molecules(store, 1, first=7)[0]
    z_t, pos64 = torch.as_tensor(z.astype(np.int64)), torch.as_tensor(pos, dtype=torch.float64)
    _, forces = predictor_module(z_t, pos64)
    h = 1e-5
    for atom, axis in [(0, 0), (1, 1), (len(z) - 1, 2)]:
        moved = [pos64.clone(), pos64.clone()]
        moved[0][atom, axis] += h
        moved[1][atom, axis] -= h
        plus, minus = (predictor_module(z_t, m)[0].item() for m in moved)
        assert abs(-(plus - minus) / (2 * h) - forces[atom, axis].item()) < 1e-6


# --- model files: best.pt alone, ensembles, export ------------------------------------------


def test_checkpoint_alone_predicts_without_store_or_run_folder(runs, store, tmp_path):
    """best.pt copied to an empty folder, the store moved away: the calculator and
    ``predict --model`` give the energies of the intact run folder; those equal the packed
    model's test predictions (evaluate) read from the store."""
    run = runs[0]
    molecules = qm9_molecules(store, 5, first=250)
    frames = [Atoms(numbers=z, positions=pos) for z, pos in molecules]
    with_run = [Predictor(run).predict(z, pos).energy for z, pos in molecules]
    source, out = tmp_path / "in.extxyz", tmp_path / "out.extxyz"
    ase.io.write(source, frames, format="extxyz")

    alone = tmp_path / "laptop" / "model.pt"
    alone.parent.mkdir()
    shutil.copy(run / "checkpoints/best.pt", alone)
    hidden = store.with_name("elsewhere.h5")
    store.rename(hidden)
    try:
        calc = SchNetCalculator(alone, dtype=torch.float32)
        for frame, expected in zip(frames, with_run):
            frame.calc = calc
            assert abs(frame.get_potential_energy() - expected) <= 1e-6
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), "predict", "--model", str(alone),
             "--input", str(source), "--out", str(out)],
            capture_output=True, text=True, cwd=tmp_path, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        written = ase.io.read(out, index=":")
        for got, expected in zip(written, with_run):
            assert abs(got.get_potential_energy() - expected) <= 1e-6
    finally:
        hidden.rename(store)


def test_portable_energies_equal_the_packed_test_predictions(runs, store, tmp_path):
    """The calculator's energy of a test molecule equals the trained packed model's
    prediction for it (train.py predict on the store's test split), targets in eV."""
    from schnet_ipu.training.finished_runs import predict_split

    out = tmp_path / "test.csv"
    predict_split(runs[0], "test", out)
    rows = np.genfromtxt(out, delimiter=",", names=True, dtype=None, encoding=None)
    predictor = Predictor(runs[0], dtype=torch.float64)
    opened = MoleculeStore(store)
    for row in rows[:8]:
        z, pos = opened.molecule(int(row["index"]))
        got = predictor.predict(z, pos).energy
        assert abs(got - float(row["prediction"])) < 2e-4 + 1e-6 * abs(got)  # float32 packed


def test_ensemble_mean_and_spread_are_the_members(runs, store):
    molecules = qm9_molecules(store, 3, first=260)
    members = [Predictor(run, dtype=torch.float64) for run in runs]
    ensemble = Predictor(runs, dtype=torch.float64)
    calc = SchNetCalculator(runs)
    for z, pos in molecules:
        single = [m.predict(z, pos) for m in members]
        both = ensemble.predict(z, pos)
        energies = np.array([s.energy for s in single])
        forces = np.stack([s.forces for s in single])
        assert both.energy == pytest.approx(energies.mean(), abs=1e-9)
        assert both.energy_std == pytest.approx(energies.std(), abs=1e-9)
        assert both.energy_std > 1e-4  # two seeds: different models
        np.testing.assert_allclose(both.forces, forces.mean(0), atol=1e-9)
        np.testing.assert_allclose(both.forces_std, forces.std(0), atol=1e-9)
        atoms = Atoms(numbers=z, positions=pos)
        atoms.calc = calc
        assert atoms.get_potential_energy() == pytest.approx(both.energy, abs=1e-9)
        assert calc.results["energy_std"] == pytest.approx(both.energy_std, abs=1e-9)
        np.testing.assert_allclose(calc.results["forces_std"], both.forces_std, atol=1e-9)


EXPORT_CHECK = """
import json, sys
import torch
model = torch.jit.load(sys.argv[1])
cases = json.loads(sys.argv[2])
out = []
for z, pos in cases:
    energy, forces = model(torch.tensor(z), torch.tensor(pos, dtype=torch.float32))
    out.append([energy.item(), forces.tolist()])
leaked = [m for m in sys.modules if m.startswith("schnet_ipu")]
print(json.dumps({"results": out, "leaked": leaked}))
"""


def test_export_loads_in_plain_torch_and_equals_the_calculator(runs, store, tmp_path):
    """The exported file, loaded by a process that never imports schnet_ipu, gives the
    calculator's energies and forces on 5- to 40-atom structures (sizes it never saw)."""
    out = tmp_path / "model.torchscript.pt"
    meta = export_model(runs[0], out)
    known = set(meta["elements"])
    assert {1, 6, 8} <= known <= {1, 6, 7, 8, 9}
    opened = MoleculeStore(store)
    sizes = {
        int(n): i
        for i, n in enumerate(opened.num_atoms)
        if set(opened.molecule(i)[0].tolist()) <= known
    }
    cases = [opened.molecule(sizes[n]) for n in sorted(sizes) if n >= 5][::3]
    parts = [opened.molecule(sizes[n]) for n in sorted(sizes)[-3:]]  # 40 atoms of three
    joined_z = np.concatenate([z for z, _ in parts])[:40]  # molecules, far apart
    joined_pos = np.concatenate([pos + 30.0 * i for i, (_, pos) in enumerate(parts)])[:40]
    cases.append((joined_z, joined_pos))
    assert {len(z) for z, _ in cases} >= {5, 40}
    payload = json.dumps([[z.astype(int).tolist(), pos.tolist()] for z, pos in cases])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", EXPORT_CHECK, str(out), payload],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["leaked"] == []
    calc = SchNetCalculator(runs[0], dtype=torch.float32)
    for (z, pos), (energy, forces) in zip(cases, report["results"]):
        atoms = Atoms(numbers=z, positions=pos)
        atoms.calc = calc
        assert abs(energy - atoms.get_potential_energy()) <= 1e-4
        np.testing.assert_allclose(forces, atoms.get_forces(), atol=1e-3)


# --- errors ---------------------------------------------------------------------------------


def test_unseen_element_is_named(runs):
    atoms = Atoms("CSi", positions=[[0, 0, 0], [1.8, 0, 0]])
    atoms.calc = SchNetCalculator(runs[0])
    with pytest.raises(ConfigError, match=r"element\(s\) 14 never seen in training"):
        atoms.get_potential_energy()


def test_checkpoint_without_spec_is_refused_in_one_line(runs, tmp_path):
    state = torch.load(runs[0] / "checkpoints/best.pt", weights_only=True)
    del state["model_spec"]  # as written before model files
    old = tmp_path / "old.pt"
    torch.save(state, old)
    with pytest.raises(
        CheckpointError, match=r"old\.pt predates self-contained model files"
    ) as err:
        load_trained(old)
    assert "\n" not in str(err.value) and "retrain" in str(err.value)


def test_spec_written_before_tabulated_filters_loads_as_exact(runs, tmp_path):
    state = torch.load(runs[0] / "checkpoints/best.pt", weights_only=True)
    del state["model_spec"]["model"]["filter"]  # as written before model.filter existed
    old = tmp_path / "old.pt"
    torch.save(state, old)
    rebuilt = load_trained(old)
    assert rebuilt.model.filter == "exact" and load_trained(runs[0]).model.filter == "table"
    expected = load_trained(runs[0]).model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(rebuilt.model.state_dict()[name], value)
