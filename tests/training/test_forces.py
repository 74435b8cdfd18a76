"""Forces: twice-differentiable ops, ASE import and its errors, energy + force training,
prediction on new structures, the ASE calculator, evaluation pictures (EMT data made here)."""

from __future__ import annotations

import math
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
from ase import Atoms
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from ase.optimize import BFGS

from schnet_ipu.config import ConfigError, load_config
from schnet_ipu.data import MoleculeStore, StoreError, import_ase
from schnet_ipu.data.ase_files import frame_energy, frame_forces
from schnet_ipu.feed.collate import PackMolecule, collate
from schnet_ipu.feed.layout import Layout
from schnet_ipu.model import SchNet
from schnet_ipu.model.ops.torch_ops import (
    _ShiftedSoftplusFused,
    pair_symmetric_conv,
    shifted_softplus,
)
from schnet_ipu.response import atoms_per_molecule, energy_response
from schnet_ipu.task import EnergyForceTask, TargetTransform
from schnet_ipu.training.finished_runs import evaluate_run
from schnet_ipu.training.log import read_records
from schnet_ipu.training.loop import train

ROOT = Path(__file__).resolve().parents[2]


def emt_frames(count: int, seed: int = 0) -> list[Atoms]:
    """``count`` rattled Cu/Au clusters of 4-9 atoms labelled by EMT (single-point results)."""
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(count):
        n = int(rng.integers(4, 10))
        grid = np.array([(i, j, k) for i in range(3) for j in range(3) for k in range(2)])
        pos = 2.55 * grid[rng.permutation(len(grid))[:n]] + rng.normal(0, 0.1, (n, 3))
        atoms = Atoms(list(rng.choice(["Cu", "Au"], size=n)), positions=pos)
        atoms.calc = EMT()
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces)
        frames.append(atoms)
    return frames


@pytest.fixture(scope="module")
def emt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("emt") / "emt.extxyz"
    ase.io.write(path, emt_frames(64), format="extxyz")
    return path


# --- twice-differentiable ops -----------------------------------------------------------


def test_torch_flavour_ops_have_double_backward_in_float64():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    wide = (x * 4).detach().requires_grad_(True)
    assert torch.autograd.gradcheck(shifted_softplus, (wide,))
    assert torch.autograd.gradgradcheck(shifted_softplus, (wide,))
    pairs = torch.tensor([[0, 1, 2, 4, 5], [1, 3, 3, 0, 5]])
    edge_index = torch.cat([pairs, pairs.flip(0)], dim=1)
    filt = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)

    def conv(a, f):
        return pair_symmetric_conv(a, edge_index, f)

    assert torch.autograd.gradcheck(conv, (x, filt))
    assert torch.autograd.gradgradcheck(conv, (x, filt))


