"""Tuple packing: pack molecules by (atoms, edges) for radius graphs whose edge counts vary.

Works on the 2-D histogram of ``(atoms, edges)`` pairs. A monotone *heuristic* ``h`` maps a
pair, normalised by the limits (``atoms / max_nodes``, ``edges / max_edges``), to one number.
Pairs are packed in decreasing ``h``; the room left in a pack is measured with the same ``h``.

* ``best_fit`` (longest-pack-first): a pair goes to the fitting pack with the least room.
  That pack stays the tightest, so it takes as many copies as fit, block by block.
* ``first_fit`` (shortest-pack-first): a pair goes to the fitting pack with the most room.
  After one copy that pack is no longer the roomiest of its group, so a block of packs
  takes one copy each.

In both, a pair that fits nowhere opens new packs holding as many copies as fit. Packs with
identical contents are one group with a count, so each step moves a whole block.

* ``balanced`` fills one pack at a time. The next molecule is the one of largest ``h`` that
  fits, penalised by how far it pulls the pack's atom fill and edge fill apart. Decreasing
  order alone cannot fill both: when edges grow faster than atoms (QM9's edges go roughly
  as atoms squared), packs of large molecules run out of edges with atoms to spare and packs
  of small ones the reverse, capping both efficiencies near 94% on QM9. Mixing large and
  small molecules in every pack lifts both above 97%. A finished pack is repeated as long as
  every pair it holds has enough copies left, which gives exactly what filling those packs
  one by one would, at histogram speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Tuple

import numpy as np

from schnet_ipu.packing.strategy import PackingError, PackPlan, make_plan

Pair = Tuple[int, int]  # typing form: a runtime alias on Python 3.8 (the SDK's)

HEURISTICS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "product": lambda n, e: n * e,
    "sum": lambda n, e: n + e,
    "max": np.maximum,
    "min": np.minimum,
    "nodes": lambda n, e: n,
    "edges": lambda n, e: e,
}
VARIANTS = ("balanced", "best_fit", "first_fit")
BALANCE_PENALTY = 3.0  # balanced: weight of |atom fill - edge fill| against the size h


def pair_histogram(
    node_counts: np.ndarray, edge_counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ``(atoms, edges)`` pairs (int [K, 2], ascending) and their counts (int [K])."""
    pairs, counts = np.unique(
        np.stack([node_counts, edge_counts], axis=1), axis=0, return_counts=True
    )
    return pairs.astype(np.int64), counts.astype(np.int64)


def _score(heuristic: str, nodes, edges, max_nodes: int, max_edges: int) -> np.ndarray:
    """``h`` of normalised sizes, with a tiny sum term so that ties break consistently."""
    n = np.asarray(nodes, dtype=np.float64) / max_nodes
    e = np.asarray(edges, dtype=np.float64) / max(max_edges, 1)
    return HEURISTICS[heuristic](n, e) + 1e-9 * (n + e)


