"""A split's molecules dealt to replicas for good: each reads and trains on its own share.

    shard = shard_plan(plan, node_counts, edge_counts, replica=r, replicas=R)
    PackSlots(shard.plan, node_counts[shard.positions], ...)  # its packs, drawn per epoch

Without shards every replica holds the whole split and the epoch's packs are dealt over the
replicas anew each epoch, so a molecule visits every replica in turn. With them (the
loader's ``loader.shard``) replica r holds a fixed share, whole packs of the split's plan:

1. Packs: the plan's copies of each template are dealt round robin over the replicas (the
   first leftover copy of a template goes to the replica after the previous template's
   last), so every replica gets the same templates within one copy each and pack counts
   that differ by at most one.
2. Molecules: each size (atoms, or atoms and edges for plans with edges) is cut in
   consecutive blocks in split order, one block per replica as large as its packs' slots of
   that size. Stores written in size order (synthetic water) or with sizes spread through
   the file (QM9) give each replica molecules that lie close together: few, large reads.

The shards partition the split (every molecule in exactly one), each shard's plan holds
exactly its molecules, and all use the split's limits (one batch shape). Every replica
pads its epoch to the largest shard's packs (``most_packs``), so all run the same host calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schnet_ipu.packing.plan import concatenated_ranges, exclusive_cumsum, size_keys
from schnet_ipu.packing.strategy import PackPlan, make_plan


@dataclass(frozen=True)
class Shard:
    """One replica's share of a split."""

    positions: np.ndarray  # int64 [m] ascending positions in the split of its molecules
    plan: PackPlan  # its packs: whole packs of the split's plan, the same limits
    most_packs: int  # packs of the largest shard of the split: every replica's epoch length


def template_shares(counts: list[int], replicas: int) -> np.ndarray:
    """int64 [replicas, T]: copies of each template per replica, dealt round robin with the
    leftovers continuing where the previous template's stopped."""
    shares = np.zeros((replicas, len(counts)), dtype=np.int64)
    cursor = 0
    for t, count in enumerate(counts):
        shares[:, t] = count // replicas
        extra = (cursor + np.arange(count % replicas)) % replicas
        shares[extra, t] += 1
        cursor = (cursor + count % replicas) % replicas
    return shares


def shard_plan(
    plan: PackPlan,
    node_counts: np.ndarray,
    edge_counts: np.ndarray | None,
    replica: int,
    replicas: int,
) -> Shard:
    """Replica ``replica``'s share of the split whose molecules have ``node_counts`` (and
    ``edge_counts``, for plans with edges), int [M] in split order, packed by ``plan``."""
    node_counts = np.asarray(node_counts, dtype=np.int64)
    edge_counts = None if edge_counts is None else np.asarray(edge_counts, dtype=np.int64)
    keys, template_keys = size_keys(plan, node_counts, edge_counts)
    shares = template_shares(plan.counts, replicas)
    sizes, by_size = np.unique(keys, return_inverse=True)
    # slots of each size per replica: [replicas, sizes]
    per_template = np.stack(
        [np.bincount(np.searchsorted(sizes, t), minlength=len(sizes)) for t in template_keys]
    )
    slots = shares @ per_template
    order = np.argsort(by_size.reshape(-1), kind="stable")  # by size, split order within
    group_start = exclusive_cumsum(np.bincount(by_size.reshape(-1), minlength=len(sizes)))
    before = slots[:replica].sum(axis=0)
    positions = np.sort(order[concatenated_ranges(group_start + before, slots[replica])])
    mine = make_plan(
        plan.algorithm,
        plan.max_nodes,
        plan.max_edges,
        plan.max_graphs,
        plan.templates,
        shares[replica].tolist(),
    )
    return Shard(positions.astype(np.int64), mine, int(shares.sum(axis=1).max()))
