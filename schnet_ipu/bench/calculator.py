"""Using a trained model: calculator and exported-file latency, and MD steps per second, of
random-weight table-filter models of ``configs/qm9.yaml`` (the paper's size: molecules, and Cu
cells of 20 and 1,000 atoms) and ``configs/emt_bulk.yaml`` (the force recipe's size: Cu, water
boxes), float32 and float64. The committed report: docs/benchmarks/calculator/; its figures:
docs/benchmarks/README.md."""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from ase import Atoms
from ase.build import bulk
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from schnet_ipu.bench import common
from schnet_ipu.checkpoint import save_checkpoint
from schnet_ipu.config import load_config
from schnet_ipu.inference.calculator import SchNetCalculator
from schnet_ipu.inference.export import export_model
from schnet_ipu.inference.model_file import ModelSpec
from schnet_ipu.inference.predictor import ONE_THREAD_ATOMS
from schnet_ipu.task import EnergyTask, TargetTransform

METAL_CONFIG = common.ROOT / "configs/emt_bulk.yaml"
COLUMNS = ["name", "model", "structure", "atoms", "dtype", "ms_per_call", "md_steps_per_s",
           "load_avg"]  # fmt: skip
MODELS = {"paper": "paper size 100/4, cutoff 6", "metal": "force recipe 64/3, cutoff 5"}
PLOT = ("name", "ms_per_call", "ms per energy + forces (+ stress) call")
MOLECULE_ELEMENTS = [1, 6, 7, 8]
PAPER_ELEMENTS = [*MOLECULE_ELEMENTS, 29]  # the paper's size on copper cells too
CELL_ELEMENTS = [1, 8, 29]
QUICK = {"quick": True}
FORCES = ("energy", "forces")  # what a calculator call computes
WARM_UP = 3  # rounds left out: TorchScript's profiling executor optimises on the first calls


def model_file(folder: Path, config: Path, elements: list[int]) -> Path:
    """``config``'s model with the table filter and random weights, as a checkpoint file."""
    arch = dataclasses.replace(load_config(config).model, ops="torch", filter="table")
    spec = ModelSpec(
        model=dataclasses.asdict(arch), max_nodes_per_pack=32, mean=0.0, std=0.5,
        task=EnergyTask(TargetTransform((0.0,) * 119, 1.0)).to_dict(), unit="eV",
        forces_unit="eV/Angstrom", target="energy", elements=elements,
        pack={"max_nodes": 32, "max_graphs": 4, "max_edges": 1024, "packs_per_batch": 8},
    )  # fmt: skip
    torch.manual_seed(0)
    path = folder / f"{config.stem}.pt"
    state = {"model": spec.build_model().state_dict(), "optimizer": {}, "scheduler": {}, "rng": {}}
    state.update(epoch=0, call=0, best_mae=0.0, config={}, model_spec=spec.to_dict())
    save_checkpoint(path, state)
    return path


def molecule(atoms: int) -> Atoms:
    """``atoms`` H/C/N/O atoms on a jittered simple-cubic grid of 1.45 A."""
    rng = np.random.default_rng(0)
    side = int(np.ceil(atoms ** (1 / 3)))
    grid = np.array([(i, j, k) for i in range(side) for j in range(side) for k in range(side)])
    pos = 1.45 * grid[:atoms] + rng.uniform(-0.08, 0.08, (atoms, 3))
    return Atoms(numbers=rng.choice(MOLECULE_ELEMENTS, size=atoms), positions=pos)


def copper(repeat: tuple[int, int, int]) -> Atoms:
    """Periodic fcc copper (a = 3.61 A, cubic cells of 4 atoms), rattled by 0.05 A."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(repeat)
    atoms.rattle(0.05, seed=1)
    return atoms


def water_box(side: int, seed: int = 0) -> Atoms:
    """``side^3`` randomly turned water molecules on a cubic grid at 1 g/cm^3 (3.10 A)."""
    rng = np.random.default_rng(seed)
    spacing = 3.104  # (18.015 g/mol / 6.022e23 / 1 g/cm^3)^(1/3)
    local = np.array([[0.0, 0.0, 0.0], [0.9572, 0.0, 0.0], [-0.2400, 0.9266, 0.0]])
    positions = []
    for i, j, k in np.ndindex(side, side, side):
        turn, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        positions.extend(spacing * np.array([i, j, k]) + local @ turn.T)
    return Atoms([8, 1, 1] * side**3, positions=positions, cell=[spacing * side] * 3, pbc=True)


def md_rate(calc: SchNetCalculator, atoms: Atoms, steps: int) -> float:
    """NVE velocity Verlet steps per second (1 fs, velocities at 300 K)."""
    atoms = atoms.copy()
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(2))
    dyn = VelocityVerlet(atoms, timestep=1 * fs)
    dyn.run(1)
    start = time.perf_counter()
    dyn.run(steps)
    return steps / (time.perf_counter() - start)


def interleaved_latency(calls: dict[str, Callable], atoms: Atoms, rounds: int) -> dict:
    """Median ms of each ``call(atoms)``, a round's calls on the same moved positions."""
    rng = np.random.default_rng(1)
    moved = [atoms.copy() for _ in range(rounds + WARM_UP)]
    for frame in moved:
        frame.positions += rng.normal(0, 1e-3, atoms.positions.shape)

    def step(call: Callable) -> Callable[[], int]:
        frames = iter(moved)
        return lambda: call(next(frames)) or 1

    steps = {name: step(call) for name, call in calls.items()}
    rates = common.measure_side_by_side(steps, common.Timing(WARM_UP, steps=1, repeats=rounds))
    return {name: 1000 * rate.step_seconds for name, rate in rates.items()}


