"""numba's compiled loop against the torch program on real QM9: the same bytes, the same
errors. (tests/feed/test_loader.py runs its behaviour tests on both.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from schnet_ipu.batch import Batch
from schnet_ipu.data import MoleculeStore, edge_counts
from schnet_ipu.feed import compiled as compiled_feed
from schnet_ipu.feed.assembly import assemble
from schnet_ipu.feed.collate import PackMolecule, collate
from schnet_ipu.feed.dataset import PackedDataset
from schnet_ipu.feed.layout import Layout, LoaderError
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.packing import plan_packing
from tests.helpers import assert_same_batches, epoch_batches

pytestmark = pytest.mark.skipif(
    not compiled_feed.AVAILABLE, reason="numba is not installed (requirements.txt)"
)
CUTOFF = 5.0


@pytest.fixture(scope="module")
def store(qm9_store) -> MoleculeStore:
    return MoleculeStore(qm9_store)


def dataset(store: MoleculeStore, radius: bool, packs_per_batch: int = 5) -> PackedDataset:
    nodes = store.num_atoms
    edges = edge_counts(store, CUTOFF) if radius else None
    plan = plan_packing(nodes, edges, "tuple" if radius else "lpfhp", target_efficiency=0.9)
    layout = Layout.from_plan(plan, packs_per_batch, CUTOFF if radius else None)
    targets = store.target("U0")
    return PackedDataset(store, np.arange(len(store)), targets, plan, layout, 3, edges)


def epoch(data: PackedDataset, compiled: bool, number: int = 2) -> list[Batch]:
    data.compiled = compiled
    return epoch_batches(PackedLoader(data, chunk_batches=4), number)  # a short last chunk


@pytest.mark.parametrize("radius", [True, False], ids=["radius", "knn"])
def test_compiled_loop_writes_the_torch_programs_bytes(store, radius):
    data = dataset(store, radius)
    compiled = epoch(data, True)
    assert len(compiled) > 4
    assert_same_batches(compiled, epoch(data, False))


def test_given_molecules_too(store, monkeypatch):
    """collate: molecules from outside a store (their own indices, -1 here). (Forces are
    checked on both programs by tests/feed/test_loader.py.)"""
    data = dataset(store, radius=True)
    targets = store.target("U0")
    packs = [[PackMolecule(*store.molecule(m), float(targets[m]), -1) for m in (3, 9)], []]
    layout = dataclasses.replace(data.layout, packs_per_batch=2)
    with_loop = collate(packs, layout)
    monkeypatch.setattr(compiled_feed, "AVAILABLE", False)
    without = collate(packs, layout)
    for ours, theirs in zip(with_loop.as_tuple(), without.as_tuple()):
        assert torch.equal(ours, theirs)
    assert with_loop.molecule_index.tolist().count(-1) == layout.packs_per_batch * layout.max_graphs


def test_a_pack_over_its_edge_limit_is_named_even_with_room_in_the_batch(store):
    """The loop checks each pack's edges, not only the batch's room for them."""
    data = dataset(store, radius=True)
    pairs = edge_counts(store, CUTOFF) // 2
    a, b = (int(m) for m in np.argsort(pairs)[-2:])  # the two molecules with most pairs
    atoms = int(store.num_atoms[a] + store.num_atoms[b])
    layout = dataclasses.replace(  # room for both molecules' atoms, edges for each alone
        data.layout, max_nodes=atoms, max_graphs=2, max_edges=int(2 * pairs[b])
    )
    molecules = torch.tensor([a, b])
    lengths = torch.tensor([2] + [0] * (layout.packs_per_batch - 1))  # both in pack 0
    assert layout.packs_per_batch * layout.max_edges >= 2 * (pairs[a] + pairs[b])  # batch room
    with pytest.raises(LoaderError, match=r"pack 0 holds .* edges"):
        assemble(data.arrays, layout, molecules, lengths, compiled=True)


def test_a_molecule_index_outside_the_arrays_is_an_error(store):
    data = dataset(store, radius=True)
    lengths = torch.tensor([1] + [0] * (data.layout.packs_per_batch - 1))
    for bad in (len(store), -1):
        with pytest.raises(LoaderError, match="indices outside"):
            assemble(data.arrays, data.layout, torch.tensor([bad]), lengths, compiled=True)


def test_the_loader_uses_the_loop_when_numba_is_there(store, monkeypatch):
    """Not a silent fallback: with numba installed, CPU chunks go through the loop."""
    calls = []
    loop = compiled_feed.fill_chunk

    def counted(*args):
        calls.append(len(args))
        return loop(*args)

    monkeypatch.setattr(compiled_feed, "fill_chunk", counted)
    data = dataset(store, radius=True)
    loader = PackedLoader(data, chunk_batches=4)
    batches = sum(len(call) for call in loader.epoch(0))
    assert len(calls) == -(-batches // 4)