class _Groups:
    """Open pack groups in flat arrays, for vectorised fit tests: free atoms, free edges,
    molecules held, packs in the group, and the heuristic score of the free room."""

    def __init__(self, capacity: int) -> None:
        self.free_n = np.zeros(capacity, dtype=np.int64)
        self.free_e = np.zeros(capacity, dtype=np.int64)
        self.graphs = np.zeros(capacity, dtype=np.int64)
        self.packs = np.zeros(capacity, dtype=np.int64)
        self.score = np.zeros(capacity, dtype=np.float64)
        self.templates: list[tuple[Pair, ...]] = []
        self.index: dict[tuple[Pair, ...], int] = {}

    def add(self, template: tuple[Pair, ...], packs: int, free: Pair, score: float) -> None:
        if template in self.index:
            self.packs[self.index[template]] += packs
            return
        i = len(self.templates)
        if i == len(self.packs):
            for name in ("free_n", "free_e", "graphs", "packs", "score"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
        self.free_n[i], self.free_e[i] = free
        self.graphs[i], self.packs[i], self.score[i] = len(template), packs, score
        self.templates.append(template)
        self.index[template] = i


def tuple_pack(
    pairs: np.ndarray,
    counts: np.ndarray,
    max_nodes: int,
    max_edges: int,
    max_graphs: int,
    heuristic: str = "product",
    variant: str = "balanced",
) -> PackPlan:
    """Pack ``counts[k]`` molecules of ``pairs[k] = (atoms, edges)`` (int [K, 2], [K]) into
    packs of at most ``max_nodes`` atoms, ``max_edges`` edges and ``max_graphs`` molecules."""
    if heuristic not in HEURISTICS:
        raise PackingError(f"heuristic={heuristic!r} is not one of {', '.join(HEURISTICS)}")
    if variant not in VARIANTS:
        raise PackingError(f"variant={variant!r} is not one of {', '.join(VARIANTS)}")
    if max_graphs < 1:
        raise PackingError(f"max_graphs={max_graphs} must be >= 1")
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    counts = np.asarray(counts, dtype=np.int64)
    if len(pairs) == 0 or pairs[:, 0].min() < 1 or pairs[:, 1].min() < 0 or counts.min() < 1:
        raise PackingError("pairs need >= 1 atom and >= 0 edges, counts >= 1")
    for axis, limit, name in ((0, max_nodes, "max_nodes"), (1, max_edges, "max_edges")):
        if pairs[:, axis].max() > limit:
            raise PackingError(
                f"molecules of {pairs[:, axis].max()} {name[4:]} exceed {name}={limit}; "
                f"raise {name} to at least {pairs[:, axis].max()}"
            )
    if variant == "balanced":
        packs = _balanced(pairs, counts, max_nodes, max_edges, max_graphs, heuristic)
        templates = sorted(packs, reverse=True)
        return make_plan(
            "tuple", max_nodes, max_edges, max_graphs, templates, [packs[t] for t in templates]
        )
    min_n, min_e = int(pairs[:, 0].min()), int(pairs[:, 1].min())
    order = np.lexsort(
        (pairs[:, 1], pairs[:, 0], _score(heuristic, *pairs.T, max_nodes, max_edges))
    )
    groups = _Groups(2 * len(pairs) + 16)
    closed: dict[tuple[Pair, ...], int] = {}

    def place(template: tuple[Pair, ...], packs: int) -> None:
        free_n = max_nodes - sum(n for n, _ in template)
        free_e = max_edges - sum(e for _, e in template)
        if len(template) == max_graphs or free_n < min_n or free_e < min_e:
            closed[template] = closed.get(template, 0) + packs
        else:
            score = float(_score(heuristic, free_n, free_e, max_nodes, max_edges))
            groups.add(template, packs, (free_n, free_e), score)

    for k in order[::-1].tolist():
        n, e = int(pairs[k, 0]), int(pairs[k, 1])
        left = int(counts[k])
        while left:
            size = len(groups.templates)
            fits = (
                (groups.packs[:size] > 0)
                & (groups.free_n[:size] >= n)
                & (groups.free_e[:size] >= e)
                & (groups.graphs[:size] < max_graphs)
            )
            if fits.any():
                score = groups.score[:size]
                if variant == "best_fit":
                    i = int(np.where(fits, score, np.inf).argmin())
                else:
                    i = int(np.where(fits, score, -np.inf).argmax())
                template, available = groups.templates[i], int(groups.packs[i])
                free_n, free_e = int(groups.free_n[i]), int(groups.free_e[i])
            else:  # nothing fits: open new, empty packs
                i, template, available, free_n, free_e = -1, (), left, max_nodes, max_edges
            per_pack = min(
                free_n // n, free_e // e if e else max_graphs, max_graphs - len(template)
            )
            if template and variant == "first_fit":
                per_pack = 1
            full = min(available, left // per_pack)
            rest = left - full * per_pack
            partial = full < available and rest > 0
            if i >= 0:
                groups.packs[i] -= full + int(partial)
            if full:
                place(template + ((n, e),) * per_pack, full)
            if partial:
                place(template + ((n, e),) * rest, 1)
            left = 0 if partial else rest

    packs = dict(closed)
    for template, count in zip(groups.templates, groups.packs.tolist()):
        if count:
            packs[template] = packs.get(template, 0) + count
    templates = sorted(packs, reverse=True)
    return make_plan(
        "tuple", max_nodes, max_edges, max_graphs, templates, [packs[t] for t in templates]
    )


def _balanced(
    pairs: np.ndarray,
    counts: np.ndarray,
    max_nodes: int,
    max_edges: int,
    max_graphs: int,
    heuristic: str,
) -> dict[tuple[Pair, ...], int]:
    """The ``balanced`` variant: pack templates (tuples of pairs) -> number of packs."""
    left = counts.copy()
    fill_n = pairs[:, 0] / max_nodes  # [K] share of a pack's atoms one molecule takes
    fill_e = pairs[:, 1] / max(max_edges, 1)
    size = _score(heuristic, pairs[:, 0], pairs[:, 1], max_nodes, max_edges)
    packs: dict[tuple[Pair, ...], int] = {}
    while left.any():
        taken = np.zeros_like(left)
        free_n, free_e, used_n, used_e = max_nodes, max_edges, 0.0, 0.0
        for _ in range(max_graphs):
            fits = (left > taken) & (pairs[:, 0] <= free_n) & (pairs[:, 1] <= free_e)
            if not fits.any():
                break
            imbalance = np.abs(used_n + fill_n - used_e - fill_e)
            k = int(np.where(fits, size - BALANCE_PENALTY * imbalance, -np.inf).argmax())
            taken[k] += 1
            free_n, free_e = free_n - int(pairs[k, 0]), free_e - int(pairs[k, 1])
            used_n, used_e = used_n + fill_n[k], used_e + fill_e[k]
        used = np.flatnonzero(taken)
        repeats = int((left[used] // taken[used]).min())
        left -= repeats * taken
        template = tuple(
            (int(pairs[k, 0]), int(pairs[k, 1])) for k in used[::-1] for _ in range(taken[k])
        )
        packs[template] = packs.get(template, 0) + repeats
    return packs
