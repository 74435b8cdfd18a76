"""Step time and collectives per step of replicated training, by gradient reduction: one
gloo all-reduce per parameter, one merged gloo all-reduce, or the merged buffer summed
through shared memory (same-host CPU replicas, the default).

    python -m schnet_ipu.bench.replication [--replicas 1 2 4] [--steps 10] [--packs 8]

Each replica trains the paper-size SchNet (100 features, 100 filters, 4 interactions,
25 Gaussians, knn k=24) on its own fixed-shape batch of ``packs`` packs of ``max_nodes`` atoms
filled with synthetic QM9-like molecules (9-29 atoms of H, C, N, O, F). This is weak scaling:
every replica does the same work, so the ideal step time is flat in R. On one host the
replicas share the CPU cores (``launch_replicas`` gives each 1/R of the threads).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from schnet_ipu.backends.distributed import (
    init_replica,
    launch_replicas,
    shutdown_replica,
)
from schnet_ipu.backends.torch_backend import TorchBackend
from schnet_ipu.batch import Batch
from schnet_ipu.bench.common import new_report
from schnet_ipu.bench.model import molecules_to_batch, plan_packs
from schnet_ipu.config import BackendConfig
from schnet_ipu.model import SchNet
from schnet_ipu.task import masked_mse

ELEMENTS = np.array([1, 6, 7, 8, 9])
REDUCTIONS = {  # name -> (merge_allreduce, shared_memory_allreduce)
    "per-parameter": (False, False),
    "merged": (True, False),
    "shared memory": (True, True),
}


def synthetic_batch(seed: int, packs: int, max_nodes: int, max_graphs: int) -> Batch:
    """``packs`` packs of random QM9-sized molecules (atoms ~1.5 Angstrom apart)."""
    rng = np.random.default_rng(seed)
    molecules = []
    while True:
        size = int(rng.integers(9, 30))
        z = rng.choice(ELEMENTS, size=size, p=[0.5, 0.35, 0.06, 0.08, 0.01])
        pos = np.cumsum(rng.normal(scale=0.9, size=(size, 3)), axis=0)
        molecules.append((z, pos))
        assignment = plan_packs([len(m[0]) for m in molecules], max_nodes, max_graphs)
        if len(assignment) > packs:
            assignment = assignment[:packs]
            break
    targets = rng.normal(size=len(molecules))
    return molecules_to_batch(molecules, assignment, max_nodes, max_graphs, targets=targets)


def schnet_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return masked_mse(model(batch), batch.y, batch.graph_mask, 1.0)


def _worker(rank: int, world: int, settings: dict, out: Path) -> None:
    replica = init_replica(BackendConfig(device="cpu", replicas=world), "cpu")
    batch = synthetic_batch(rank, settings["packs"], settings["max_nodes"], settings["max_graphs"])
    rows = []
    for reduction in settings["reductions"] if world > 1 else ["none"]:
        merge, shared = REDUCTIONS.get(reduction, (True, True))
        torch.manual_seed(0)
        model = SchNet(100, 100, 4, 25, cutoff=6.0, k=24, max_nodes_per_pack=settings["max_nodes"])
        backend = TorchBackend(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-3),
            schnet_loss,
            merge_allreduce=merge,
            shared_memory_allreduce=shared,
            grad_clip=10.0,
            replica=replica,
        )
        times = []
        for _ in range(settings["warmup"] + settings["steps"]):
            start = time.perf_counter()
            backend.train_call([batch])
            times.append(time.perf_counter() - start)
        times = torch.tensor(times[settings["warmup"] :], dtype=torch.float64)
        reduce_ms = float("nan")
        if world > 1:  # a step is as slow as its slowest replica
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            reduce_ms = _time_reduction(backend, settings["steps"])
        rows.append(
            {
                "replicas": world,
                "reduction": reduction,
                "collectives_per_step": backend.collectives_per_step,
                "step_ms_median": 1e3 * statistics.median(times.tolist()),
                "step_ms_min": 1e3 * min(times.tolist()),
                "allreduce_ms": reduce_ms,
                "molecules_per_s": world * batch.num_molecules / statistics.median(times.tolist()),
                "grad_values": sum(p.numel() for p in model.parameters()),
                "threads": torch.get_num_threads(),
            }
        )
    if rank == 0:
        torch.save(rows, out)
    shutdown_replica()


def _time_reduction(backend: TorchBackend, repeats: int) -> float:
    """Median ms of the backend's gradient reduction alone (after a barrier), slowest replica."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        backend.reduce_gradients()
        times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return 1e3 * float(median)


def measure_replication(
    replicas: tuple[int, ...] = (1, 2, 4),
    reductions: tuple[str, ...] = tuple(REDUCTIONS),
    steps: int = 10,
    warmup: int = 3,
    packs: int = 8,
    max_nodes: int = 36,
    max_graphs: int = 3,
) -> list[dict]:
    """One row per (replicas, reduction) (one replica: reduction "none"): median step time
    (max over replicas, ms), collectives per step, the gradient reduction alone (ms),
    molecules per second over all replicas."""
    unknown = set(reductions) - set(REDUCTIONS)
    if unknown:
        raise ValueError(f"unknown reductions {sorted(unknown)}; choose from {list(REDUCTIONS)}")
    settings = dict(
        reductions=list(reductions), steps=steps, warmup=warmup, packs=packs, max_nodes=max_nodes,
        max_graphs=max_graphs,
    )  # fmt: skip
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in replicas:
            out = Path(tmp) / f"r{world}.pt"
            launch_replicas(_worker, world, world, settings, out)
            rows += torch.load(out)
    return rows


COLUMNS = ["name", "replicas", "reduction", "collectives_per_step", "step_ms_median", "step_ms_min",
           "allreduce_ms", "molecules_per_s"]  # fmt: skip
PLOT = ("name", "molecules_per_s", "training molecules/s (all replicas)")


def run(quick: bool, store: str) -> dict:
    """The bench suite (synthetic molecules; ``store`` is unused): 1, 2 and 4 replicas,
    10 steps (``quick``: 1 and 2 replicas, 3 steps)."""
    replicas, steps = ((1, 2), 3) if quick else ((1, 2, 4), 10)
    rows = measure_replication(replicas, steps=steps)
    for row in rows:
        row["name"] = f"{row['replicas']} x {row['reduction']}"
    notes = [
        "Weak scaling on synthetic QM9-like molecules: every replica trains its own batch of "
        "8 packs of 36 atoms (paper-size SchNet, knn k=24), so the ideal step time is flat in "
        "R; the replicas share this host's cores. step_ms: the slowest replica's median.",
    ]
    return new_report("replication", rows, {}, notes)
