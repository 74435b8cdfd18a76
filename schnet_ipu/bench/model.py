"""Forward+backward speed of our SchNet against PyG's stock SchNet on identical molecules.

    python -m schnet_ipu.bench.model [--molecules 512] [--repeats 5] [--store data/qm9.h5]

Both models get the same weights, the same molecules and the same interaction graph. PyG's
default radius graph needs torch-cluster, which is not installed, so PyG is given an
``interaction_graph`` callable in pure torch that returns the real edges of our graph
(precomputed outside the timed region) and their lengths from ``pos`` (inside it). Our knn
search runs inside the timed forward pass, so the comparison favours PyG.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.batch import Batch
from schnet_ipu.bench.common import new_report
from schnet_ipu.collate import PackMolecule, collate
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.layout import Layout
from schnet_ipu.model.schnet import SchNet
from schnet_ipu.packing import assign_packs, plan_packing

Molecule = "tuple[np.ndarray, np.ndarray]"  # z [n] (int), pos [n, 3] (A); string: Python 3.8


def molecules_to_batch(
    molecules: Sequence[Molecule],
    packs: Sequence[Sequence[int]],
    max_nodes: int,
    max_graphs: int,
    max_edges: int | None = None,
    cutoff: float = 6.0,
    targets: Sequence[float] | None = None,
) -> Batch:
    """Collate ``packs`` (lists of indices into ``molecules``) with the loader's collate;
    radius edges (within ``cutoff``) when ``max_edges`` is given. For tests and benchmarks
    on molecules held in memory."""
    layout = Layout(
        len(packs), max_nodes, max_graphs, max_edges, None if max_edges is None else cutoff
    )
    chosen = [
        [
            PackMolecule(
                np.asarray(molecules[m][0]),
                np.asarray(molecules[m][1], dtype=np.float32),
                0.0 if targets is None else float(targets[m]),
                int(m),
            )
            for m in pack
        ]
        for pack in packs
    ]
    return collate(chosen, layout)


def pair_array(pos: np.ndarray, cutoff: float) -> np.ndarray:
    """Unordered pairs (i < j) of one molecule within ``cutoff`` -> int64 [P, 2]."""
    i, j = molecule_pairs(torch.as_tensor(np.asarray(pos, dtype=np.float32)), cutoff)
    return torch.stack([i, j], dim=1).numpy()


def plan_packs(
    sizes: Sequence[int],
    max_nodes: int,
    max_graphs: int,
    edges: Sequence[int] | None = None,
    max_edges: int = 0,
) -> list[np.ndarray]:
    """Packs of molecule indices from the packing library: LPFHP over atoms, or tuple
    packing over (atoms, directed ``edges``) when edges are given."""
    nodes = np.asarray(sizes)
    edge_counts = None if edges is None else np.asarray(edges)
    plan = plan_packing(
        nodes,
        edge_counts,
        algorithm="lpfhp" if edges is None else "tuple",
        max_nodes=max_nodes,
        max_edges=max_edges,
        max_graphs=max_graphs,
    )
    return assign_packs(plan, nodes, edge_counts, seed=0, epoch=0)


def load_molecules(store: str, count: int, seed: int) -> list[Molecule]:
    """``count`` distinct molecules drawn at random (``seed``) from a MoleculeStore."""
    from schnet_ipu.data import MoleculeStore

    molecules = MoleculeStore(store)
    chosen = np.random.default_rng(seed).choice(len(molecules), count, replace=False)
    return [molecules.molecule(int(i)) for i in np.sort(chosen)]


def _time_step(model: torch.nn.Module, args: tuple) -> float:
    """Seconds for one forward + backward pass (loss = sum of the predictions)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(*args).sum().backward()
    return time.perf_counter() - start


