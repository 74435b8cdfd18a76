"""The packing interface used by the loader and trainer: plan once, assign every epoch.

    plan = plan_packing(store.num_atoms[train], algorithm="lpfhp")
    for epoch in range(epochs):
        packs = assign_packs(plan, store.num_atoms[train], None, seed, epoch)

``plan_packing`` works on the size histogram only; ``assign_packs`` maps concrete molecules
onto the plan's slots. Both check that no molecule is too large or left out.
"""

from __future__ import annotations

import warnings

import numpy as np

from schnet_ipu.packing.lpfhp import lpfhp
from schnet_ipu.packing.search import search_node_limit, search_tuple_limits
from schnet_ipu.packing.strategy import (
    PackingError,
    PackPlan,
    check_fits,
    check_sizes,
    make_plan,
)
from schnet_ipu.packing.tuple_packing import pair_histogram, tuple_pack

__all__ = [
    "PackPlan",
    "PackSlots",
    "PackingError",
    "assign_packs",
    "plan_packing",
]

ALGORITHMS = ("lpfhp", "tuple", "pad_to_max")


def plan_packing(
    node_counts: np.ndarray,
    edge_counts: np.ndarray | None = None,
    algorithm: str = "lpfhp",
    max_nodes: int = 0,
    max_edges: int = 0,
    max_graphs: int = 0,
    target_efficiency: float = 0.985,
    heuristic: str = "sum",
) -> PackPlan:
    """Plan packs for molecules with ``node_counts`` (int [M]) atoms and, for ``tuple`` and
    optionally ``pad_to_max``, ``edge_counts`` (int [M]) directed edges.

    A limit of 0 is chosen automatically: ``max_nodes``/``max_edges`` as the smallest limit
    (pair) whose plan reaches ``target_efficiency``, ``max_graphs`` as the most molecules any
    template of that plan holds. Raises :class:`PackingError` for molecules over the limits.
    """
    node_counts = np.asarray(node_counts, dtype=np.int64)
    edge_counts = None if edge_counts is None else np.asarray(edge_counts, dtype=np.int64)
    check_sizes(node_counts, edge_counts)
    if algorithm not in ALGORITHMS:
        raise PackingError(f"algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    for name, value in (("max_nodes", max_nodes), ("max_edges", max_edges)):
        if value < 0:
            raise PackingError(f"{name}={value} must be >= 0 (0 = choose automatically)")
    if max_graphs < 0:
        raise PackingError(f"max_graphs={max_graphs} must be >= 0 (0 = choose automatically)")
    if not 0 < target_efficiency <= 1:
        raise PackingError(f"target_efficiency={target_efficiency} must be in (0, 1]")
    if max_nodes:
        check_fits(node_counts, max_nodes, "atoms", "max_nodes")

    if algorithm == "pad_to_max":
        return _pad_to_max(node_counts, edge_counts, max_nodes, max_edges, max_graphs)
    if algorithm == "lpfhp":
        histogram = np.bincount(node_counts)
        auto = not max_nodes
        if auto:
            max_nodes = search_node_limit(histogram, target_efficiency, max_graphs)
        plan = lpfhp(histogram, max_nodes, max_graphs or max_nodes)
    else:
        if edge_counts is None:
            raise PackingError("algorithm='tuple' needs edge_counts (directed edges per molecule)")
        if max_edges % 2:
            raise PackingError(
                f"max_edges={max_edges} must be even: edges are stored as forward and "
                "reversed pairs"
            )
        if max_edges:
            check_fits(edge_counts, max_edges, "edges", "max_edges")
        pairs, counts = pair_histogram(node_counts, edge_counts)
        auto = not max_nodes or not max_edges
        if auto:
            max_nodes, max_edges = search_tuple_limits(
                pairs, counts, target_efficiency, max_nodes, max_edges, max_graphs, heuristic
            )
        plan = tuple_pack(pairs, counts, max_nodes, max_edges, max_graphs or max_nodes, heuristic)
    if auto:
        _warn_if_short(plan, target_efficiency)
    if not max_graphs:
        plan.max_graphs = max(len(t) for t in plan.templates)
    return plan


def _warn_if_short(plan: PackPlan, target: float) -> None:
    """Warn (not fail) when the automatic search could not reach the target efficiency."""
    worst = min(e for e in (plan.node_efficiency, plan.edge_efficiency) if e is not None)
    if worst < target:
        warnings.warn(
            f"packing: no limit reached target efficiency {target:.3f}; using the best found, "
            f"max_nodes={plan.max_nodes}, max_edges={plan.max_edges}, efficiency {worst:.4f}",
            stacklevel=3,
        )


def _pad_to_max(
    node_counts: np.ndarray,
    edge_counts: np.ndarray | None,
    max_nodes: int,
    max_edges: int,
    max_graphs: int,
) -> PackPlan:
    """One molecule per pack, each pack as large as the largest molecule (or the limits)."""
    if max_graphs > 1:
        raise PackingError(f"pad_to_max holds one molecule per pack; max_graphs={max_graphs}")
    max_nodes = max_nodes or int(node_counts.max())
    if edge_counts is None:
        sizes, counts = np.unique(node_counts, return_counts=True)
        templates = [(int(n),) for n in sizes[::-1]]
        return make_plan("pad_to_max", max_nodes, None, 1, templates, counts[::-1].tolist())
    if max_edges % 2:
        raise PackingError(f"max_edges={max_edges} must be even")
    if max_edges:
        check_fits(edge_counts, max_edges, "edges", "max_edges")
    max_edges = max_edges or int(edge_counts.max())
    pairs, counts = pair_histogram(node_counts, edge_counts)
    templates = [((int(n), int(e)),) for n, e in pairs[::-1]]
    return make_plan("pad_to_max", max_nodes, max_edges, 1, templates, counts[::-1].tolist())


def size_keys(plan: PackPlan, node_counts: np.ndarray, edge_counts: np.ndarray | None):
    """One integer key per molecule (int [M]) and per template slot, equal iff sizes match."""
    if plan.max_edges is None:
        return node_counts, [np.asarray(t, dtype=np.int64) for t in plan.templates]
    if edge_counts is None:
        raise PackingError(f"a {plan.algorithm} plan with max_edges needs edge_counts")
    width = int(max(edge_counts.max(), plan.max_edges)) + 1
    keys = node_counts * width + edge_counts
    slots = [np.asarray(t, dtype=np.int64).reshape(-1, 2) @ [width, 1] for t in plan.templates]
    return keys, slots


def assign_packs(
    plan: PackPlan,
    node_counts: np.ndarray,
    edge_counts: np.ndarray | None,
    seed: int,
    epoch: int,
) -> list[np.ndarray]:
    """Concrete packs for one epoch: a list of ``plan.num_packs`` int64 index arrays into
    ``node_counts`` (int [M]), one index per template slot, in slot order.

    Molecules of equal size (and edge count, for plans with edges) are shuffled among the
    slots of that size, and the packs are shuffled, from ``(seed, epoch)``; every molecule
    appears in exactly one pack. Raises :class:`PackingError` if the sizes do not match the
    plan (a plan made for other data).
    """
    molecules, lengths = PackSlots(plan, node_counts, edge_counts).draw(seed, epoch)
    return np.split(molecules, np.cumsum(lengths)[:-1])


class PackSlots:
    """The epoch-independent part of :func:`assign_packs`, worked out once: which
    template slot takes which size of molecule. :meth:`draw` then fills the slots for an
    epoch with a shuffle and a stable sort per epoch.

    Raises :class:`PackingError` if the sizes do not match the plan (a plan made for other
    data).
    """

    def __init__(
        self, plan: PackPlan, node_counts: np.ndarray, edge_counts: np.ndarray | None
    ) -> None:
        node_counts = np.asarray(node_counts, dtype=np.int64)
        edge_counts = None if edge_counts is None else np.asarray(edge_counts, dtype=np.int64)
        check_sizes(node_counts, edge_counts)
        keys, template_keys = size_keys(plan, node_counts, edge_counts)
        template_sizes = np.array([len(t) for t in template_keys], dtype=np.int64)
        self.lengths = np.repeat(template_sizes, plan.counts)  # [num_packs]
        # every copy of every template, one after the other: [sum of lengths] slot keys
        template_of_pack = np.repeat(np.arange(len(template_keys)), plan.counts)
        flat = np.concatenate([np.zeros(0, np.int64), *template_keys])
        first_slot = exclusive_cumsum(template_sizes)[template_of_pack]
        slot_keys = flat[concatenated_ranges(first_slot, self.lengths)]
        if len(slot_keys) != len(keys):
            raise PackingError(
                f"plan has {len(slot_keys)} molecule slots but {len(keys)} molecules were given"
            )
        # sizes as dense ranks in a small dtype: the same stable order, a faster sort
        sizes, ranks = np.unique(np.concatenate([keys, slot_keys]), return_inverse=True)
        ranks = ranks.reshape(-1).astype(np.uint16 if len(sizes) < 2**16 else np.int64)
        self.ranks, slot_ranks = ranks[: len(keys)], ranks[len(keys) :]
        self.slot_order = np.argsort(slot_ranks, kind="stable")
        if not np.array_equal(np.sort(self.ranks), slot_ranks[self.slot_order]):
            raise PackingError(
                "molecule sizes do not match the plan's slots; re-plan for this data"
            )

    def draw(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's packs: (molecules int64 [M] pack after pack, lengths int64 [num_packs])."""
        rng = np.random.default_rng([seed, epoch])
        shuffled = rng.permutation(len(self.ranks))
        molecules = shuffled[np.argsort(self.ranks[shuffled], kind="stable")]
        filled = np.empty_like(molecules)
        filled[self.slot_order] = molecules
        order = rng.permutation(len(self.lengths))
        lengths = self.lengths[order]
        return filled[concatenated_ranges(exclusive_cumsum(self.lengths)[order], lengths)], lengths


def exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    return np.cumsum(counts) - counts


def concatenated_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + l)`` for every (s, l) of ``starts``/``lengths`` [S]."""
    return np.repeat(starts - exclusive_cumsum(lengths), lengths) + np.arange(lengths.sum())
