"""Cost-model grouping across replicas: 2 CPU replicas (gloo), round-robin against the cost
model (``a*atoms + b*edges + c``, fitted on a calibration epoch), on dynamic batches and tuple
packs. ``straggler``: mean over steps of slowest / mean replica fwd+bwd. The committed
report: docs/benchmarks/balance/; its figures: docs/benchmarks/README.md."""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from schnet_ipu.backends import init_replica
from schnet_ipu.backends.distributed import broadcast_parameters, merged_allreduce
from schnet_ipu.batch import Batch
from schnet_ipu.bench import common
from schnet_ipu.bench.batching import collate_groups, epoch_batches
from schnet_ipu.bench.replicas import Replicas
from schnet_ipu.config import BackendConfig, ModelConfig
from schnet_ipu.data import MoleculeStore, radius_pairs
from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.feed.layout import Layout
from schnet_ipu.packing import balance
from schnet_ipu.task import masked_mse

COLUMNS = ["dataset", "batching", "schedule", "straggler", "predicted_straggler", "epoch_s",
           "steps", "r2_fit", "r2_predict", "per_atom_us", "per_edge_us",
           "constant_ms"]  # fmt: skip
PLOT = ("label", "straggler", "slowest / mean replica fwd+bwd per step")
REPLICAS = 2
QUICK = {"sample": 800, "water_clusters": 300, "water_sizes": (3, 20), "epochs": 2}


def build_batches(
    store: MoleculeStore, index: np.ndarray, batching: str, batch: int, cutoff: float
) -> list[Batch]:
    """One epoch of collated tuple packs, or dynamic batches each at its own shape."""
    nodes, pairs = store.num_atoms[index], radius_pairs(store, cutoff)
    edges = 2 * pairs.counts[index]
    algorithm = "tuple" if batching == "packs" else "dynamic"
    groups = epoch_batches(algorithm, nodes, edges, batch, cutoff)[0]
    if batching == "dynamic":  # each at its own shape
        groups = [([b], Layout(1, int(nodes[b].sum()), len(b) + 1, max(int(edges[b].sum()), 2),
                               cutoff)) for (b,), _ in groups]  # fmt: skip
    arrays = FeedArrays.from_store(store, np.zeros(len(store)), pairs)  # shared by every batch
    return collate_groups(store, index, groups, arrays)


def shape_counts(batches: list[Batch]) -> tuple[np.ndarray, np.ndarray]:
    """Computed (padded) atoms [n] and directed edges [n] of each batch."""
    atoms = np.array([b.num_nodes for b in batches])
    return atoms, np.array([b.edge_index.shape[1] for b in batches])


def run_epoch(model, optim, batches: list[Batch], schedule: np.ndarray, rank: int) -> dict:
    """Train one epoch of ``schedule`` [steps, R]: wall seconds, every rank's fwd+bwd per step."""
    compute = np.zeros(len(schedule))
    grads = [p.grad for p in model.parameters()]
    dist.barrier()
    start = time.perf_counter()
    for step, row in enumerate(schedule):
        tick = time.perf_counter()
        optim.zero_grad(set_to_none=False)
        if row[rank] >= 0:
            b = batches[row[rank]]
            masked_mse(model(b), b.y, b.graph_mask, 1.0).backward()
        compute[step] = time.perf_counter() - tick
        merged_allreduce(grads, dist.get_world_size())
        optim.step()
    wall = time.perf_counter() - start
    parts = [torch.zeros(len(compute), dtype=torch.float64) for _ in range(REPLICAS)]
    dist.all_gather(parts, torch.as_tensor(compute, dtype=torch.float64))
    return {"compute": torch.stack(parts, dim=1).numpy(), "wall": wall}


