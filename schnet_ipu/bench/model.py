"""Forward+backward speed of our SchNet against PyG's stock SchNet on identical molecules,
weights and interaction graphs: PyG gets our graph's real edges (precomputed, no
torch-cluster) and their lengths from ``pos`` (timed); our knn search is timed, which
favours PyG. The committed report: docs/benchmarks/model/; its figures:
docs/benchmarks/README.md."""

import numpy as np
import torch

from schnet_ipu.bench import common, pyg
from schnet_ipu.bench.batching import collate_groups
from schnet_ipu.data import MoleculeStore, edge_counts
from schnet_ipu.feed.layout import Layout
from schnet_ipu.packing import assign_packs, plan_packing

SIZE = common.PAPER_SIZE
# graph -> (pair_symmetric, filter) of our variants
SETTINGS = {"knn": [(True, "exact"), (True, "table")],
            "radius": [(True, "exact"), (False, "exact"), (True, "table")]}  # fmt: skip
COLUMNS = ["name", "ms_per_batch", "ms_min", "molecules_per_s", "speedup_vs_pyg",
           "speedup_vs_pyg_min"]  # fmt: skip
PLOT = ("name", "molecules_per_s", "forward+backward molecules/s")
QUICK = {"molecules": 128, "repeats": 3}
KNN_PACKS = {"max_nodes": 64, "max_graphs": 16}  # the knn batch's LPFHP packs


def one_batch(store: MoleculeStore, index: np.ndarray, algorithm: str, layout: dict) -> tuple:
    """``index`` packed by ``algorithm`` into one batch by the loader: (batch, packs, plan)."""
    nodes = store.num_atoms[index]
    edges = edge_counts(store, SIZE.cutoff)[index] if algorithm == "tuple" else None
    plan = plan_packing(nodes, edges, algorithm, **layout)
    packs = assign_packs(plan, nodes, edges, seed=0, epoch=0)
    shape = Layout.from_plan(plan, len(packs), SIZE.cutoff if algorithm == "tuple" else None)
    return collate_groups(store, index, [(packs, shape)])[0], packs, plan


def run(store: str, molecules: int = 512, repeats: int = 5) -> dict:
    qm9 = MoleculeStore(store)
    index = np.sort(np.random.default_rng(0).choice(len(qm9), molecules, replace=False))
    knn = one_batch(qm9, index, "lpfhp", KNN_PACKS)
    radius = one_batch(qm9, index, "tuple", {"target_efficiency": 0.97})
    max_nodes = KNN_PACKS["max_nodes"]
    hyper = {"k": SIZE.k, "max_nodes_per_pack": max_nodes}
    torch.manual_seed(0)
    reference = common.schnet(SIZE, **hyper, graph="knn")
    steps, edges = {}, {}
    for graph, (batch, _, _) in (("knn", knn), ("radius", radius)):
        for symmetric, filter_ in SETTINGS[graph]:
            ours = common.schnet(SIZE, **hyper, graph=graph, pair_symmetric=symmetric,
                                 filter=filter_)  # fmt: skip
            ours.load_state_dict(reference.state_dict())
            name = f"ours {graph}" + ("" if graph == "knn" else f" pair_symmetric={symmetric}")
            name += "" if filter_ == "exact" else " filter=table"
            steps[name] = common.fwd_bwd(ours, lambda m=ours, b=batch: m(b).sum(), molecules)
        edge_index, _, edge_mask = ours.interaction_graph(batch)
        real = batch.node_mask
        # PyG sees the plain molecules (real atoms only) and the real edges of our graph
        pyg_edges = (torch.cumsum(real.long(), 0) - 1)[edge_index[:, edge_mask]]
        stock = pyg.schnet(SIZE, lambda pos, _, e=pyg_edges: pyg.with_lengths(e, pos))
        stock.load_state_dict(reference.state_dict())
        args = (batch.z[real], batch.pos[real], batch.graph[real])
        steps[f"pyg {graph}"] = common.fwd_bwd(
            stock, lambda m=stock, a=args: m(*a).sum(), molecules
        )
        edges[graph] = {"ours": edge_index.shape[1], "real": int(edge_mask.sum())}
    rates = common.measure_side_by_side(steps, common.Timing(warmup=1, steps=1, repeats=repeats))
    rows, speedup = [], {}
    for name, rate in rates.items():
        row = {"name": name, "ms_per_batch": 1000 * rate.step_seconds,
               "ms_min": 1000 * min(rate.seconds), "molecules_per_s": rate.molecules_per_s,
               "ms_all": [round(1000 * x, 1) for x in rate.seconds]}  # fmt: skip
        if name.startswith("ours"):  # PyG's rows come after ours of the same graph
            pyg_rate = rates[f"pyg {name.split()[1]}"]
            row["speedup_vs_pyg"] = pyg_rate.step_seconds / rate.step_seconds
            row["speedup_vs_pyg_min"] = min(pyg_rate.seconds) / min(rate.seconds)
            speedup[name] = row["speedup_vs_pyg"]
        rows.append(row)
    (knn_batch, _, _), (_, radius_packs, radius_plan) = knn, radius
    notes = [
        f"{molecules} QM9 molecules ({int(qm9.num_atoms[index].sum())} atoms), "
        f"{torch.get_num_threads()} threads, median of {repeats} rounds; PyG gets our graph's "
        "real edges (precomputed) and their lengths from pos (timed); our knn search is timed.",
        f"knn k=24: {knn_batch.num_nodes // max_nodes} packs of {max_nodes} atoms; radius 6 A: "
        f"{len(radius_packs)} packs of {radius_plan.max_nodes} atoms / {radius_plan.max_edges} "
        f"edges; edge slots (ours) / real edges (PyG): {edges}.",
    ]
    return common.new_report("model", rows, speedup, notes)
