"""Limit search: efficiency against pack limit, and the smallest limit reaching a target."""

from __future__ import annotations

import numpy as np

from schnet_ipu.packing.lpfhp import lpfhp
from schnet_ipu.packing.tuple_packing import tuple_pack


def node_curve(
    histogram: np.ndarray, limits: range, max_graphs: int = 0
) -> list[tuple[int, float]]:
    """``(max_nodes, LPFHP node efficiency)`` for each limit (the largest molecule and up);
    ``histogram`` is int [S], molecules per atom count; max_graphs 0 = unlimited."""
    largest = int(np.flatnonzero(histogram)[-1])
    return [
        (limit, lpfhp(histogram, limit, max_graphs or limit).node_efficiency)
        for limit in limits
        if limit >= largest
    ]


def search_node_limit(histogram: np.ndarray, target: float, max_graphs: int = 0) -> int:
    """Smallest ``max_nodes`` whose LPFHP plan reaches ``target`` node efficiency, scanning
    from the largest molecule to ``max(128, 4 * largest)``; the most efficient if none does."""
    largest = int(np.flatnonzero(histogram)[-1])
    curve = node_curve(histogram, range(largest, max(128, 4 * largest) + 1), max_graphs)
    reached = [limit for limit, eff in curve if eff >= target - 1e-12]
    return reached[0] if reached else max(curve, key=lambda item: item[1])[0]


def _even_ceil(x: float) -> int:
    return int(np.ceil(x / 2) * 2)


def tuple_curve(
    pairs: np.ndarray,
    counts: np.ndarray,
    node_limits: list[int],
    max_graphs: int = 0,
    heuristic: str = "sum",
    max_edges: int = 0,
) -> list[tuple[int, int, float, float]]:
    """``(max_nodes, max_edges, node eff, edge eff)`` per node limit; ``max_edges`` 0 = the
    edge limit that matches the data's edges-per-atom ratio (even, >= the largest molecule)."""
    ratio = float((pairs[:, 1] * counts).sum() / (pairs[:, 0] * counts).sum())
    rows = []
    for nodes in node_limits:
        edges = max_edges or max(_even_ceil(nodes * ratio), _even_ceil(pairs[:, 1].max()), 2)
        plan = tuple_pack(pairs, counts, nodes, edges, max_graphs or nodes, heuristic)
        rows.append((nodes, edges, plan.node_efficiency, plan.edge_efficiency))
    return rows


def search_tuple_limits(
    pairs: np.ndarray,
    counts: np.ndarray,
    target: float,
    max_nodes: int = 0,
    max_edges: int = 0,
    max_graphs: int = 0,
    heuristic: str = "sum",
    step: int = 4,
) -> tuple[int, int]:
    """Smallest ``(max_nodes, max_edges)`` (by atoms, then edges) whose tuple plan reaches
    ``target`` for both node and edge efficiency; a given limit (non-zero) is kept. Falls
    back to the pair with the best worse-of-the-two efficiency.

    With the edge limit matched to the data's edges-per-atom ratio, node limits start where
    that edge limit holds the largest molecule. They are swept in steps of ``step`` atoms;
    below the first that reaches the target, the skipped limits are tried one by one. The
    curve is not monotone, so a smaller limit between two coarse points that both miss the
    target can be passed over; the cost is about ``range / step + step`` plans.
    """
    largest_n, largest_e = int(pairs[:, 0].max()), int(pairs[:, 1].max())
    ratio = float((pairs[:, 1] * counts).sum() / (pairs[:, 0] * counts).sum())
    if max_nodes:
        candidates = [max_nodes]
    else:
        fits_largest = int(np.ceil(largest_e / ratio)) if ratio and not max_edges else 0
        lowest = max(largest_n, fits_largest)
        candidates = list(range(lowest, max(128, 4 * largest_n, lowest) + 1))

    def row(nodes: int) -> tuple[int, int, float, float]:
        return tuple_curve(pairs, counts, [nodes], max_graphs, heuristic, max_edges)[0]

    def reaches(r: tuple[int, int, float, float]) -> bool:
        return min(r[2], r[3]) >= target - 1e-12

    tried = []
    for i in range(0, len(candidates), step):
        tried.append(row(candidates[i]))
        if reaches(tried[-1]):
            for nodes in candidates[max(i - step + 1, 0) : i]:
                if reaches(smaller := row(nodes)):
                    return smaller[0], smaller[1]
            return tried[-1][0], tried[-1][1]
    best = max(tried, key=lambda r: min(r[2], r[3]))
    return best[0], best[1]