def time_jobs(
    rank: int, world: int, jobs: list[dict], batch: int, size: ModelConfig, epochs: int
) -> tuple[list[dict], dict]:
    """The replicas' setup: every job timed in the gloo group; the facts: the rows of them all."""
    init_replica(BackendConfig(device="cpu", replicas=world), "cpu")
    results = []
    for job in jobs:
        store = MoleculeStore(job["store"])
        batches = build_batches(store, job["index"], job["batching"], batch, size.cutoff)
        atoms, edges = shape_counts(batches)
        torch.manual_seed(0)
        model = common.schnet(size, graph="radius", max_nodes_per_pack=1)
        broadcast_parameters(model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optim = torch.optim.Adam(model.parameters(), lr=1e-4)
        rr = balance.round_robin(len(batches), REPLICAS)
        run_epoch(model, optim, batches, rr, rank)  # warm-up
        cost = calibrate(model, optim, store, job["index"], size.cutoff, rank)
        balanced = balance.balance_batches(cost.predict(atoms, edges), REPLICAS, seed=0)
        schedules = {"round_robin": rr, "cost_model": balanced}
        timed: dict[str, list[dict]] = {name: [] for name in schedules}
        for _, (name, schedule) in itertools.product(range(epochs), schedules.items()):
            timed[name].append(run_epoch(model, optim, batches, schedule, rank))  # alternating
        for name, schedule in schedules.items():
            results.append(summarise(job, name, schedule, timed[name], cost, atoms, edges))
    return results, {}  # no calls: the rows are measured in the setup


def calibrate(model, optim, store, index: np.ndarray, cutoff: float, rank: int):
    """The cost model fitted on every rank's steps on dynamic batches of 8, 16, 64 molecules."""
    thirds = np.array_split(index, 3)
    batches = [b for part, size in zip(thirds, (8, 16, 64))
               for b in build_batches(store, part, "dynamic", size, cutoff)]  # fmt: skip
    atoms, edges = shape_counts(batches)
    rr = balance.round_robin(len(batches), REPLICAS)
    measured = run_epoch(model, optim, batches, rr, rank)["compute"]  # [steps, R]
    real = rr >= 0
    return balance.fit_cost_model(atoms[rr[real]], edges[rr[real]], measured[real])


def summarise(job: dict, name: str, schedule: np.ndarray, epochs: list[dict], cost, atoms, edges):
    """The row of one schedule [steps, R] (medians over its ``epochs``)."""
    measured = [epoch["compute"] for epoch in epochs]  # each [steps, R]
    costs = balance.step_costs(schedule, cost.predict(atoms, edges))  # [steps, R]
    real = schedule >= 0
    fit = balance.r_squared(
        np.concatenate([costs[real]] * len(measured)), np.concatenate([m[real] for m in measured])
    )
    return {
        "label": f"{job['dataset']}/{job['batching']}/{name}",
        "dataset": job["dataset"], "batching": job["batching"], "schedule": name,
        "straggler": statistics.median(float((m.max(1) / m.mean(1)).mean()) for m in measured),
        "predicted_straggler": float((costs.max(1) / costs.mean(1)).mean()),
        "epoch_s": statistics.median(epoch["wall"] for epoch in epochs), "steps": len(schedule),
        "batches": len(atoms), "r2_fit": cost.r2, "r2_predict": fit,
        "per_atom_us": 1e6 * cost.per_atom, "per_edge_us": 1e6 * cost.per_edge,
        "constant_ms": 1e3 * cost.constant, "epochs": len(epochs),
    }  # fmt: skip


def run(
    store: str | Path = common.QM9_STORE, sample: int = 4000, water_clusters: int = 600,
    water_sizes: tuple[int, int] = (3, 30), batch: int = 32, epochs: int = 3,
    size: ModelConfig = common.PAPER_SIZE,
) -> dict:  # fmt: skip
    with common.qm9_and_water(store, sample, water_clusters, water_sizes) as datasets:
        jobs = [{"dataset": name, "store": str(path), "index": index, "batching": batching}
                for name, (path, index) in datasets.items()
                for batching in ("dynamic", "packs")]  # fmt: skip
        with Replicas(REPLICAS, time_jobs, jobs, batch, size, epochs) as group:
            results = group.facts[0]
    ratios = {
        f"{rr['dataset']}_{rr['batching']}_epoch_speedup": rr["epoch_s"] / cost["epoch_s"]
        for rr, cost in zip(results[::2], results[1::2])  # a job's round-robin and cost-model rows
    }
    notes = [
        f"{REPLICAS} CPU replicas (1 thread each, gloo all-reduce per step), SchNet "
        f"{size.hidden_channels}x{size.num_interactions}, radius {size.cutoff}, about {batch} "
        f"molecules per batch; QM9 {len(jobs[0]['index'])} molecules, water {water_clusters} "
        f"clusters of {water_sizes[0]}-{water_sizes[1]}; {epochs} epochs per schedule; medians.",
    ]
    return common.new_report("balance", results, ratios, notes)
