"""The result type every packing algorithm returns, its error type, and shared checks.

A plan is a list of pack *templates* with repeat counts. A template is a tuple of slot
sizes, one slot per molecule: an ``int`` (atoms) for node-only packing, or an
``(atoms, edges)`` pair for tuple packing. Templates describe whole packs, so the total
number of slots over all packs equals the number of molecules: no slot is padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Union

import numpy as np

Slot = Union[int, Tuple[int, int]]  # typing forms: a runtime alias on Python 3.8 (the SDK's)


class PackingError(ValueError):
    """Molecules and limits that cannot be packed, with a message saying what to change."""


@dataclass
class PackPlan:
    """Pack templates with repeat counts, the limits they respect and their efficiency.

    ``templates[i]`` is a tuple of slot sizes (``int`` atoms, or ``(atoms, edges)`` pairs
    when ``max_edges`` is set) used by ``counts[i]`` packs. Efficiencies are real atoms
    (edges) over ``num_packs * max_nodes`` (``max_edges``).
    """

    algorithm: str
    max_nodes: int
    max_edges: int | None
    max_graphs: int
    templates: list[tuple[Slot, ...]]
    counts: list[int]
    node_efficiency: float
    edge_efficiency: float | None
    num_packs: int


def make_plan(
    algorithm: str,
    max_nodes: int,
    max_edges: int | None,
    max_graphs: int,
    templates: list[tuple[Slot, ...]],
    counts: list[int],
) -> PackPlan:
    """Build a :class:`PackPlan`, computing pack count and efficiencies from the templates."""
    num_packs = int(sum(counts))
    nodes = edges = 0
    for template, count in zip(templates, counts):
        if max_edges is None:
            nodes += count * sum(template)
        else:
            nodes += count * sum(n for n, _ in template)
            edges += count * sum(e for _, e in template)
    node_eff = nodes / (num_packs * max_nodes) if num_packs else 1.0
    edge_eff = None
    if max_edges is not None:
        edge_eff = edges / (num_packs * max_edges) if num_packs and max_edges else 1.0
    return PackPlan(
        algorithm,
        max_nodes,
        max_edges,
        max_graphs,
        templates,
        counts,
        node_eff,
        edge_eff,
        num_packs,
    )


def check_sizes(node_counts: np.ndarray, edge_counts: np.ndarray | None) -> None:
    """Reject empty data, molecules without atoms, negative edge counts and length mismatches."""
    if node_counts.ndim != 1 or len(node_counts) == 0:
        raise PackingError(
            f"node_counts must be a non-empty 1-D array, got shape {node_counts.shape}"
        )
    if node_counts.min() < 1:
        i = int(node_counts.argmin())
        raise PackingError(f"molecule {i} has {node_counts[i]} atoms; every molecule needs >= 1")
    if edge_counts is None:
        return
    if edge_counts.shape != node_counts.shape:
        raise PackingError(
            f"edge_counts has shape {edge_counts.shape} but node_counts has {node_counts.shape}"
        )
    if edge_counts.min() < 0:
        i = int(edge_counts.argmin())
        raise PackingError(f"molecule {i} has {edge_counts[i]} edges; counts must be >= 0")


def check_fits(sizes: np.ndarray, limit: int, what: str, option: str) -> None:
    """Raise naming the first molecule whose ``sizes [M]`` exceed ``limit`` (never drop it)."""
    too_big = np.flatnonzero(sizes > limit)
    if len(too_big):
        i = int(too_big[0])
        raise PackingError(
            f"molecule {i} has {sizes[i]} {what}, more than {option}={limit} "
            f"({len(too_big)} molecule(s) too large); raise {option} to at least {sizes.max()}"
        )
