"""Periodic systems: neighbour-list builders side by side, and periodic against molecular steps.

    python -m schnet_ipu.bench.periodic [--frames 100000] [--compare 300] [--steps 20]

1. Neighbour lists. ``--frames`` frames of 32 atoms (2x2x2 conventional fcc cells of Cu,
   a = 3.6 A, each under a random symmetric strain of up to 3% and rattled by 0.05 A) are
   written to a store, and the periodic pairs file at 5 A is built from it
   (:func:`~schnet_ipu.data.periodic_pairs.build_periodic_pairs`: vesin, canonical half
   list, int8 shifts). The first ``--compare`` frames are then listed frame by frame by
   vesin, ``ase.neighborlist.neighbor_list`` and ``matscipy.neighbours.neighbour_list``
   ("ijS", full lists), interleaved in rounds, and each is extrapolated to ``--frames``.
2. Step ratio. Batches of those frames (tuple packing) are trained on (energy + forces,
   SchNet 64/64/3, one thread) as they are (periodic: shifts and cells) and with
   ``edge_shift`` and ``cell`` removed (molecular: the same atoms, edges and shapes), in
   interleaved rounds; prints the median milliseconds per step and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from schnet_ipu.data import MoleculeStore, edge_counts, write_store
from schnet_ipu.data.periodic_pairs import build_periodic_pairs
from schnet_ipu.epoch_schedule import PackedDataset
from schnet_ipu.layout import Layout
from schnet_ipu.loader import PackedLoader
from schnet_ipu.model import SchNet
from schnet_ipu.packing import plan_packing
from schnet_ipu.task import EnergyForceTask, TargetTransform

CUTOFF = 5.0
LATTICE = 3.6


def fcc_frames(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``count`` strained, rattled 32-atom fcc cells: positions [count, 32, 3], cells
    [count, 3, 3]."""
    rng = np.random.default_rng(seed)
    basis = np.array([[0, 0, 0], [0, 0.5, 0.5], [0.5, 0, 0.5], [0.5, 0.5, 0]])
    grid = np.stack(np.meshgrid(*[np.arange(2)] * 3, indexing="ij"), -1).reshape(-1, 1, 3)
    scaled = ((grid + basis) / 2).reshape(-1, 3)  # [32, 3] fractional in the 2x2x2 cell
    strain = rng.uniform(-0.03, 0.03, size=(count, 3, 3))
    strain = 0.5 * (strain + strain.transpose(0, 2, 1))
    cells = 2 * LATTICE * (np.eye(3) + strain)
    pos = scaled @ cells + rng.normal(0, 0.05, size=(count, 32, 3))
    return pos, cells


def neighbour_lists(pos: np.ndarray, cells: np.ndarray, rounds: int = 3) -> dict[str, float]:
    """Median seconds per frame of each library's full "ijS" list, over interleaved rounds."""
    import vesin
    from ase import Atoms
    from ase.neighborlist import neighbor_list

    frames = [Atoms("Cu32", positions=p, cell=c, pbc=True) for p, c in zip(pos, cells)]
    calculator = vesin.NeighborList(cutoff=CUTOFF, full_list=True)
    builders = {
        "vesin": lambda a: calculator.compute(a.positions, a.cell.array, True, "ijS"),
        "ase": lambda a: neighbor_list("ijS", a, CUTOFF),
    }
    try:  # a comparison only: `pip install matscipy` to time it too
        import matscipy.neighbours

        builders["matscipy"] = lambda a: matscipy.neighbours.neighbour_list("ijS", a, CUTOFF)
    except ImportError:
        pass
    counts = {name: len(build(frames[0])[0]) for name, build in builders.items()}
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"the libraries disagree on frame 0's pairs: {counts}")
    times: dict[str, list[float]] = {name: [] for name in builders}
    for _ in range(rounds):
        for name, build in builders.items():
            start = time.perf_counter()
            for atoms in frames:
                build(atoms)
            times[name].append((time.perf_counter() - start) / len(frames))
    return {name: statistics.median(t) for name, t in times.items()}


def step_times(store: MoleculeStore, steps: int, rounds: int = 5) -> dict[str, float]:
    """Median ms per energy + force training step on periodic batches and on the same
    batches without shifts and cells (see the module docstring)."""
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

    def train(batches) -> float:
        start = time.perf_counter()
        for batch in batches:
            optimizer.zero_grad()
            loss_fn(model, batch).backward()
            optimizer.step()
        return 1000 * (time.perf_counter() - start) / len(batches)

    train(periodic[:2])  # warm-up
    train(molecular[:2])
    times: dict[str, list[float]] = {"periodic": [], "molecular": []}
    for _ in range(rounds):
        times["periodic"].append(train(periodic))
        times["molecular"].append(train(molecular))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m schnet_ipu.bench.periodic")
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--compare", type=int, default=300, help="frames per library")
    parser.add_argument("--steps", type=int, default=20, help="training steps per round")
    args = parser.parse_args(argv)
    pos, cells = fcc_frames(args.frames)
    report: dict = {"frames": args.frames, "atoms_per_frame": 32, "cutoff": CUTOFF}
    with tempfile.TemporaryDirectory() as folder:
        path = write_store(
            Path(folder) / "fcc.h5",
            np.full(pos.shape[:2], 29),
            pos,
            {"energy": np.zeros(args.frames)},
            {"energy": "eV"},
            cell=cells,
            pbc=np.ones((args.frames, 3), bool),
        )
        store = MoleculeStore(path)
        start = time.perf_counter()
        pairs = build_periodic_pairs(store, CUTOFF)
        report["pairs_file_build_s"] = time.perf_counter() - start
        report["pairs_per_frame"] = float(pairs.counts.mean())
        per_frame = neighbour_lists(pos[: args.compare], cells[: args.compare])
        report["full_list_s_per_frame"] = per_frame
        report["full_list_s_extrapolated"] = {k: v * args.frames for k, v in per_frame.items()}
        report["ratio_to_vesin"] = {k: v / per_frame["vesin"] for k, v in per_frame.items()}
        small = MoleculeStore(
            write_store(
                Path(folder) / "small.h5",
                np.full((2000, 32), 29),
                pos[:2000],
                {"energy": np.zeros(2000)},
                {"energy": "eV"},
                forces=np.zeros_like(pos[:2000]),
                cell=cells[:2000],
                pbc=np.ones((2000, 3), bool),
            )
        )
        steps = step_times(small, args.steps)
    report["step_ms"] = steps
    report["periodic_over_molecular"] = steps["periodic"] / steps["molecular"]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
