"""Cost-model grouping across replicas: 2 CPU replicas (gloo), round-robin vs cost model.

Per data set and batching (``dynamic``: the dynamic-batching baseline at its own shapes;
``packs``: tuple packing) every replica trains SchNet on its share of one epoch's batches.
After a warm-up and a calibration epoch (batches of 8, 16 and 64 molecules fit
``a*atoms + b*edges + c``), round-robin and cost-model epochs alternate. ``straggler``:
mean over steps of slowest / mean replica fwd+bwd (``predicted_``: by the cost model);
``r2_fit`` / ``r2_predict``: R^2 on the calibration / timed steps.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from schnet_ipu.backends import init_replica
from schnet_ipu.backends.distributed import broadcast_parameters, merged_allreduce
from schnet_ipu.batch import Batch
from schnet_ipu.batch_layout import Layout
from schnet_ipu.bench import common
from schnet_ipu.bench.batching import collate_groups, epoch_batches
from schnet_ipu.bench.replicas import Replicas
from schnet_ipu.config import BackendConfig, ModelConfig
from schnet_ipu.data import MoleculeStore, radius_pairs
from schnet_ipu.feed_arrays import FeedArrays
from schnet_ipu.model import SchNet
from schnet_ipu.packing.balance import (
    balance_batches,
    fit_cost_model,
    r_squared,
    round_robin,
    step_costs,
)
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
    """One epoch of collated batches (every molecule of ``index`` once), seed 0: the batching
    suite's tuple packs, or its dynamic batches each at its own shape."""
    nodes, pairs = store.num_atoms[index], radius_pairs(store, cutoff)
    edges = 2 * pairs.counts[index]
    algorithm = "tuple" if batching == "packs" else "dynamic"
    groups = epoch_batches(algorithm, nodes, edges, batch, cutoff)[0]
    if batching == "dynamic":
        groups = [
            ([b], Layout(1, int(nodes[b].sum()), len(b) + 1, max(int(edges[b].sum()), 2), cutoff))
            for (b,), _ in groups
        ]
    arrays = FeedArrays.from_store(store, np.zeros(len(store)), pairs)  # shared by every batch
    return collate_groups(store, index, groups, arrays)


def shape_counts(batches: list[Batch]) -> tuple[np.ndarray, np.ndarray]:
    """Computed (padded) atoms [n] and directed edges [n] of each batch."""
    atoms = np.array([b.num_nodes for b in batches])
    edges = np.array([b.edge_index.shape[1] for b in batches])
    return atoms, edges


def run_epoch(model, optim, batches: list[Batch], schedule: np.ndarray, rank: int) -> dict:
    """Train one epoch of ``schedule`` [steps, R]; this rank's fwd+bwd seconds per step."""
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
    return {"compute": compute, "wall": time.perf_counter() - start}


def replica_setup(rank: int, world: int, jobs: list[dict], size: ModelConfig, epochs: int):
    """The replica runner's setup: join the gloo group; one call, ``run``, times every job's
    epochs on this rank (see the module docstring) and answers the rows."""
    init_replica(BackendConfig(device="cpu", replicas=world), "cpu")
    return None, {"run": lambda: time_jobs(rank, jobs, size, epochs)}


