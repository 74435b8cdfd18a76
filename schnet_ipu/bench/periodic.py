"""Periodic systems: ``frames`` strained, rattled 32-atom fcc Cu cells, their pairs file built
at 5 A and their first ``compare`` frames listed by vesin, ASE and matscipy (if installed);
energy + force steps on them with and without shifts and cells. The committed report:
docs/benchmarks/periodic/; its figures: docs/benchmarks/README.md."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from schnet_ipu.bench import common
from schnet_ipu.data import MoleculeStore, edge_counts, write_store
from schnet_ipu.data.periodic_pairs import build_periodic_pairs
from schnet_ipu.feed.dataset import PackedDataset
from schnet_ipu.feed.layout import Layout
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.model import SchNet
from schnet_ipu.packing import plan_packing
from schnet_ipu.task import EnergyForceTask, TargetTransform

CUTOFF = 5.0
LATTICE = 3.6
QUICK = {"frames": 5000, "compare": 100, "steps": 10}
COLUMNS = ["name", "full_list_s_per_frame", "ratio_to_vesin", "step_ms"]
PLOT = ("name", "ratio_to_vesin", "seconds per full neighbour list / vesin's")


def fcc_frames(count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` strained, rattled 32-atom fcc cells: positions [count, 32, 3], cells."""
    rng = np.random.default_rng(0)
    basis = np.array([[0, 0, 0], [0, 0.5, 0.5], [0.5, 0, 0.5], [0.5, 0.5, 0]])
    grid = np.stack(np.meshgrid(*[np.arange(2)] * 3, indexing="ij"), -1).reshape(-1, 1, 3)
    scaled = ((grid + basis) / 2).reshape(-1, 3)  # [32, 3] fractional in the 2x2x2 cell
    strain = rng.uniform(-0.03, 0.03, size=(count, 3, 3))
    cells = 2 * LATTICE * (np.eye(3) + 0.5 * (strain + strain.transpose(0, 2, 1)))
    return scaled @ cells + rng.normal(0, 0.05, size=(count, 32, 3)), cells


def neighbour_lists(pos: np.ndarray, cells: np.ndarray) -> dict[str, float]:
    """Median seconds per frame of each library's full "ijS" list, over 3 interleaved rounds."""
    import vesin
    from ase import Atoms
    from ase.neighborlist import neighbor_list

    frames = [Atoms("Cu32", positions=p, cell=c, pbc=True) for p, c in zip(pos, cells)]
    calculator = vesin.NeighborList(cutoff=CUTOFF, full_list=True)
    builders = {"vesin": lambda a: calculator.compute(a.positions, a.cell.array, True, "ijS"),
                "ase": lambda a: neighbor_list("ijS", a, CUTOFF)}  # fmt: skip
    with contextlib.suppress(ImportError):  # a comparison only: `pip install matscipy` to time it
        import matscipy.neighbours

        builders["matscipy"] = lambda a: matscipy.neighbours.neighbour_list("ijS", a, CUTOFF)
    counts = {name: len(build(frames[0])[0]) for name, build in builders.items()}
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"the libraries disagree on frame 0's pairs: {counts}")

    def every_frame(build) -> int:
        for atoms in frames:
            build(atoms)
        return len(frames)

    steps = {name: functools.partial(every_frame, build) for name, build in builders.items()}
    rates = common.measure_side_by_side(steps, common.Timing(warmup=0, steps=1, repeats=3))
    return {name: rate.step_seconds / len(frames) for name, rate in rates.items()}


def step_times(store: MoleculeStore, steps: int) -> dict[str, float]:
    """Median ms per energy + force step (5 rounds): periodic batches, the same without cells."""
    torch.set_num_threads(1)
    edges = edge_counts(store, CUTOFF)  # the periodic pairs file, which the feed reads
    plan = plan_packing(store.num_atoms, edges, "tuple", max_nodes=128, target_efficiency=0.9)
    layout = Layout.from_plan(plan, 1, CUTOFF)
    targets = store.target("energy")
    data = PackedDataset(store, np.arange(len(store)), targets, plan, layout, 0, edges)
    periodic = [b for call in PackedLoader(data).epoch(0) for b in call][:steps]
    molecular = [dataclasses.replace(b, edge_shift=None, cell=None) for b in periodic]
    torch.manual_seed(0)
    model = SchNet(64, 64, 3, 25, CUTOFF, graph="radius")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss_fn = EnergyForceTask(TargetTransform((0.0,) * 119, 1.0), 1.0, 1.0).loss

    def train(batches: list) -> Callable[[], int]:
        calls = itertools.cycle(batches)
        return common.fwd_bwd(model, lambda: loss_fn(model, next(calls)), optimizer=optimizer)

    steps = {"periodic": train(periodic), "molecular": train(molecular)}
    rates = common.measure_side_by_side(steps, common.Timing(2, len(periodic), repeats=5))
    return {name: 1000 * rate.step_seconds for name, rate in rates.items()}


def copper_store(path: Path, pos: np.ndarray, cells: np.ndarray, forces: bool = False):
    """The frames as a store (energies and, with ``forces``, forces zero)."""
    zeros = {"forces": np.zeros_like(pos)} if forces else {}
    return MoleculeStore(write_store(path, np.full(pos.shape[:2], 29), pos,
                                     {"energy": np.zeros(len(pos))}, {"energy": "eV"}, cell=cells,
                                     pbc=np.ones((len(pos), 3), bool), **zeros))  # fmt: skip


def run(frames: int = 100_000, compare: int = 300, steps: int = 20, trained: int = 2000) -> dict:
    """See the module docstring; ``trained``: the frames batched for the step ratio."""
    pos, cells = fcc_frames(frames)
    facts: dict = {"frames": frames, "atoms_per_frame": 32, "cutoff": CUTOFF}
    with tempfile.TemporaryDirectory() as folder:
        store = copper_store(Path(folder) / "fcc.h5", pos, cells)
        start = time.perf_counter()
        pairs = build_periodic_pairs(store, CUTOFF)
        facts["pairs_file_build_s"] = time.perf_counter() - start
        facts["pairs_per_frame"] = float(pairs.counts.mean())
        per_frame = facts["full_list_s_per_frame"] = neighbour_lists(pos[:compare], cells[:compare])
        facts["full_list_s_extrapolated"] = {k: v * frames for k, v in per_frame.items()}
        facts["ratio_to_vesin"] = {k: v / per_frame["vesin"] for k, v in per_frame.items()}
        small = copper_store(Path(folder) / "small.h5", pos[:trained], cells[:trained], True)
        step_ms = step_times(small, steps)
    ratios = {"periodic_over_molecular": step_ms["periodic"] / step_ms["molecular"]}
    facts.update(step_ms=step_ms, **ratios)
    rows = [{"name": k, "full_list_s_per_frame": v, "ratio_to_vesin": facts["ratio_to_vesin"][k]}
            for k, v in per_frame.items()]  # fmt: skip
    rows += [{"name": f"{name} step", "step_ms": ms} for name, ms in step_ms.items()]
    notes = [f"{frames} frames of 32 fcc Cu atoms, cutoff {CUTOFF} A; full lists of the first "
             f"{compare} frames, 3 rounds; energy + force steps (SchNet 64/64/3, one thread): "
             f"{steps} per round, 5 rounds."]  # fmt: skip
    return common.new_report("periodic", rows, ratios, notes, **facts)  # the report's keys