def test_fused_softplus_refuses_a_second_derivative():
    x = torch.randn(8, requires_grad=True)
    (grad,) = torch.autograd.grad(_ShiftedSoftplusFused.apply(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


def tiny_model(ops: str, graph: str = "radius") -> SchNet:
    torch.manual_seed(1)
    model = SchNet(
        hidden_channels=6,
        num_filters=5,
        num_interactions=2,
        num_gaussians=7,
        cutoff=4.0,
        graph=graph,
        k=5,
        ops=ops,
        max_nodes_per_pack=12,
    )
    return model.double()


def emt_batch(frames: list[Atoms], radius: bool = True) -> tuple[object, Layout]:
    """Two frames per pack, three packs (the last one empty: all padding), float64."""
    layout = Layout(3, 24, 2, 400 if radius else None, 4.0 if radius else None)
    molecules = [
        PackMolecule(f.numbers, f.positions, f.get_potential_energy(), i, f.get_forces())
        for i, f in enumerate(frames)
    ]
    batch = collate([molecules[0:2], molecules[2:4], []], layout)
    batch.pos = batch.pos.double()
    batch.forces = batch.forces.double()
    batch.y = batch.y.double()
    return batch, layout


def test_atoms_per_molecule_counts_real_atoms_of_each_slot():
    frames = emt_frames(4, seed=3)
    batch, _ = emt_batch(frames)
    want = [len(f) for f in frames] + [0] * (batch.num_graphs - len(frames))  # empty pack: 0
    assert atoms_per_molecule(batch).tolist() == want
    assert atoms_per_molecule(batch).dtype == batch.pos.dtype


def test_training_error_sums_add_up_in_one_buffer_that_reset_zeroes():
    """The epoch's training errors: a sum over steps, zeroed by reset() in place (a captured
    CUDA-graph step keeps adding into the same tensor, so it is never replaced)."""
    batch, layout = emt_batch(emt_frames(4, seed=5))
    model = tiny_model("torch").double()
    model.max_nodes_per_pack = layout.max_nodes
    task = EnergyForceTask(TargetTransform((0.0,) * 119, 1.0), 0.5, 1.0)
    assert task.training_metrics() == {}
    task.loss(model, batch)
    once = task.training_metrics()
    buffer = task._sums
    task.loss(model, batch)
    assert task.training_metrics() == pytest.approx(once)  # the same batch twice: same mean
    task.reset()
    assert task.training_metrics() == {} and task._sums is buffer
    task.loss(model, batch)
    assert task.training_metrics() == pytest.approx(once) and task._sums is buffer
    assert once["force_mae"] > 0 and once["energy_mae_per_atom"] > 0


@pytest.mark.parametrize("graph", ["radius", "knn"])
def test_forces_are_twice_differentiable_through_the_model(graph):
    """gradcheck of pos -> forces is gradgradcheck of the energy through every op on the path."""
    model = tiny_model("torch", graph)
    model.max_nodes_per_pack = 24
    assert forces_pass_gradcheck(model, radius=graph == "radius")


def forces_pass_gradcheck(model: SchNet, radius: bool) -> bool:
    """gradcheck of pos -> forces (float64) on four small EMT clusters."""
    batch, _ = emt_batch(emt_frames(4, seed=2), radius=radius)

    def forces_of(pos):
        batch.pos = pos
        return energy_response(model, batch, create_graph=True).forces

    pos = batch.pos.clone().requires_grad_(True)
    return torch.autograd.gradcheck(forces_of, (pos,), eps=1e-6, atol=1e-5, fast_mode=True)


def test_force_loss_gradients_equal_those_through_plain_ops():
    """The torch flavour's double backward gives the ipu flavour's (autograd's own) gradients
    of a force loss with respect to the parameters."""
    batch, _ = emt_batch(emt_frames(4, seed=3))
    grads = {}
    for ops in ("torch", "ipu"):
        model = tiny_model(ops)
        forces = energy_response(model, batch, create_graph=True).forces
        (forces - batch.forces).square().sum().backward()
        grads[ops] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["torch"].keys() == grads["ipu"].keys()
    assert len(grads["torch"]) > 10
    for name, grad in grads["torch"].items():
        torch.testing.assert_close(grad, grads["ipu"][name], rtol=1e-9, atol=1e-12, msg=name)


def test_padding_is_inert_for_forces():
    frames = emt_frames(4, seed=4)
    batch, layout = emt_batch(frames)
    model = tiny_model("torch")
    energy, forces, _ = energy_response(model, batch)
    assert torch.all(forces[~batch.node_mask] == 0)
    assert torch.all(batch.forces[~batch.node_mask] == 0)
    empty = collate([], layout, with_forces=True)  # an epoch's all-padding tail batch
    assert empty.forces is not None and torch.all(empty.forces == 0)
    # the first frame alone gives the same energy and forces as in company
    alone = collate([[PackMolecule(frames[0].numbers, frames[0].positions, 0.0, 0)]], layout)
    alone.pos = alone.pos.double()
    e1, f1, _ = energy_response(model, alone)
    n = len(frames[0])
    torch.testing.assert_close(e1[0], energy[0])
    torch.testing.assert_close(f1[:n], forces[:n])


# --- ASE import -------------------------------------------------------------------------


def test_ase_import_keeps_energies_forces_and_frame_origin(emt_file, tmp_path):
    frames = ase.io.read(emt_file, index=":")
    store = MoleculeStore(import_ase([emt_file, emt_file], tmp_path / "s.h5", progress=False))
    assert len(store) == 2 * len(frames) and store.has_forces
    assert list(store.attrs["frames_per_file"]) == [len(frames), len(frames)]
    energies = [f.get_potential_energy() for f in frames]
    np.testing.assert_allclose(store.target("energy"), energies * 2)
    forces = np.concatenate([f.get_forces() for f in frames] * 2)
    np.testing.assert_allclose(store.forces(), forces, rtol=1e-6, atol=1e-6)
    z, pos = store.molecule(len(frames) + 3)
    np.testing.assert_array_equal(z, frames[3].numbers)
    np.testing.assert_allclose(pos, frames[3].positions, rtol=1e-6, atol=1e-5)


def test_energy_and_forces_from_info_and_arrays(tmp_path):
    atoms = Atoms("Cu2", positions=[[0, 0, 0], [2.5, 0, 0]])
    atoms.info["my_e"] = -1.5
    atoms.arrays["my_f"] = np.ones((2, 3))
    assert frame_energy(atoms, "my_e", "x") == -1.5
    np.testing.assert_array_equal(frame_forces(atoms, "my_f", "x"), np.ones((2, 3)))
    assert frame_forces(atoms, "forces", "x") is None


def bad_files(tmp_path: Path, emt_file: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, text the one-line error must hold)."""
    frames = ase.io.read(emt_file, index=":4")
    no_energy = [f.copy() for f in frames]  # copies drop the calculator, so the energy
    for f in no_energy:
        f.info["energy"] = 1.0
    del no_energy[2].info["energy"]
    nan = [f.copy() for f in frames]
    nan[1].positions[0, 2] = np.nan
    unknown = [f.copy() for f in frames]
    unknown[3].numbers[0] = 0
    periodic = [f.copy() for f in frames]
    periodic[2].cell, periodic[2].pbc = [[10, 0, 0], [0, 10, 0], [10, 10, 0]], True  # singular
    for f in (*nan, *unknown, *periodic):
        f.info["energy"] = 1.0
    files = {}
    for name, content, frame in [
        ("no_energy", no_energy, 2),
        ("nan", nan, 1),
        ("unknown", unknown, 3),
        ("periodic", periodic, 2),
    ]:
        path = tmp_path / f"{name}.extxyz"
        ase.io.write(path, content, format="extxyz")
        files[name] = (path, f"{path}, frame {frame}")
    garbage = tmp_path / "garbage.extxyz"
    garbage.write_text("this is not\nan extxyz file\n")
    files["unreadable"] = (garbage, str(garbage))
    return files


def test_bad_input_is_one_line_naming_file_and_frame(tmp_path, emt_file, capsys):
    import train as cli

    for name, (path, where) in bad_files(tmp_path, emt_file).items():
        out = tmp_path / f"{name}.h5"
        with pytest.raises(StoreError, match=where.replace(".", r"\.")):
            import_ase([path], out, progress=False)
        assert not out.exists() and not list(tmp_path.glob(f".{name}.h5*")), name
        code = cli.main(
            ["data.source=ase", f"data.files=[{path}]", f"data.path={out}", "data.target=energy",
             "backend.device=cpu", f"logging.run_dir={tmp_path / 'never'}"]
        )  # fmt: skip
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert code == 2 and len(errors) == 1 and errors[0].startswith("error: "), (name, errors)
        assert where in errors[0], (name, errors)
        assert not out.exists()


def test_forces_with_compile_is_a_config_error():
    with pytest.raises(ConfigError, match=r"backend\.compile=false"):
        load_config(None, ["optim.forces_weight=1", "backend.compile=true"])


# --- training, prediction, calculator, pictures -----------------------------------------


@pytest.fixture(scope="module")
def trained(emt_file, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    cfg = load_config(
        ROOT / "configs/emt_forces.yaml",
        [
            f"data.files=[{emt_file}]",
            f"data.path={root / 'emt.h5'}",
            "data.val=8",
            "data.test=8",
            "packing.packs_per_batch=2",
            "packing.max_nodes=20",
            "model.hidden_channels=16",
            "model.num_filters=16",
            "model.num_interactions=1",
            "model.num_gaussians=8",
            "optim.epochs=2",
            "optim.warmup_steps=0",
            "optim.beat_baseline=false",  # a smoke run, too short to learn
            "logging.progress=false",
            f"logging.run_dir={root / 'run'}",
        ],
    )
    train(cfg)
    return root / "run"


def test_force_training_logs_energy_and_force_errors(trained):
    epochs = read_records(trained / "metrics.jsonl", "epoch")
    assert len(epochs) == 2
    for record in epochs:
        for key in ("val_energy_mae_per_atom", "val_force_mae", "train_force_mae"):
            assert math.isfinite(record[key]) and record[key] > 0, key
    [final] = read_records(trained / "metrics.jsonl", "final")
    for key in ("test_energy_mae_per_atom", "test_force_mae", "baseline_force_mae"):
        assert math.isfinite(final[key]) and final[key] > 0, key


def test_prediction_on_new_structures_including_larger_ones(trained, tmp_path):
    from schnet_ipu.inference.calculator import SchNetCalculator
    from schnet_ipu.inference.predictor import Predictor, predict_file

    frames = emt_frames(5, seed=9)
    big = Atoms("Cu40", positions=2.6 * np.array([(i, j, k) for i in range(4) for j in range(5)
                                                  for k in range(2)], dtype=float))  # fmt: skip
    frames.insert(2, big)  # larger than any training pack (20 atoms)
    predictor = Predictor(trained)
    assert predictor.specs[0].pack["max_nodes"] < len(big)  # no pack limit at prediction
    source, out = tmp_path / "new.extxyz", tmp_path / "out.extxyz"
    ase.io.write(source, frames, format="extxyz")
    assert predict_file(trained, source, out) == len(frames)
    written = ase.io.read(out, index=":")
    assert len(written) == len(frames)
    calc = SchNetCalculator(trained, dtype=torch.float32)
    for atoms, got in zip(frames, written, strict=True):
        np.testing.assert_allclose(got.positions, atoms.positions, atol=1e-6)
        alone = atoms.copy()
        alone.calc = calc  # one structure per call
        e = frame_energy(got, "energy", "out")
        np.testing.assert_allclose(e, alone.get_potential_energy(), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(
            frame_forces(got, "forces", "out"), alone.get_forces(), rtol=1e-4, atol=1e-4
        )


def test_calculator_forces_are_energy_derivatives_and_bfgs_lowers_energy(trained):
    from schnet_ipu.inference.calculator import SchNetCalculator

    atoms = emt_frames(1, seed=5)[0]
    atoms.calc = SchNetCalculator(trained)
    forces = atoms.get_forces()
    h = 1e-4
    for atom, axis in [(0, 0), (1, 2), (len(atoms) - 1, 1)]:
        energies = []
        for step in (h, -h):
            moved = atoms.copy()
            moved.positions[atom, axis] += step
            moved.calc = atoms.calc
            energies.append(moved.get_potential_energy())
        numeric = -(energies[0] - energies[1]) / (2 * h)
        assert abs(numeric - forces[atom, axis]) < 1e-6 + 1e-5 * abs(numeric)
    start = atoms.get_potential_energy()
    BFGS(atoms, logfile=None).run(fmax=0.05, steps=20)
    assert atoms.get_potential_energy() < start


def test_evaluate_writes_parity_and_histogram_pictures(trained):
    result = evaluate_run(trained, "test")
    assert result["force_mae"] > 0 and result["baseline_force_mae"] > 0
    for path in result["pictures"]:
        assert Path(path).is_file() and Path(path).stat().st_size > 10_000
        assert Path(path).read_bytes()[:4] == b"\x89PNG"
