"""Dense vs sparse message passing: training molecules/s on QM9 and water, side by side,
through the real pipeline at each graph's default packing (both read the same packs).
The committed report: docs/benchmarks/dense/; its figures: docs/benchmarks/README.md."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from schnet_ipu.bench import common
from schnet_ipu.config import ModelConfig
from schnet_ipu.model.dense import dense_graph, pair_efficiency

GRAPHS = {"radius": "tuple", "knn": "lpfhp"}  # graph -> its default packing algorithm
WATER = ["data.source=water", "data.target=energy", "data.atomrefs=false"]
COLUMNS = ["dataset", "graph", "message_passing", "molecules_per_s", "step_ms", "max_nodes",
           "packs_per_batch", "pair_efficiency", "per_molecule_block_efficiency",
           "dense_vs_sparse"]  # fmt: skip
PLOT = ("label", "molecules_per_s", "training molecules/s")
QUICK = {"sample": 600, "water_clusters": 150, "water_sizes": (3, 10),
         "timing": common.Timing(warmup=1, steps=4, repeats=3)}  # fmt: skip


def variant(store: str, sample: int, size: ModelConfig, overrides: list[str], batch: int):
    """Row facts, the training step and the pair efficiencies of one configuration."""
    cfg, data, loader, backend = common.our_trainer(store, sample, size, overrides, batch)
    for index in data.split["train"].tolist():  # in memory before timing
        data.store.molecule(index)
    first = next(iter(loader.epoch(0)))[0]
    model, plan = backend.model, data.train_plan
    k = model.k if model.graph == "knn" else None
    _, mask = dense_graph(first, plan.max_nodes, model.cutoff, k)
    sizes = [int(n) for n in torch.bincount(first.graph[first.node_mask])]
    largest = int(data.store.num_atoms[data.split["train"]].max())
    if model.message_passing == "dense":
        efficiency = pair_efficiency(mask)
    elif model.graph == "knn":
        efficiency = int(mask.sum()) / (first.num_nodes * model.k)
    else:
        efficiency = int(first.edge_mask.sum()) / first.edge_mask.numel()
    row = {"max_nodes": plan.max_nodes, "packs_per_batch": cfg.packing.packs_per_batch,
           "pair_efficiency": efficiency,
           "per_molecule_block_efficiency": int(mask.sum()) / (len(sizes) * largest**2),
           "real_pairs": int(mask.sum()), "largest_molecule": largest}  # fmt: skip
    return row, common.training_step(loader, backend)


def run(
    store: str | Path = common.QM9_STORE, sample: int = 2000, water_clusters: int = 400,
    water_sizes: tuple[int, int] = (3, 20), batch_molecules: int = 32,
    size: ModelConfig = common.PAPER_SIZE, timing: common.Timing | None = None,
) -> dict:  # fmt: skip
    timing = timing or common.Timing(warmup=2, steps=6, repeats=3)
    rows, steps = [], {}
    with common.qm9_and_water(store, sample, water_clusters, water_sizes) as datasets:
        setups = {"qm9": (sample, []), "water": (int(0.9 * water_clusters) - 1, WATER)}
        for dataset, graph, layout in itertools.product(setups, GRAPHS, ("sparse", "dense")):
            count, extra = setups[dataset]
            overrides = [*extra, f"model.graph={graph}", f"packing.algorithm={GRAPHS[graph]}",
                         f"model.message_passing={layout}", "loader.workers=0"]  # fmt: skip
            label, path = f"{dataset}/{graph}/{layout}", str(datasets[dataset][0])
            row, steps[label] = variant(path, count, size, overrides, batch_molecules)
            row.update(dataset=dataset, graph=graph, message_passing=layout, label=label)
            rows.append(row)
        rates = common.measure_side_by_side(steps, timing)
    ratios = {}
    for row in rows:
        rate = rates[row["label"]]
        row.update(molecules_per_s=rate.molecules_per_s, step_ms=1000 * rate.step_seconds)
        if row["message_passing"] == "dense":
            sparse = rates[row["label"].replace("/dense", "/sparse")].molecules_per_s
            row["dense_vs_sparse"] = row["molecules_per_s"] / sparse
            ratios[f"{row['dataset']}_{row['graph']}_dense_vs_sparse"] = row["dense_vs_sparse"]
    notes = [
        f"QM9 {sample} molecules; water {water_clusters} clusters of {water_sizes[0]}-"
        f"{water_sizes[1]}; SchNet {size.hidden_channels}x{size.num_interactions}, cutoff "
        f"{size.cutoff}, k={size.k}; about {batch_molecules} molecules per step; "
        f"{torch.get_num_threads()} threads; {timing.repeats} rounds of {timing.steps} steps.",
        "pair_efficiency: real pairs / computed (sparse: edge slots; dense: B M^2); "
        "per_molecule_block_efficiency: real pairs / (molecules x S^2), S the largest molecule.",
    ]
    return common.new_report("dense", rows, ratios, notes)
