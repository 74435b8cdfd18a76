"""Packing: hand-checked cases, errors, per-epoch re-draw, and hypothesis invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schnet_ipu.packing import PackingError, assign_packs, plan_packing
from schnet_ipu.packing.lpfhp import lpfhp
from schnet_ipu.packing.padded_batches import BASELINES, run_baseline
from schnet_ipu.packing.search import search_node_limit
from schnet_ipu.packing.tuple_packing import HEURISTICS, VARIANTS, pair_histogram, tuple_pack


def packs_of(plan) -> dict:
    """Template -> count as a dict, for exact comparisons."""
    return dict(zip(plan.templates, plan.counts, strict=True))


# ---- hand-checked cases -------------------------------------------------------------------


def test_lpfhp_by_hand() -> None:
    # sizes 7 x1, 5 x2, 3 x3, 2 x2; max_nodes 10, max_graphs 3.
    # 7: opens (7) room 3.  5: no room >= 5 -> new pack takes two 5s: (5, 5) room 0, closed.
    # 3: tightest room 3 is (7) -> (7, 3) full; two 3s left -> new pack (3, 3) room 4.
    # 2: tightest room is (3, 3) room 4: two 2s fit but only one more slot -> (3, 3, 2);
    #    the last 2 opens (2).  Packs: (7,3) (5,5) (3,3,2) (2): 4 packs, 30/40 atoms.
    plan = lpfhp(np.bincount([7, 5, 5, 3, 3, 3, 2, 2]), max_nodes=10, max_graphs=3)
    assert packs_of(plan) == {(7, 3): 1, (5, 5): 1, (3, 3, 2): 1, (2,): 1}
    assert plan.num_packs == 4 and plan.node_efficiency == pytest.approx(30 / 40)


def test_lpfhp_moves_whole_blocks() -> None:
    # 1000 molecules of 6 and 1000 of 4, max 10: every 6 opens a pack (room 4) and every 4
    # fills one exactly: 1000 packs (6, 4), 100 % efficiency, in a handful of block moves.
    plan = lpfhp(np.bincount([6] * 1000 + [4] * 1000), max_nodes=10, max_graphs=4)
    assert packs_of(plan) == {(6, 4): 1000}
    assert plan.node_efficiency == 1.0


def test_tuple_by_hand() -> None:
    # (nodes, edges): A=(4, 10) x2, B=(2, 2) x2, C=(3, 12) x1; limits 6 nodes, 14 edges.
    # product scores (n/6 * e/14): C 0.43, A 0.48, B 0.05 -> order A, C, B.
    # A: new packs; one A per pack (two would need 8 nodes) -> 2 packs (A) room (2, 4).
    # C: (3, 12) fits no room -> new pack (C) room (3, 2).
    # B: best fit = least room by product: (C) room (3, 2) scores 0.07 < (A)'s 0.10, and
    #    B=(2, 2) fits -> (C, B); second B -> tightest left is an (A) -> (A, B).
    # Packs: (A, B) (A) (C, B): 4+2+4+3+2 = 15 of 18 atoms, 10+2+10+12+2 = 36 of 42 edges.
    a, b, c = (4, 10), (2, 2), (3, 12)
    plan = tuple_pack(np.array([a, b, c]), np.array([2, 2, 1]), 6, 14, 3, "product", "best_fit")
    assert packs_of(plan) == {(a, b): 1, (a,): 1, (c, b): 1}
    assert plan.node_efficiency == pytest.approx(15 / 18)
    assert plan.edge_efficiency == pytest.approx(36 / 42)
    # first fit (roomiest pack first): the first B goes to an (A) (room score 0.10) and
    # the second to the other (A) (now the roomiest): (A, B) x2 and (C).
    plan = tuple_pack(np.array([a, b, c]), np.array([2, 2, 1]), 6, 14, 3, "product", "first_fit")
    assert packs_of(plan) == {(a, b): 2, (c,): 1}


def test_pad_to_max_by_hand() -> None:
    # one molecule per pack of the largest size: 3 packs of 5 atoms hold 2 + 3 + 5 = 10.
    plan = plan_packing(np.array([2, 5, 3]), np.array([2, 20, 6]), "pad_to_max")
    assert (plan.max_nodes, plan.max_edges, plan.max_graphs, plan.num_packs) == (5, 20, 1, 3)
    assert plan.node_efficiency == pytest.approx(10 / 15)
    assert plan.edge_efficiency == pytest.approx(28 / 60)


def test_baselines_by_hand() -> None:
    # 4 molecules of 3, 5, 9, 1 atoms in batches of 2 (order shuffled, but totals are known
    # for static_constant: 2 batches x 2 x 9 atoms = 36 slots for 18 atoms).
    nodes = np.array([3, 5, 9, 1])
    result = run_baseline("static_constant", nodes, None, batch_graphs=2)
    assert result.node_efficiency == pytest.approx(18 / 36) and result.distinct_shapes == 1
    # static_64 on one batch of all four: 18 atoms -> 64.
    result = run_baseline("static_64", nodes, None, batch_graphs=4)
    assert result.shapes == [(64, None, 4)] and result.node_efficiency == pytest.approx(18 / 64)
    # static_2n: 18 -> 32.
    result = run_baseline("static_2n", nodes, None, batch_graphs=4)
    assert result.shapes == [(32, None, 4)]
    # dynamic: budget is a multiple of 64 >= every sampled batch of 4 (<= 36 atoms) -> 64;
    # all four fit in one batch with 4 + 1 graph slots.
    result = run_baseline("dynamic", nodes, None, batch_graphs=4)
    assert result.shapes == [(64, None, 5)] and len(result.batches) == 1


def test_search_picks_smallest_limit() -> None:
    # sizes 5 and 3 in equal numbers: limit 8 packs (5, 3) perfectly; 5, 6, 7 do not.
    histogram = np.bincount([5] * 50 + [3] * 50)
    assert search_node_limit(histogram, 0.99) == 8
    plan = plan_packing(np.array([5] * 50 + [3] * 50), target_efficiency=0.99)
    assert (plan.max_nodes, plan.max_graphs, plan.node_efficiency) == (8, 2, 1.0)


# ---- errors --------------------------------------------------------------------------------


def test_too_large_molecule_is_named() -> None:
    with pytest.raises(PackingError, match=r"molecule 2 has 12 atoms.*max_nodes=10.*at least 12"):
        plan_packing(np.array([3, 4, 12, 5]), max_nodes=10)
    with pytest.raises(PackingError, match=r"molecule 1 has 40 edges.*max_edges=30"):
        plan_packing(np.array([3, 4]), np.array([6, 40]), "tuple", max_nodes=10, max_edges=30)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_nodes": -1}, "max_nodes=-1 must be >= 0"),
        ({"max_graphs": -2}, "max_graphs=-2"),
        ({"algorithm": "bfd"}, "not one of"),
        ({"target_efficiency": 1.5}, "target_efficiency"),
        ({"algorithm": "tuple"}, "needs edge_counts"),
        ({"algorithm": "pad_to_max", "max_graphs": 2}, "one molecule per pack"),
    ],
)
def test_impossible_limits_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(PackingError, match=message):
        plan_packing(np.array([3, 4, 5]), **kwargs)


def test_bad_inputs_rejected() -> None:
    with pytest.raises(PackingError, match="must be even"):
        plan_packing(np.array([3]), np.array([6]), "tuple", max_nodes=4, max_edges=7)
    with pytest.raises(PackingError, match="molecule 1 has 0 atoms"):
        plan_packing(np.array([3, 0]))
    with pytest.raises(PackingError, match="non-empty"):
        plan_packing(np.array([], dtype=np.int64))
    plan = plan_packing(np.array([3, 4, 5]), max_nodes=8)
    with pytest.raises(PackingError, match="do not match"):
        assign_packs(plan, np.array([3, 4, 6]), None, 0, 0)
    with pytest.raises(PackingError, match="slots but 2 molecules"):
        assign_packs(plan, np.array([3, 4]), None, 0, 0)


# ---- per-epoch re-draw -------------------------------------------------------------------


def test_epochs_redraw_contents_not_shapes() -> None:
    rng = np.random.default_rng(1)
    nodes = rng.integers(5, 20, size=400)
    edges = nodes * (nodes - 1) - 2 * rng.integers(0, 3, size=400)
    plan = plan_packing(nodes, edges, "tuple", max_nodes=40, max_edges=900)
    first = assign_packs(plan, nodes, edges, seed=3, epoch=0)
    again = assign_packs(plan, nodes, edges, seed=3, epoch=0)
    second = assign_packs(plan, nodes, edges, seed=3, epoch=1)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert {tuple(p) for p in first} != {tuple(p) for p in second}

    def shapes(packs: list[np.ndarray]) -> list:
        return sorted(tuple(zip(nodes[p], edges[p], strict=True)) for p in packs)

    assert (
        shapes(first)
        == shapes(second)
        == sorted(t for t, c in zip(plan.templates, plan.counts, strict=True) for _ in range(c))
    )


# ---- properties --------------------------------------------------------------------------


def check_packs(plan, nodes: np.ndarray, edges: np.ndarray | None, packs: list) -> None:
    """Exact cover, limits, and efficiency equal to the packs' real content."""
    everything = np.concatenate(packs)
    assert np.array_equal(np.sort(everything), np.arange(len(nodes)))
    assert len(packs) == plan.num_packs
    templates = set(plan.templates)
    for pack in packs:
        assert 1 <= len(pack) <= plan.max_graphs
        assert nodes[pack].sum() <= plan.max_nodes
        if plan.max_edges is None:
            assert tuple(nodes[pack].tolist()) in templates  # molecules in slot order
        else:
            assert tuple(zip(nodes[pack].tolist(), edges[pack].tolist(), strict=True)) in templates
            assert edges[pack].sum() <= plan.max_edges
    assert plan.node_efficiency == pytest.approx(nodes.sum() / (len(packs) * plan.max_nodes))
    if plan.max_edges is not None:
        capacity = len(packs) * plan.max_edges
        expected = edges.sum() / capacity if capacity else 1.0  # no edges allowed, none used
        assert plan.edge_efficiency == pytest.approx(expected)