def time_jobs(rank: int, jobs: list[dict], size: ModelConfig, epochs: int) -> list[dict]:
    """Every job's rows (the same on every rank)."""
    results = []
    for job in jobs:
        store = MoleculeStore(job["store"])
        batches = build_batches(store, job["index"], job["batching"], job["batch"], size.cutoff)
        atoms, edges = shape_counts(batches)
        torch.manual_seed(0)
        model = SchNet(
            size.hidden_channels, size.num_filters, size.num_interactions,
            size.num_gaussians, size.cutoff, graph="radius", max_nodes_per_pack=1,
        )  # fmt: skip
        broadcast_parameters(model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optim = torch.optim.Adam(model.parameters(), lr=1e-4)
        rr = round_robin(len(batches), REPLICAS)
        run_epoch(model, optim, batches, rr, rank)  # warm-up
        cost = calibrate(model, optim, store, job["index"], size.cutoff, rank)
        balanced = balance_batches(cost.predict(atoms, edges), REPLICAS, seed=0)
        schedules = {"round_robin": rr, "cost_model": balanced}
        timed: dict[str, list[dict]] = {name: [] for name in schedules}
        for _ in range(epochs):  # the schedules alternate
            for name, schedule in schedules.items():
                timed[name].append(run_epoch(model, optim, batches, schedule, rank))
        for name, schedule in schedules.items():
            results.append(summarise(job, name, schedule, timed[name], cost, atoms, edges))
    return results


def calibrate(model, optim, store, index: np.ndarray, cutoff: float, rank: int):
    """Fit the cost model on batches of 8, 16 and 64 molecules (dynamic batching, a third of
    ``index`` each, own shapes): a wide spread of shapes, unlike one epoch's like-sized
    batches. Both ranks' steps are used, so every rank fits the same model."""
    thirds = np.array_split(index, 3)
    batches = [
        b for part, size in zip(thirds, (8, 16, 64)) for b in build_batches(
            store, part, "dynamic", size, cutoff)
    ]  # fmt: skip
    atoms, edges = shape_counts(batches)
    rr = round_robin(len(batches), REPLICAS)
    measured = gather(run_epoch(model, optim, batches, rr, rank)["compute"])  # [steps, R]
    real = rr >= 0
    return fit_cost_model(atoms[rr[real]], edges[rr[real]], measured[real])


def gather(compute: np.ndarray) -> np.ndarray:
    """Every rank's per-step seconds [steps] -> [steps, R] (same on every rank)."""
    parts = [torch.zeros(len(compute), dtype=torch.float64) for _ in range(REPLICAS)]
    dist.all_gather(parts, torch.as_tensor(compute, dtype=torch.float64))
    return torch.stack(parts, dim=1).numpy()


def summarise(
    job: dict, name: str, schedule: np.ndarray, epochs: list[dict], cost, atoms, edges
) -> dict:
    """The row of one schedule [steps, R] (medians over its ``epochs``)."""
    measured = [gather(epoch["compute"]) for epoch in epochs]  # each [steps, R]
    costs = step_costs(schedule, cost.predict(atoms, edges))  # [steps, R]
    real = schedule >= 0
    fit = r_squared(
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
    size: ModelConfig | None = None,
) -> dict:  # fmt: skip
    """QM9 (a fixed random sample) and synthetic water, dynamic batches and packs."""
    size = size or ModelConfig()
    with common.qm9_and_water(store, sample, water_clusters, water_sizes) as datasets:
        jobs = [
            {"dataset": name, "store": str(path), "index": index, "batching": batching,
             "batch": batch}
            for name, (path, index) in datasets.items() for batching in ("dynamic", "packs")
        ]  # fmt: skip
        with Replicas(REPLICAS, replica_setup, jobs, size, epochs) as group:
            results = group.call("run")[0]
    ratios = {}
    for job in jobs:
        rows = {r["schedule"]: r for r in results if r["label"].startswith(
            f"{job['dataset']}/{job['batching']}/")}  # fmt: skip
        key = f"{job['dataset']}_{job['batching']}"
        ratios[f"{key}_epoch_speedup"] = (
            rows["round_robin"]["epoch_s"] / rows["cost_model"]["epoch_s"]
        )
    notes = [
        f"{REPLICAS} CPU replicas (1 thread each, gloo all-reduce per step), SchNet "
        f"{size.hidden_channels}x{size.num_interactions}, radius {size.cutoff}, about {batch} "
        f"molecules per batch; QM9 {len(jobs[0]['index'])} molecules, water {water_clusters} "
        f"clusters of {water_sizes[0]}-{water_sizes[1]}; {epochs} epochs per schedule; medians.",
    ]
    return common.new_report("balance", results, ratios, notes)
