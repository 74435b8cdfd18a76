"""Batching baselines that packing replaces, measured the same way as packs.

Every baseline walks one epoch in a shuffled order and returns its batches (molecule
indices) with the padded shape of each batch, so efficiency and the number of distinct
shapes (= recompilations on a static-shape device) come from what was really built.

* ``static_constant``: ``batch_graphs`` molecules, padded to ``batch_graphs`` x largest.
* ``static_2n`` / ``static_64``: ``batch_graphs`` molecules, atom and edge totals padded to
  the next power of two / multiple of 64.
* ``dynamic``: greedy fill up to an atom/edge budget estimated from a sample of batches
  (rounded up to a multiple of 64) and ``batch_graphs`` molecules, plus one graph slot kept
  for the padding graph; every batch has the budget's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schnet_ipu.packing.strategy import PackingError, check_sizes

BASELINES = ("static_constant", "static_2n", "static_64", "dynamic")


@dataclass
class BaselineResult:
    """Batches of one epoch: ``batches[i]`` (int64 indices) padded to ``shapes[i]`` =
    (atoms, edges or None, graph slots)."""

    name: str
    batches: list[np.ndarray]
    shapes: list[tuple[int, int | None, int]]
    node_efficiency: float
    edge_efficiency: float | None
    max_nodes: int
    max_edges: int | None
    max_graphs: int
    distinct_shapes: int


def _next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _ceil64(x: int) -> int:
    return max(64, -(-int(x) // 64) * 64)


def _result(
    name: str,
    batches: list[np.ndarray],
    shapes: list[tuple[int, int | None, int]],
    node_counts: np.ndarray,
    edge_counts: np.ndarray | None,
) -> BaselineResult:
    padded = np.array([(n, e or 0, g) for n, e, g in shapes], dtype=np.int64)
    node_eff = node_counts.sum() / padded[:, 0].sum()
    edge_eff = None
    if edge_counts is not None:
        edge_eff = edge_counts.sum() / padded[:, 1].sum() if padded[:, 1].sum() else 1.0
    return BaselineResult(
        name,
        batches,
        shapes,
        float(node_eff),
        None if edge_eff is None else float(edge_eff),
        int(padded[:, 0].max()),
        None if edge_counts is None else int(padded[:, 1].max()),
        int(padded[:, 2].max()),
        len(set(shapes)),
    )


def run_baseline(
    name: str,
    node_counts: np.ndarray,
    edge_counts: np.ndarray | None,
    batch_graphs: int,
    seed: int = 0,
    sample_batches: int = 100,
) -> BaselineResult:
    """Batch one epoch of molecules with ``node_counts`` (int [M]) atoms and optional
    ``edge_counts`` (int [M]) edges using baseline ``name``; order shuffled from ``seed``."""
    node_counts = np.asarray(node_counts, dtype=np.int64)
    edge_counts = None if edge_counts is None else np.asarray(edge_counts, dtype=np.int64)
    check_sizes(node_counts, edge_counts)
    if name not in BASELINES:
        raise PackingError(f"baseline {name!r} is not one of {', '.join(BASELINES)}")
    if batch_graphs < 1:
        raise PackingError(f"batch_graphs={batch_graphs} must be >= 1")
    edges = np.zeros_like(node_counts) if edge_counts is None else edge_counts
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(node_counts))

    if name == "dynamic":
        return _dynamic(node_counts, edge_counts, edges, batch_graphs, order, rng, sample_batches)
    batches = [order[i : i + batch_graphs] for i in range(0, len(order), batch_graphs)]
    if name == "static_constant":
        pad_n, pad_e = batch_graphs * node_counts.max(), batch_graphs * edges.max()
        shapes = [(int(pad_n), int(pad_e), batch_graphs) for _ in batches]
    else:
        pad = _next_pow2 if name == "static_2n" else _ceil64
        shapes = [(pad(node_counts[b].sum()), pad(edges[b].sum()), batch_graphs) for b in batches]
    if edge_counts is None:
        shapes = [(n, None, g) for n, _, g in shapes]
    return _result(name, batches, shapes, node_counts, edge_counts)


def _dynamic(
    node_counts: np.ndarray,
    edge_counts: np.ndarray | None,
    edges: np.ndarray,
    batch_graphs: int,
    order: np.ndarray,
    rng: np.random.Generator,
    sample_batches: int,
) -> BaselineResult:
    """Budget = largest atom/edge total over ``sample_batches`` random batches of
    ``batch_graphs``, rounded up to 64; fill greedily in ``order`` until the next molecule
    would overflow a budget or the ``batch_graphs`` real slots."""
    sample = rng.choice(len(node_counts), size=(sample_batches, batch_graphs))
    budget_n = max(_ceil64(node_counts[sample].sum(1).max()), int(node_counts.max()))
    budget_e = max(_ceil64(edges[sample].sum(1).max()), int(edges.max()))
    batches, start, used_n, used_e = [], 0, 0, 0
    for pos, i in enumerate(order.tolist()):
        full = pos - start == batch_graphs
        if full or used_n + node_counts[i] > budget_n or used_e + edges[i] > budget_e:
            batches.append(order[start:pos])
            start, used_n, used_e = pos, 0, 0
        used_n += int(node_counts[i])
        used_e += int(edges[i])
    batches.append(order[start:])
    shape = (budget_n, None if edge_counts is None else budget_e, batch_graphs + 1)
    return _result("dynamic", batches, [shape] * len(batches), node_counts, edge_counts)
