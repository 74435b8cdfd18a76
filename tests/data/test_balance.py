"""Cost-model grouping across replicas: the fit, the schedule, and the loader's hook."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from schnet_ipu.data import MoleculeStore
from schnet_ipu.feed.dataset import PackedDataset
from schnet_ipu.feed.layout import Layout
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.packing import plan_packing
from schnet_ipu.packing.balance import (
    balance_batches,
    fit_cost_model,
    loader_order,
    round_robin,
    step_costs,
)


def test_fit_recovers_a_linear_cost():
    rng = np.random.default_rng(0)
    atoms = rng.integers(100, 900, size=60)
    edges = rng.integers(500, 9000, size=60)
    truth = (3e-5, 4e-6, 2e-3)
    seconds = atoms * truth[0] + edges * truth[1] + truth[2] + rng.normal(0, 1e-5, size=60)
    model = fit_cost_model(atoms, edges, seconds)
    np.testing.assert_allclose((model.per_atom, model.per_edge, model.constant), truth, rtol=0.05)
    assert 0.99 < model.r2 <= 1.0
    noise = fit_cost_model(atoms, edges, rng.normal(1.0, 0.1, size=60))
    assert noise.r2 < 0.3  # no linear signal, no good fit


@pytest.mark.parametrize(("count", "replicas"), [(17, 2), (12, 3), (5, 4)])
def test_every_batch_exactly_once(count, replicas):
    costs = np.random.default_rng(count).uniform(1.0, 5.0, size=count)
    schedule = balance_batches(costs, replicas, seed=1)
    assert schedule.shape == (-(-count // replicas), replicas)
    used = schedule[schedule >= 0]
    assert sorted(used.tolist()) == list(range(count))


def sum_of_step_maxima(schedule: np.ndarray, costs: np.ndarray) -> float:
    return float(step_costs(schedule, costs).max(1).sum())


def test_grouping_minimises_the_epoch_of_lockstep_replicas():
    """Brute force on 8 batches, 2 replicas: no schedule has a smaller sum of step maxima."""
    costs = np.random.default_rng(3).uniform(1.0, 10.0, size=8)
    best = min(
        sum_of_step_maxima(np.array(order).reshape(4, 2), costs)
        for order in itertools.permutations(range(8))
    )
    balanced = sum_of_step_maxima(balance_batches(costs, 2), costs)
    assert balanced == pytest.approx(best)
    assert balanced < sum_of_step_maxima(round_robin(8, 2), costs)


def test_replica_totals_stay_even():
    costs = np.random.default_rng(4).uniform(1.0, 10.0, size=41)
    totals = step_costs(balance_batches(costs, 2), costs).sum(0)
    assert abs(totals[0] - totals[1]) <= costs.max()


def test_loader_order_matches_the_global_micro_batch_layout():
    costs = np.arange(10, dtype=float)
    order = loader_order(costs, replicas=2, micro_per_call=2, seed=0)
    assert len(order) == 12 and sorted(order[order >= 0].tolist()) == list(range(10))
    # replicas of one call and micro-batch j sit R * micro apart... and step together:
    # position (call * R + r) * micro + j, so pairs (0, 2), (1, 3), (4, 6), ... share a step
    pairs = order.reshape(-1, 2, 2)  # [call, replica, j]
    for call in pairs:
        for j in range(2):
            a, b = call[0, j], call[1, j]
            if a >= 0 and b >= 0:
                assert abs(costs[a] - costs[b]) == 1  # neighbours in cost order


def test_loader_groups_like_cost_micro_batches_and_keeps_every_molecule(qm9_store):
    store = MoleculeStore(qm9_store)
    indices = np.arange(400)
    nodes = store.num_atoms[indices]
    plan = plan_packing(nodes, None, algorithm="lpfhp", target_efficiency=0.9)
    targets = np.zeros(len(store))
    seen, gaps = {}, {}
    for balance in ("none", "cost_model"):
        per_replica = []
        for replica in range(2):
            layout = Layout(2, plan.max_nodes, plan.max_graphs, replicas=2, replica=replica,
                            replica_balance=balance)  # fmt: skip
            dataset = PackedDataset(store, indices, targets, plan, layout, seed=0)
            batches = [b for call in PackedLoader(dataset).epoch(0) for b in call]
            per_replica.append(batches)
        molecules = [
            int(m) for batches in per_replica for b in batches for m in b.molecule_index if m >= 0
        ]
        seen[balance] = sorted(molecules)
        atoms = np.array([[int(b.node_mask.sum()) for b in batches] for batches in per_replica])
        gaps[balance] = np.abs(atoms[0] - atoms[1]).mean()
    assert seen["none"] == seen["cost_model"] == list(range(400))
    assert gaps["cost_model"] < gaps["none"]
