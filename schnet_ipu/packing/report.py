"""Packing report for a molecule store: every algorithm side by side, curves and plots."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from schnet_ipu.packing.lpfhp import lpfhp
from schnet_ipu.packing.padded_batches import BASELINES, run_baseline
from schnet_ipu.packing.plan import plan_packing
from schnet_ipu.packing.search import node_curve, tuple_curve
from schnet_ipu.packing.strategy import PackPlan
from schnet_ipu.packing.tuple_packing import HEURISTICS, VARIANTS, pair_histogram, tuple_pack


def _timed(fn, *args, **kwargs) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def _plan_row(plan: PackPlan, molecules: int, packs_per_batch: int, seconds: float) -> dict:
    batches = math.ceil(plan.num_packs / packs_per_batch)
    return {
        "node_efficiency": plan.node_efficiency,
        "edge_efficiency": plan.edge_efficiency,
        "max_nodes": plan.max_nodes,
        "max_edges": plan.max_edges,
        "max_graphs": plan.max_graphs,
        "batches": batches,
        "graphs_per_batch": molecules / batches,
        "distinct_shapes": 1,
        "plan_seconds": seconds,
        "packs": plan.num_packs,
        "templates": len(plan.templates),
    }


def build_report(
    node_counts: np.ndarray,
    edge_counts: np.ndarray,
    packs_per_batch: int = 8,
    batch_graphs: int = 0,
    target: float = 0.985,
    tuple_target: float = 0.97,
) -> dict[str, Any]:
    """All numbers of the report for molecules with ``node_counts`` / ``edge_counts`` (int
    [M]). ``batch_graphs`` 0 = the baselines take as many molecules per batch as LPFHP."""
    molecules = len(node_counts)
    histogram = np.bincount(node_counts)
    pairs, counts = pair_histogram(node_counts, edge_counts)
    algorithms: dict[str, dict] = {}

    lp_auto, lp_search = _timed(plan_packing, node_counts, target_efficiency=target)
    _, lp_seconds = _timed(lpfhp, histogram, lp_auto.max_nodes, lp_auto.max_nodes)
    algorithms["lpfhp"] = _plan_row(lp_auto, molecules, packs_per_batch, lp_seconds)
    algorithms["lpfhp"]["search_seconds"] = lp_search

    tp_auto, tp_search = _timed(
        plan_packing, node_counts, edge_counts, "tuple", target_efficiency=tuple_target
    )
    _, tp_seconds = _timed(
        tuple_pack, pairs, counts, tp_auto.max_nodes, tp_auto.max_edges, tp_auto.max_nodes
    )
    algorithms["tuple"] = _plan_row(tp_auto, molecules, packs_per_batch, tp_seconds)
    algorithms["tuple"]["search_seconds"] = tp_search

    pad, pad_seconds = _timed(plan_packing, node_counts, edge_counts, "pad_to_max")
    algorithms["pad_to_max"] = _plan_row(pad, molecules, packs_per_batch, pad_seconds)

    batch_graphs = batch_graphs or round(algorithms["lpfhp"]["graphs_per_batch"])
    for name in BASELINES:
        result, seconds = _timed(run_baseline, name, node_counts, edge_counts, batch_graphs)
        algorithms[name] = {
            "node_efficiency": result.node_efficiency,
            "edge_efficiency": result.edge_efficiency,
            "max_nodes": result.max_nodes,
            "max_edges": result.max_edges,
            "max_graphs": result.max_graphs,
            "batches": len(result.batches),
            "graphs_per_batch": molecules / len(result.batches),
            "distinct_shapes": result.distinct_shapes,
            "plan_seconds": seconds,
        }

    variants = {}
    for heuristic in HEURISTICS:
        for variant in VARIANTS:
            plan, seconds = _timed(
                tuple_pack,
                pairs,
                counts,
                tp_auto.max_nodes,
                tp_auto.max_edges,
                tp_auto.max_nodes,
                heuristic,
                variant,
            )
            variants[f"{heuristic}/{variant}"] = {
                "node_efficiency": plan.node_efficiency,
                "edge_efficiency": plan.edge_efficiency,
                "packs": plan.num_packs,
                "plan_seconds": seconds,
            }
    return {
        "molecules": molecules,
        "packs_per_batch": packs_per_batch,
        "batch_graphs": batch_graphs,
        "algorithms": algorithms,
        "tuple_variants": variants,
        "node_curve": node_curve(histogram, range(29, 129)),
        "tuple_curve": tuple_curve(pairs, counts, list(range(int(pairs[:, 0].max()), 129, 4))),
        "histogram": histogram.tolist(),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as text: algorithm table, tuple heuristics, node and tuple curves."""

    def pct(x: float | None) -> str:
        return "   -  " if x is None else f"{100 * x:6.2f}"

    lines = [
        f"{report['dataset']}: {report['molecules']} molecules; packed batches hold "
        f"{report['packs_per_batch']} packs, baselines {report['batch_graphs']} molecules",
        f"{'algorithm':16} {'node%':>6} {'edge%':>6} {'nodes':>6} {'edges':>6} {'graphs':>6} "
        f"{'batches':>8} {'mol/batch':>9} {'shapes':>6} {'plan s':>8}",
    ]
    for name, row in report["algorithms"].items():
        lines.append(
            f"{name:16} {pct(row['node_efficiency'])} {pct(row['edge_efficiency'])} "
            f"{row['max_nodes']:6d} {row['max_edges'] or 0:6d} {row['max_graphs']:6d} "
            f"{row['batches']:8d} {row['graphs_per_batch']:9.1f} {row['distinct_shapes']:6d} "
            f"{row['plan_seconds']:8.4f}"
        )
    tp = report["algorithms"]["tuple"]
    lines.append(f"\ntuple heuristics at max_nodes={tp['max_nodes']}, max_edges={tp['max_edges']}:")
    for name, row in report["tuple_variants"].items():
        lines.append(
            f"  {name:20} node {pct(row['node_efficiency'])}%  edge {pct(row['edge_efficiency'])}%"
            f"  packs {row['packs']:7d}  {row['plan_seconds']:.3f} s"
        )
    lines.append("\nLPFHP node efficiency by max_nodes:")
    lines += [f"  {limit:4d} {pct(eff)}%" for limit, eff in report["node_curve"]]
    lines.append("\ntuple packing (product, best fit) by max_nodes, edges matched to the data:")
    lines += [
        f"  {n:4d} {e:6d}  node {pct(ne)}%  edge {pct(ee)}%"
        for n, e, ne, ee in report["tuple_curve"]
    ]
    return "\n".join(lines)


