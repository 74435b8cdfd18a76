"""Every batching algorithm of the packing library on QM9 and synthetic water clusters: node
and edge efficiency, distinct batch shapes per epoch (= static-shape recompilations) and
SchNet's measured fwd+bwd on real batches of the most frequent shapes, weighted into an epoch.
The committed report: docs/benchmarks/batching/; its figures: docs/benchmarks/README.md."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from schnet_ipu.batch import Batch
from schnet_ipu.bench import common
from schnet_ipu.config import ModelConfig
from schnet_ipu.data import MoleculeStore, edge_counts
from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.feed.dataset import PackedDataset
from schnet_ipu.feed.layout import Layout
from schnet_ipu.packing import assign_packs, plan_packing
from schnet_ipu.packing.padded_batches import BASELINES, run_baseline
from schnet_ipu.task import masked_mse

PACKERS = ("lpfhp", "tuple", "pad_to_max")
QUICK = {"sample": 1000, "water_clusters": 100, "water_sizes": (3, 8), "batch_sizes": (32,),
         "max_shapes": 2, "repeats": 3}  # fmt: skip
COLUMNS = ["dataset", "algorithm", "batch", "node_efficiency", "edge_efficiency",
           "distinct_shapes", "batches", "step_ms", "molecules_per_s",
           "timed_coverage"]  # fmt: skip
PLOT = ("label", "molecules_per_s", "estimated training molecules/s (fwd+bwd)")


def epoch_batches(
    algorithm: str, nodes: np.ndarray, edges: np.ndarray, batch: int, cutoff: float
) -> tuple[list[tuple[list[np.ndarray], Layout]], float, float | None]:
    """One epoch of ``algorithm``, ``batch`` molecules a batch: [(packs, layout)], efficiencies."""
    if algorithm in BASELINES:
        result = run_baseline(algorithm, nodes, edges, batch, seed=0)
        batches = [([b], Layout(1, shape[0], shape[2], shape[1], cutoff))
                   for b, shape in zip(result.batches, result.shapes)]  # fmt: skip
        return batches, result.node_efficiency, result.edge_efficiency
    plan = plan_packing(nodes, edges if algorithm != "lpfhp" else None, algorithm)
    packs = assign_packs(plan, nodes, edges if algorithm != "lpfhp" else None, seed=0, epoch=0)
    per_batch = max(1, round(batch * plan.num_packs / len(nodes)))
    # a node-only packing (LPFHP) on a radius graph needs its fullest pack's edges
    max_edges = plan.max_edges or int(max(edges[p].sum() for p in packs)) or 2
    layout = Layout(per_batch, plan.max_nodes, plan.max_graphs, max_edges, cutoff)
    batches = [(packs[i : i + per_batch], layout) for i in range(0, len(packs), per_batch)]
    return batches, plan.node_efficiency, float(edges.sum() / (len(packs) * max_edges))


def collate_groups(
    store: MoleculeStore, index: np.ndarray, groups: list[tuple[list[np.ndarray], Layout]],
    arrays: FeedArrays | None = None,
) -> list[Batch]:  # fmt: skip
    """Each (packs of positions in ``index``, layout) as a batch by the loader's collate."""
    any_plan = plan_packing(store.num_atoms[index], None, "pad_to_max")  # collate never reads it
    targets = np.zeros(len(store))
    return [PackedDataset(store, index, targets, any_plan, layout, 0, arrays=arrays)
            .collate([index[p] for p in packs]) for packs, layout in groups]  # fmt: skip