def call_exported(module: torch.jit.ScriptModule, atoms: Atoms) -> None:
    """One call of the exported file as an engine makes it: torch's default thread count."""
    periodic = atoms.pbc.any()
    cell = (torch.as_tensor(atoms.cell.array), torch.as_tensor(atoms.pbc)) if periodic else ()
    module(torch.as_tensor(atoms.numbers), torch.as_tensor(atoms.positions), *cell)


def run(quick: bool = False, structures: list | None = None) -> dict:
    """Every (structure name, model, atoms) of ``structures``; ``quick``: fewer rounds."""
    if structures is None:
        structures = [("molecule", "paper", molecule(20)), ("molecule", "paper", molecule(200))]
        structures += [("Cu fcc", "paper", copper(r)) for r in ((5, 1, 1), (5, 5, 10))]
        structures += [("Cu fcc", "metal", copper(r)) for r in ((5, 1, 1), (5, 5, 2), (5, 5, 10))]
        structures.append(("water box", "metal", water_box(7)))
        if not quick:
            structures += [("Cu fcc", "metal", copper((10, 10, 25))),
                           ("water box", "metal", water_box(15))]  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as folder:
        # a model's calls in two groups: after the exported file's calls on torch's thread pool,
        # a one-thread calculator call is slower (200 atoms: 8.7-10.2 ms; 7.5-7.7 among calculators)
        calcs, groups = {}, {}  # groups: model -> (its calculators' calls, its exported files')
        for model, config, elements in (("paper", common.PAPER_CONFIG, PAPER_ELEMENTS),
                                        ("metal", METAL_CONFIG, CELL_ELEMENTS)):  # fmt: skip
            path = model_file(Path(folder), config, elements)
            calculators, files = groups[model] = {}, {}
            for dtype in (torch.float32, torch.float64):
                name = str(dtype).replace("torch.", "")
                calc = calcs[model, name] = SchNetCalculator(path, dtype=dtype)
                calculators[f"calculator {name}"] = lambda a, c=calc: c.calculate(a, FORCES)
                exported = Path(folder) / f"{model}-{name}.torchscript.pt"
                export_model(path, exported, dtype=dtype)
                module = torch.jit.load(str(exported))
                files[f"exported {name}"] = functools.partial(call_exported, module)
        for structure, model, atoms in structures:
            rounds = max(3, min(20, 2000 // len(atoms))) if not quick else 3
            latency = {}
            for group in groups[model]:
                latency.update(interleaved_latency(group, atoms, rounds))
            load = os.getloadavg()[0]
            for name, ms in latency.items():
                dtype = name.split()[-1]
                steps = max(2, 600 // len(atoms)) if not quick else 2
                md = md_rate(calcs[model, dtype], atoms, steps) if "calculator" in name else None
                results.append({"name": name, "model": MODELS[model], "structure": structure,
                                "atoms": len(atoms),
                                "dtype": dtype, "ms_per_call": ms, "md_steps_per_s": md,
                                "load_avg": load})  # fmt: skip
                print(results[-1], flush=True)
    notes = [
        "models: configs/qm9.yaml (molecules) and configs/emt_bulk.yaml (cells), filter=table,"
        f" random weights; torch threads {torch.get_num_threads()}; positions moved 1e-3 A "
        "a call; exported: float64 positions in, its own neighbour search",
        f"the calculator on one intra-op thread under {ONE_THREAD_ATOMS} atoms, the exported "
        "file on torch's default count (as an engine calls it); the calculators, then the "
        "exported files, in interleaved rounds; load_avg: 1-minute load after the row's rounds",
    ]
    return common.new_report("calculator", results, {}, notes)