def write_plots(report: dict[str, Any], node_counts, edge_counts, out_dir: Path) -> list[Path]:
    """Size histograms and efficiency-vs-limit curves as PNGs in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(np.arange(len(report["histogram"])), report["histogram"])
    ax1.set(xlabel="atoms per molecule", ylabel="molecules", title=report["dataset"])
    ax2.hist(edge_counts, bins=60)
    ax2.set(xlabel="directed edges per molecule", ylabel="molecules")
    fig.tight_layout()
    paths = [out_dir / "size_histogram.png"]
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    curve = np.array(report["node_curve"], dtype=float)  # (limit, efficiency) rows
    ax.plot(curve[:, 0], 100 * curve[:, 1], label="LPFHP node efficiency")
    rows = np.array(report["tuple_curve"], dtype=float)
    ax.plot(rows[:, 0], 100 * rows[:, 2], "o-", ms=3, label="tuple: node efficiency")
    ax.plot(rows[:, 0], 100 * rows[:, 3], "s-", ms=3, label="tuple: edge efficiency")
    pad = report["algorithms"]["pad_to_max"]["node_efficiency"]
    ax.axhline(100 * pad, color="grey", ls="--", label="pad to max")
    ax.set(xlabel="max_nodes per pack", ylabel="efficiency %", ylim=(50, 100.5))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "efficiency_vs_limit.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def main(args) -> None:
    """CLI entry: ``report STORE [--cutoff C] [--json PATH] [--out-dir DIR]``."""
    from schnet_ipu.data import MoleculeStore, edge_counts

    store = MoleculeStore(args.store)
    node_counts = np.asarray(store.num_atoms, dtype=np.int64)
    edges = np.asarray(edge_counts(store, args.cutoff), dtype=np.int64)
    report = build_report(node_counts, edges, args.packs_per_batch, args.batch_graphs)
    report = {"dataset": str(args.store), "cutoff": args.cutoff, **report}
    print(format_report(report))
    for path in write_plots(report, node_counts, edges, Path(args.out_dir)):
        print(f"wrote {path}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
