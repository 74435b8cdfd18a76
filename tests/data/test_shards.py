"""A split dealt to replicas for good (schnet_ipu.packing.shards): the shares partition the
split, each share's plan holds exactly its molecules in whole packs of the split's plan, and
the pack counts are even."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schnet_ipu.packing import PackSlots, plan_packing
from schnet_ipu.packing.shards import shard_plan, template_shares


def test_template_copies_are_dealt_round_robin_across_templates():
    # 5 copies of the first template and 3 of the second over 3 replicas: the leftovers of
    # the first (2) go to replicas 0 and 1, the second's (none beyond 1 each) start at 2
    shares = template_shares([5, 3, 1], 3)
    assert shares.tolist() == [[2, 1, 0], [2, 1, 0], [1, 1, 1]]
    assert shares.sum(axis=0).tolist() == [5, 3, 1]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    molecules=st.integers(40, 400),
    replicas=st.integers(1, 5),
    radius=st.booleans(),
)
def test_shares_partition_the_split_into_whole_packs(seed, molecules, replicas, radius):
    rng = np.random.default_rng(seed)
    nodes = rng.integers(3, 20, size=molecules)
    edges = 2 * rng.integers(1, 30, size=molecules) if radius else None
    plan = plan_packing(nodes, edges, "tuple" if radius else "lpfhp", target_efficiency=0.8)
    if plan.num_packs < replicas:
        return
    shards = [shard_plan(plan, nodes, edges, r, replicas) for r in range(replicas)]
    every = np.concatenate([s.positions for s in shards])
    assert np.array_equal(np.sort(every), np.arange(molecules))  # each molecule once
    packs = [s.plan.num_packs for s in shards]
    assert sum(packs) == plan.num_packs and max(packs) - min(packs) <= 1
    assert all(s.most_packs == max(packs) for s in shards)
    templates = Counter()
    for shard in shards:
        assert np.all(np.diff(shard.positions) > 0)  # ascending
        assert (shard.plan.max_nodes, shard.plan.max_edges) == (plan.max_nodes, plan.max_edges)
        # the share's plan fits its molecules exactly (PackSlots refuses any mismatch)
        mine = None if edges is None else edges[shard.positions]
        PackSlots(shard.plan, nodes[shard.positions], mine).draw(seed, 0)
        templates.update(dict(zip(shard.plan.templates, shard.plan.counts)))
    assert templates == Counter(dict(zip(plan.templates, plan.counts)))  # whole packs


def test_a_size_sorted_split_gives_each_replica_neighbours():
    """Clusters stored in size order (synthetic water): each replica's molecules of one size
    are one block of consecutive positions."""
    nodes = np.repeat([9, 12, 15], 300)
    shards = [shard_plan(plan_packing(nodes), nodes, None, r, 3) for r in range(3)]
    for shard in shards:
        for size in (9, 12, 15):
            block = shard.positions[nodes[shard.positions] == size]
            assert len(block) and np.all(np.diff(block) == 1)


def test_one_replica_holds_the_whole_split():
    nodes = np.random.default_rng(1).integers(3, 20, size=100)
    plan = plan_packing(nodes)
    shard = shard_plan(plan, nodes, None, 0, 1)
    assert np.array_equal(shard.positions, np.arange(100))
    assert shard.plan.counts == plan.counts and shard.most_packs == plan.num_packs


@pytest.mark.parametrize("replica", [0, 1])
def test_shares_follow_the_plan_not_the_order_of_molecules(replica):
    """The same sizes in another order: each share takes the same sizes (its packs' slots)."""
    nodes = np.random.default_rng(2).integers(3, 20, size=200)
    plan = plan_packing(nodes)
    order = np.random.default_rng(3).permutation(200)
    one = shard_plan(plan, nodes, None, replica, 2)
    other = shard_plan(plan, nodes[order], None, replica, 2)
    assert sorted(nodes[one.positions]) == sorted(nodes[order][other.positions])