sizes = st.lists(st.integers(1, 12), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(sizes, st.integers(0, 30), st.integers(0, 5), st.integers(0, 3))
def test_lpfhp_properties(atoms: list, extra: int, max_graphs: int, epoch: int) -> None:
    nodes = np.array(atoms)
    limit = int(nodes.max()) + extra if extra else 0  # 0: automatic search
    plan = plan_packing(nodes, max_nodes=limit, max_graphs=max_graphs)
    check_packs(plan, nodes, None, assign_packs(plan, nodes, None, seed=7, epoch=epoch))


@settings(max_examples=60, deadline=None)
@given(
    sizes,
    st.data(),
    st.sampled_from(list(HEURISTICS)),
    st.sampled_from(VARIANTS),
    st.integers(0, 20),
    st.integers(1, 5),
)
def test_tuple_properties(atoms, data, heuristic, variant, extra, max_graphs) -> None:
    nodes = np.array(atoms)
    edges = np.array([2 * data.draw(st.integers(0, n * (n - 1) // 2)) for n in atoms])
    max_nodes, max_edges = int(nodes.max()) + extra, int(edges.max()) + 2 * extra
    pairs, counts = pair_histogram(nodes, edges)
    plan = tuple_pack(pairs, counts, max_nodes, max_edges, max_graphs, heuristic, variant)
    assert plan.num_packs * max_graphs >= len(nodes)
    check_packs(plan, nodes, edges, assign_packs(plan, nodes, edges, seed=1, epoch=2))


@pytest.mark.filterwarnings("ignore:packing. no limit reached")
@settings(max_examples=20, deadline=None)
@given(sizes, st.booleans())
def test_auto_tuple_and_pad_properties(atoms: list, with_edges: bool) -> None:
    nodes = np.array(atoms)
    edges = nodes * (nodes - 1)
    plan = plan_packing(nodes, edges, "tuple", target_efficiency=0.9)
    check_packs(plan, nodes, edges, assign_packs(plan, nodes, edges, seed=0, epoch=0))
    pad_edges = edges if with_edges else None
    plan = plan_packing(nodes, pad_edges, "pad_to_max")
    check_packs(plan, nodes, pad_edges, assign_packs(plan, nodes, pad_edges, seed=0, epoch=0))


@settings(max_examples=30, deadline=None)
@given(sizes, st.sampled_from(BASELINES), st.integers(1, 8), st.booleans(), st.integers(0, 9))
def test_baseline_properties(atoms: list, name: str, batch: int, with_edges: bool, seed: int):
    nodes = np.array(atoms)
    edges = nodes * (nodes - 1) if with_edges else None
    result = run_baseline(name, nodes, edges, batch, seed=seed)
    assert np.array_equal(np.sort(np.concatenate(result.batches)), np.arange(len(nodes)))
    real_n = real_e = padded_n = padded_e = 0
    for members, (n, e, g) in zip(result.batches, result.shapes, strict=True):
        assert len(members) <= g - (name == "dynamic")
        assert nodes[members].sum() <= n
        real_n, padded_n = real_n + nodes[members].sum(), padded_n + n
        if with_edges:
            assert edges[members].sum() <= e
            real_e, padded_e = real_e + edges[members].sum(), padded_e + e
    assert result.node_efficiency == pytest.approx(real_n / padded_n)
    if with_edges and padded_e:
        assert result.edge_efficiency == pytest.approx(real_e / padded_e)
    assert result.distinct_shapes == len(set(result.shapes))


def test_balanced_beats_decreasing_fit_when_edges_grow_like_atoms_squared() -> None:
    # QM9-like: edges ~ n (n - 1). Decreasing order fills early packs with large molecules
    # that exhaust edges and late packs with small ones that exhaust atoms; balanced mixes.
    atoms = np.random.default_rng(0).integers(5, 21, size=2000)
    pairs, counts = pair_histogram(atoms, atoms * (atoms - 1))
    plans = {v: tuple_pack(pairs, counts, 60, 800, 60, "sum", v) for v in VARIANTS}
    worst = {v: min(p.node_efficiency, p.edge_efficiency) for v, p in plans.items()}
    assert worst["balanced"] > worst["best_fit"] + 0.03
    assert worst["balanced"] > worst["first_fit"] + 0.03