def run_benchmark(
    molecules: int = 512,
    repeats: int = 5,
    store: str = "data/qm9.h5",
    max_nodes: int = 64,
    max_graphs: int = 16,
    seed: int = 0,
    filter_points: int = 256,
) -> dict:
    """Time forward+backward of our SchNet and PyG's on the same molecules, same weights and
    the same interaction graphs; the variants run interleaved, ``repeats`` rounds after one
    warm-up round, and the median is reported. ``filter=table`` rows tabulate the filter on
    ``filter_points`` grid points. Returns the numbers as a dict."""
    from torch_geometric.nn.models import SchNet as PygSchNet

    hyper = dict(hidden_channels=100, num_filters=100, num_interactions=4, num_gaussians=25)
    cutoff, k = 6.0, 24
    mols = load_molecules(store, molecules, seed)
    sizes = [len(z) for z, _ in mols]
    edges = np.array([2 * len(pair_array(pos, cutoff)) for _, pos in mols])
    knn_packs = plan_packs(sizes, max_nodes, max_graphs)
    knn_batch = molecules_to_batch(mols, knn_packs, max_nodes, max_graphs)
    # radius graphs: tuple packing with the limits its search picks, as training does
    plan = plan_packing(np.asarray(sizes), edges, algorithm="tuple", target_efficiency=0.97)
    radius_packs = assign_packs(plan, np.asarray(sizes), edges, seed=0, epoch=0)
    radius_batch = molecules_to_batch(
        mols, radius_packs, plan.max_nodes, plan.max_graphs, plan.max_edges, cutoff
    )

    torch.manual_seed(seed)
    reference = SchNet(**hyper, cutoff=cutoff, graph="knn", k=k, max_nodes_per_pack=max_nodes)
    variants: dict[str, tuple[torch.nn.Module, tuple]] = {}
    edges: dict[str, dict[str, int]] = {}
    settings = {  # graph -> (pair_symmetric, filter) of our variants
        "knn": [(True, "exact"), (True, "table")],
        "radius": [(True, "exact"), (False, "exact"), (True, "table")],
    }
    for graph, batch in (("knn", knn_batch), ("radius", radius_batch)):
        for symmetric, filter_ in settings[graph]:
            ours = SchNet(
                **hyper,
                cutoff=cutoff,
                graph=graph,
                k=k,
                pair_symmetric=symmetric,
                max_nodes_per_pack=max_nodes,
                filter=filter_,
                filter_points=filter_points,
            )
            ours.load_state_dict(reference.state_dict())
            name = f"ours {graph}" + ("" if graph == "knn" else f" pair_symmetric={symmetric}")
            variants[name + ("" if filter_ == "exact" else " filter=table")] = (ours, (batch,))
        edge_index, _, edge_mask = ours.interaction_graph(batch)
        real = batch.node_mask
        # PyG sees the plain molecules (real atoms only) and the real edges of our graph
        renumber = torch.cumsum(real.long(), 0) - 1
        pyg_edges = renumber[edge_index[:, edge_mask]]

        def interaction_graph(pos: Tensor, batch: Tensor, e: Tensor = pyg_edges):
            return e, (pos[e[0]] - pos[e[1]]).norm(dim=-1)

        pyg = PygSchNet(**hyper, cutoff=cutoff, interaction_graph=interaction_graph)
        pyg.load_state_dict(reference.state_dict())
        variants[f"pyg {graph}"] = (pyg, (batch.z[real], batch.pos[real], batch.graph[real]))
        edges[graph] = {"ours": edge_index.shape[1], "real": int(edge_mask.sum())}

    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name, (model, args) in variants.items():
            seconds = _time_step(model, args)
            if round_:  # round 0 warms up
                times[name].append(seconds)
    results = {
        name: {
            "ms_per_batch": 1000 * float(np.median(t)),
            "ms_min": 1000 * min(t),
            "molecules_per_s": molecules / float(np.median(t)),
            "ms_all": [round(1000 * x, 1) for x in t],
        }
        for name, t in times.items()
    }
    ratios = {
        name: results[f"pyg {name.split()[1]}"]["ms_per_batch"] / r["ms_per_batch"]
        for name, r in results.items()
        if name.startswith("ours")
    }
    ratios_min = {
        name: results[f"pyg {name.split()[1]}"]["ms_min"] / r["ms_min"]
        for name, r in results.items()
        if name.startswith("ours")
    }
    return {
        "molecules": molecules,
        "atoms": sum(sizes),
        "threads": torch.get_num_threads(),
        "hyperparameters": {**hyper, "cutoff": cutoff, "k": k, "filter_points": filter_points},
        "packs": {
            "max_nodes": max_nodes,
            "max_graphs": max_graphs,
            "radius_max_nodes": plan.max_nodes,
            "radius_max_edges": plan.max_edges,
            "knn_packs": knn_batch.num_nodes // max_nodes,
            "radius_packs": len(radius_packs),
            "node_slots_knn": knn_batch.num_nodes,
        },
        "edges": edges,
        "results": results,
        "speedup_vs_pyg": ratios,
        "speedup_vs_pyg_min": ratios_min,
        "note": PYG_NOTE,
    }


PYG_NOTE = (
    "PyG's default radius graph needs torch-cluster (not installed): PyG is given an "
    "interaction_graph callable in pure torch returning the real edges of our graph "
    "(precomputed, not timed) and their lengths from pos (timed). Our knn search is timed."
)


COLUMNS = ["name", "ms_per_batch", "ms_min", "molecules_per_s", "speedup_vs_pyg",
           "speedup_vs_pyg_min"]  # fmt: skip
PLOT = ("name", "molecules_per_s", "forward+backward molecules/s")


def run(quick: bool, store: str) -> dict:
    """The bench suite: 512 molecules and 5 rounds (``quick``: 128 and 3)."""
    molecules, repeats = (128, 3) if quick else (512, 5)
    report = run_benchmark(molecules, repeats, store)
    rows = [
        {
            "name": name,
            **r,
            "speedup_vs_pyg": report["speedup_vs_pyg"].get(name),
            "speedup_vs_pyg_min": report["speedup_vs_pyg_min"].get(name),
        }
        for name, r in report["results"].items()
    ]
    edges, packs = report["edges"], report["packs"]
    notes = [
        f"{report['molecules']} QM9 molecules ({report['atoms']} atoms), "
        f"{report['threads']} threads, forward+backward, median of {repeats} rounds.",
        f"knn k=24: {packs['knn_packs']} packs of {packs['max_nodes']} atoms, "
        f"{edges['knn']['ours']} edge slots (ours), {edges['knn']['real']} real edges (PyG).",
        f"radius 6 A: {packs['radius_packs']} packs of {packs['radius_max_nodes']} atoms and "
        f"{packs['radius_max_edges']} edges, {edges['radius']['ours']} edge slots (ours), "
        f"{edges['radius']['real']} real edges (PyG).",
        report["note"],
    ]
    return new_report("model", rows, report["speedup_vs_pyg"], notes)