def bench_dataset(
    name: str, store: MoleculeStore, index: np.ndarray, size: ModelConfig,
    batch_sizes: tuple[int, ...], max_shapes: int, repeats: int,
) -> list[dict]:  # fmt: skip
    """Every algorithm and batch size, timed on a batch of each of its frequent shapes."""
    nodes = store.num_atoms[index]
    edges = edge_counts(store, size.cutoff)[index]
    torch.manual_seed(0)
    model = common.schnet(size, graph="radius", pair_symmetric=True)
    rows, shapes, probes = [], {}, {}  # probes: (label, shape) -> (packs, layout)
    for batch, algorithm in itertools.product(batch_sizes, (*PACKERS, *BASELINES)):
        batches, node_eff, edge_eff = epoch_batches(algorithm, nodes, edges, batch, size.cutoff)
        label = f"{name}/{algorithm}/{batch}"
        shapes[label] = Counter(layout for _, layout in batches)  # a layout is a batch shape
        rows.append({"label": label, "dataset": name, "algorithm": algorithm, "batch": batch,
                     "node_efficiency": node_eff, "edge_efficiency": edge_eff,
                     "distinct_shapes": len(shapes[label]), "batches": len(batches)})  # fmt: skip
        first = {layout: (packs, layout) for packs, layout in reversed(batches)}
        for shape, _ in shapes[label].most_common(max_shapes):  # its first batch of the shape
            probes[label, shape] = first[shape]
    batches = collate_groups(store, index, list(probes.values()))
    steps = {
        str(key): common.fwd_bwd(model, lambda b=b: masked_mse(model(b), b.y, b.graph_mask, 1.0))
        for key, b in zip(probes, batches)
    }
    rates = common.measure_side_by_side(steps, common.Timing(warmup=1, steps=1, repeats=repeats))
    for row in rows:
        counts = shapes[row["label"]]
        timed = {key[1]: rates[str(key)].step_seconds for key in probes if key[0] == row["label"]}
        covered = sum(counts[s] for s in timed)
        mean_step = sum(timed[s] * counts[s] for s in timed) / covered
        epoch = mean_step * row["batches"]
        row.update(step_ms=1000 * mean_step, molecules_per_s=len(index) / epoch,
                   timed_shapes=len(timed), timed_coverage=covered / row["batches"])  # fmt: skip
    return rows


def run(
    store: str | Path = common.QM9_STORE, sample: int = 5000, water_clusters: int = 300,
    water_sizes: tuple[int, int] = (3, 20), size: ModelConfig = common.PAPER_SIZE,
    batch_sizes: tuple[int, ...] = (16, 32, 64), max_shapes: int = 6, repeats: int = 3,
) -> dict:  # fmt: skip
    results = []
    with common.qm9_and_water(store, sample, water_clusters, water_sizes) as datasets:
        for name, (path, index) in datasets.items():
            molecules = MoleculeStore(path)
            results += bench_dataset(name, molecules, index, size, batch_sizes, max_shapes, repeats)
    best = {}
    for dataset in ("qm9", "water"):
        rows = [r for r in results if r["dataset"] == dataset]
        best[f"{dataset}_fastest"] = max(rows, key=lambda r: r["molecules_per_s"])["label"]
        for batch in batch_sizes:
            rate = {r["algorithm"]: r["molecules_per_s"] for r in rows if r["batch"] == batch}
            best[f"{dataset}_{batch}_tuple_vs_pad_to_max"] = rate["tuple"] / rate["pad_to_max"]
            best[f"{dataset}_{batch}_lpfhp_vs_dynamic"] = rate["lpfhp"] / rate["dynamic"]
    notes = [
        f"QM9: {len(datasets['qm9'][1])} molecules (fixed sample); water: {water_clusters} "
        f"clusters of {water_sizes[0]}-{water_sizes[1]}; batch = molecules per batch.",
        f"step_ms: fwd+bwd of SchNet {size.hidden_channels}x{size.num_interactions} (radius "
        f"{size.cutoff}) on a real batch of the {max_shapes} most frequent shapes, median of "
        f"{repeats} rounds, weighted by shape frequency (timed_coverage: the share covered); "
        "lpfhp's edge room is its fullest pack's; distinct_shapes = static-shape compiles.",
    ]
    return common.new_report("batching", results, best, notes)
