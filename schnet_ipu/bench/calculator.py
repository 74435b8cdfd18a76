"""Using a trained model: calculator and exported-file latency, and MD steps per second.

    python -m schnet_ipu.bench calculator [--quick] [--json out.json]

The paper's model (``configs/qm9.yaml``'s model section: 100 features, 4 blocks, 25
Gaussians, 6 A) with random weights is written as a checkpoint file, then used the three
ways users do: :class:`~schnet_ipu.calculator.SchNetCalculator` (float32 and float64), the
TorchScript file of ``train.py export`` loaded by ``torch.jit.load`` (float32 and float64),
and NVE molecular dynamics through ASE (velocity Verlet, 1 fs) on a 20- and a 200-atom
organic-like structure (H, C, N, O on a jittered grid, 1.1-1.6 A apart). Latency is the
median of many energy + forces calls on moved positions (no cached results); weights do
not change the arithmetic, so random ones measure what a trained model costs.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from ase import Atoms
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
from ase.md.verlet import VelocityVerlet
from ase.units import fs

from schnet_ipu.bench.common import new_report
from schnet_ipu.calculator import SchNetCalculator
from schnet_ipu.checkpoint import save_checkpoint
from schnet_ipu.config import load_config
from schnet_ipu.inference import ONE_THREAD_ATOMS, export_model, intra_op_threads
from schnet_ipu.model_file import ModelSpec
from schnet_ipu.task import EnergyTask, TargetTransform

PAPER_CONFIG = Path(__file__).resolve().parents[2] / "configs/qm9.yaml"
COLUMNS = ["name", "atoms", "dtype", "ms_per_call", "md_steps_per_s", "load_s"]
PLOT = ("name", "ms_per_call", "ms per energy + forces call")
ELEMENTS = [1, 6, 7, 8]


def model_file(folder: Path) -> Path:
    """The paper model with random weights as a checkpoint file in ``folder``."""
    arch = dataclasses.replace(load_config(PAPER_CONFIG).model, ops="torch")
    spec = ModelSpec(
        model=dataclasses.asdict(arch),
        max_nodes_per_pack=32,
        mean=0.0,
        std=0.5,
        task=EnergyTask(TargetTransform((0.0,) * 119, 1.0)).to_dict(),
        unit="eV",
        forces_unit="eV/Angstrom",
        target="energy",
        pack={"max_nodes": 32, "max_graphs": 4, "max_edges": 1024, "packs_per_batch": 8},
        elements=ELEMENTS,
    )
    torch.manual_seed(0)
    model = spec.build_model()
    path = folder / "model.pt"
    state = {"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "rng": {}}
    state.update(epoch=0, call=0, best_mae=0.0, config={}, model_spec=spec.to_dict())
    save_checkpoint(path, state)
    return path


def structure(atoms: int, seed: int = 0) -> Atoms:
    """``atoms`` H/C/N/O atoms on a jittered simple-cubic grid of 1.45 A."""
    rng = np.random.default_rng(seed)
    side = int(np.ceil(atoms ** (1 / 3)))
    grid = np.array([(i, j, k) for i in range(side) for j in range(side) for k in range(side)])
    pos = 1.45 * grid[:atoms] + rng.uniform(-0.08, 0.08, (atoms, 3))
    return Atoms(numbers=rng.choice(ELEMENTS, size=atoms), positions=pos)


def call_latency(call, atoms: Atoms, calls: int) -> float:
    """Median milliseconds of ``call(z, pos)`` on slightly moved positions."""
    rng = np.random.default_rng(1)
    z = atoms.numbers
    times = []
    for _ in range(calls):
        pos = atoms.positions + rng.normal(0, 1e-3, atoms.positions.shape)
        start = time.perf_counter()
        call(z, pos)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def md_rate(calc: SchNetCalculator, atoms: Atoms, steps: int) -> float:
    """NVE velocity Verlet steps per second (1 fs, velocities at 300 K)."""
    atoms = atoms.copy()
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(2))
    dyn = VelocityVerlet(atoms, timestep=1 * fs)
    dyn.run(2)
    start = time.perf_counter()
    dyn.run(steps)
    return steps / (time.perf_counter() - start)


def run(quick: bool, store: str | Path) -> dict:
    calls, steps = (30, 20) if quick else (200, 200)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        path = model_file(Path(folder))
        for dtype in (torch.float32, torch.float64):
            name = str(dtype).replace("torch.", "")
            start = time.perf_counter()
            calc = SchNetCalculator(path, dtype=dtype)
            load = time.perf_counter() - start
            for size in (20, 200):
                atoms = structure(size)

                def calculate(z, pos, calc=calc):
                    calc.calculate(Atoms(numbers=z, positions=pos), ("energy", "forces"))

                results.append(
                    {
                        "name": f"calculator {name}",
                        "atoms": size,
                        "dtype": name,
                        "ms_per_call": call_latency(calculate, atoms, calls),
                        "md_steps_per_s": md_rate(calc, atoms, steps // (1 + size // 100)),
                        "load_s": load,
                    }
                )
            exported = Path(folder) / f"model-{name}.pt"
            export_model(path, exported, dtype=dtype)
            start = time.perf_counter()
            module = torch.jit.load(str(exported))
            load = time.perf_counter() - start
            for size in (20, 200):
                threads = 1 if size < ONE_THREAD_ATOMS else torch.get_num_threads()

                def scripted(z, pos, module=module, dtype=dtype, threads=threads):
                    with intra_op_threads(threads):  # as the calculator chooses
                        module(torch.as_tensor(z), torch.as_tensor(pos, dtype=dtype))

                results.append(
                    {
                        "name": f"exported {name}",
                        "atoms": size,
                        "dtype": name,
                        "ms_per_call": call_latency(scripted, structure(size), calls),
                        "load_s": load,
                    }
                )
    notes = [
        f"paper model (configs/qm9.yaml), random weights; torch threads {torch.get_num_threads()}",
        "ms_per_call: median energy + forces call, positions moved by 1e-3 A each call",
        "md_steps_per_s: ASE VelocityVerlet, 1 fs, through the calculator",
        "load_s: SchNetCalculator(path) for the calculator, torch.jit.load for the export",
        f"structures under {ONE_THREAD_ATOMS} atoms run on one intra-op thread (both ways)",
    ]
    return new_report("calculator", results, {}, notes)
