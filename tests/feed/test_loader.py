"""Fixed-shape batches from real QM9 rows: shapes, masks, cover, determinism, failures (each
test on both the compiled loop and the torch program)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from schnet_ipu.data import MoleculeStore, edge_counts, import_qm9, write_store
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.feed.assembly import assemble_batch
from schnet_ipu.feed.chunk import OutputBuffers
from schnet_ipu.feed.collate import PackMolecule, collate
from schnet_ipu.feed.dataset import PackedDataset
from schnet_ipu.feed.layout import Layout, LoaderError
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.packing import plan_packing
from tests.helpers import assert_same_batches, epoch_batches

CUTOFF = 5.0


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> MoleculeStore:
    path = tmp_path_factory.mktemp("qm9") / "qm9_300.h5"
    import_qm9(path, limit=300)
    return MoleculeStore(path)


pytestmark = pytest.mark.usefixtures("feed_program")  # every test on both programs


def make_dataset(store, radius=False, replicas=1, replica=0, micro=1, indices=None, targets=None):
    indices = np.arange(len(store)) if indices is None else indices
    nodes = store.num_atoms[indices]
    edges = edge_counts(store, CUTOFF)[indices] if radius else None
    plan = plan_packing(
        nodes, edges, algorithm="tuple" if radius else "lpfhp", target_efficiency=0.9
    )
    layout = Layout.from_plan(
        plan,
        packs_per_batch=4,
        cutoff=CUTOFF if radius else None,
        micro_per_call=micro,
        replicas=replicas,
        replica=replica,
    )
    targets = store.target("U0") if targets is None else targets
    return PackedDataset(store, indices, targets, plan, layout, seed=7, edge_counts=edges)


@pytest.mark.parametrize("radius", [False, True], ids=["knn", "radius"])
def test_shapes_fixed_over_epochs_and_cover_exact(store, radius):
    dataset = make_dataset(store, radius=radius)
    loader = PackedLoader(dataset)
    lay = dataset.layout
    for epoch in range(2):
        batches = epoch_batches(loader, epoch)
        assert len({b.signature() for b in batches}) == 1
        b = batches[0]
        assert b.z.shape == (lay.packs_per_batch * lay.max_nodes,)
        assert b.y.shape == (lay.packs_per_batch * lay.max_graphs,)
        assert b.graph.dtype == torch.int64 and b.molecule_index.dtype == torch.int64
        if radius:
            assert b.edge_index.shape == (2, lay.packs_per_batch * lay.max_edges)
        seen = torch.cat([b.molecule_index[b.graph_mask] for b in batches]).numpy()
        assert sorted(seen.tolist()) == list(range(len(store)))  # each molecule exactly once
        # the loader's host counts (no device sync on a GPU) equal the masks' counts
        assert [b.known_molecules for b in batches] == [int(b.graph_mask.sum()) for b in batches]
        moved = batches[0].to("cpu")
        assert moved.known_molecules == batches[0].num_molecules


def test_batches_hold_the_store_molecules_and_masks_are_right(store):
    dataset = make_dataset(store)
    targets = store.target("U0")
    for b in epoch_batches(PackedLoader(dataset), 0):
        G = b.num_graphs
        assert torch.equal(b.node_mask, b.z > 0)
        assert torch.equal(b.node_mask, b.graph < G)
        assert torch.equal(b.graph_mask, b.molecule_index >= 0)
        for slot in torch.nonzero(b.graph_mask).flatten().tolist():
            index = int(b.molecule_index[slot])
            z, pos = store.molecule(index)
            atoms = b.graph == slot
            assert torch.equal(b.z[atoms], torch.from_numpy(z.astype(np.int64)))
            assert torch.allclose(b.pos[atoms], torch.from_numpy(pos))
            assert b.y[slot] == pytest.approx(targets[index], rel=1e-6)
        # padding atoms are further than any cutoff from everything else
        padding, real = b.pos[~b.node_mask], b.pos[b.node_mask]
        if len(padding):
            assert torch.cdist(padding, real).min() > 10 * CUTOFF
            distances = torch.cdist(padding, padding) + 1e9 * torch.eye(len(padding))
            assert distances.min() > 10 * CUTOFF


def test_radius_edges_are_halves_within_molecules_and_complete(store):
    dataset = make_dataset(store, radius=True)
    batches = epoch_batches(PackedLoader(dataset), 0)
    edges = int(edge_counts(store, CUTOFF).sum())  # every molecule's, once per direction
    assert sum(int(b.edge_mask.sum()) for b in batches) == edges
    for b in batches:
        half = b.edge_index.shape[1] // 2
        forward, backward = b.edge_index[:, :half], b.edge_index[:, half:]
        assert torch.equal(backward, forward.flip(0))
        assert torch.equal(b.edge_mask[:half], b.edge_mask[half:])
        src, dst = forward[:, b.edge_mask[:half]]
        assert torch.all(b.graph[src] == b.graph[dst]) and torch.all(b.node_mask[src])
        assert torch.all(src < dst)
        # every pair within the cutoff inside a molecule is present, once
        d = torch.cdist(b.pos, b.pos)
        same = (b.graph[:, None] == b.graph[None, :]) & b.node_mask[:, None]
        expected = torch.nonzero(torch.triu(same & (d < CUTOFF), diagonal=1))
        got = torch.stack([src, dst], 1)
        assert sorted(map(tuple, expected.tolist())) == sorted(map(tuple, got.tolist()))


def test_a_real_target_of_zero_is_trained(store):
    dataset = make_dataset(store, targets=np.zeros(len(store)))
    batch = dataset[(0, 0)]
    assert batch.graph_mask.sum() > 0 and torch.all(batch.y[batch.graph_mask] == 0)


def test_epochs_redraw_contents_but_not_shapes(store):
    dataset = make_dataset(store)
    a, b = dataset[(0, 0)], dataset[(1, 0)]
    assert a.signature() == b.signature()
    assert not torch.equal(a.molecule_index, b.molecule_index)
    assert torch.equal(dataset[(0, 0)].molecule_index, a.molecule_index)


def test_same_batches_whatever_the_mode_threads_and_chunking(store, restore_threads):
    dataset = make_dataset(store, radius=True, micro=2)
    torch.set_num_threads(1)
    reference = epoch_batches(PackedLoader(dataset, workers=0), 1)  # one chunk, one thread
    threads = PackedLoader(dataset, workers=2, prefetch=2, chunk_batches=3)
    for epoch in (1, 1):  # the same epoch twice
        assert_same_batches(reference, epoch_batches(threads, epoch))
    # in-process on 2 torch threads: 2 chunks at once, one single-threaded chunk per thread
    torch.set_num_threads(2)
    grouped = PackedLoader(dataset, workers=0, chunk_batches=2)
    assert grouped.at_once == 2
    assert_same_batches(reference, epoch_batches(grouped, 1))
    # device-resident: the arrays on the training device (the CPU here), same program
    on_device = make_dataset(store, radius=True, micro=2)
    on_device.arrays = dataset.arrays.to("cpu")
    assert_same_batches(reference, epoch_batches(PackedLoader(on_device, chunk_batches=1), 1))
    # and the public collate of the same molecules, read one by one from the store
    targets = store.target("U0")
    for i, batch in enumerate(reference[:4]):
        layout, packs = dataset.layout, dataset.packs(1)
        first = dataset.global_micro_batch(i) * layout.packs_per_batch
        molecules, starts, lengths = packs
        members = [
            molecules[starts[p] : starts[p] + lengths[p]].tolist()
            for p in range(first, min(first + layout.packs_per_batch, len(lengths)))
        ]
        given = [
            [PackMolecule(*store.molecule(m), float(targets[m]), m) for m in pack]
            for pack in members
        ]
        assert_same_batches([batch], [collate(given, layout)])


def test_output_memory_is_reused_only_once_nothing_views_it():
    buffers = OutputBuffers(keep=2)
    first = buffers.take(100)
    address = first.data_ptr()
    kept = first[8:24].view(torch.int64)  # a view of it, as a batch's tensors are
    del first
    second = buffers.take(100)
    assert second.data_ptr() != address  # still viewed: another buffer
    own = buffers.take(100)  # both kept buffers in use: memory of its own
    assert buffers.nbytes() == 200 and own.data_ptr() not in (address, second.data_ptr())
    del kept
    assert buffers.take(60).data_ptr() == address  # nothing views it now: handed out again


def test_batches_a_caller_keeps_are_never_overwritten(store):
    dataset = make_dataset(store, radius=True)
    loader = PackedLoader(dataset, chunk_batches=1)  # a chunk per batch
    kept = epoch_batches(loader, 0)[::2]  # the others' memory is free to go round again
    assert len(kept) > loader.buffers.keep
    for epoch in (1, 2):  # batches dropped as read
        for call in loader.epoch(epoch):
            assert call[0].z.numel() > 0
    expected = epoch_batches(PackedLoader(dataset, chunk_batches=1), 0)[::2]
    assert_same_batches(kept, expected)


def test_loaders_taking_turns_share_their_chunk_memory(store):
    memory = OutputBuffers()
    first = PackedLoader(make_dataset(store, radius=True), chunk_batches=2, buffers=memory)
    assert sum(len(call) for call in first.epoch(0)) > 4  # several chunks
    used = memory.nbytes()
    assert used > 0
    second = PackedLoader(
        make_dataset(store, radius=True, micro=2), chunk_batches=2, buffers=memory
    )
    for epoch in (0, 1):
        for _ in second.epoch(epoch):
            pass
    assert memory.nbytes() == used  # the second loader wrote into the first one's buffers


def test_replicas_read_distinct_shares_that_cover_the_epoch(store):
    shares = []
    for replica in range(2):
        dataset = make_dataset(store, replicas=2, replica=replica, micro=2)
        loader = PackedLoader(dataset)
        calls = list(loader.epoch(0))
        assert all(len(call) == 2 for call in calls)
        shares.append(torch.cat([b.molecule_index[b.graph_mask] for c in calls for b in c]))
    assert len(shares[0]) > 0 and len(shares[1]) > 0
    assert not set(shares[0].tolist()) & set(shares[1].tolist())
    assert sorted(torch.cat(shares).tolist()) == list(range(len(store)))


def test_resume_starts_at_the_requested_call(store):
    loader = PackedLoader(make_dataset(store))
    everything = list(loader.epoch(0))
    rest = list(loader.epoch(0, start_call=3))
    assert len(rest) == len(everything) - 3
    assert torch.equal(rest[0][0].molecule_index, everything[3][0].molecule_index)


def test_shape_change_fails_loudly(store):
    loader = PackedLoader(make_dataset(store))
    batch = make_dataset(store)[(0, 0)]
    loader.check_shape(batch)
    batch.z = batch.z[:-1]
    with pytest.raises(LoaderError, match="batch shapes changed"):
        loader.check_shape(batch)


def test_unreadable_store_names_the_file(store, tmp_path):
    broken = tmp_path / "broken.h5"
    broken.write_bytes(store.path.read_bytes())
    opened = MoleculeStore(broken)
    targets = opened.target("U0")
    opened.close()
    broken.write_bytes(b"not hdf5 any more")  # the molecules are read after this
    with pytest.raises(LoaderError, match=r"cannot read the molecules of .*broken\.h5"):
        make_dataset(opened, targets=targets)


@pytest.mark.parametrize("what", ["atoms", "edges"])
def test_a_molecule_too_large_for_a_pack_is_named(store, what):
    dataset = make_dataset(store, radius=True)
    biggest = int(np.argmax(store.num_atoms if what == "atoms" else edge_counts(store, CUTOFF)))
    lay = dataset.layout
    if what == "atoms":
        lay = dataclasses.replace(lay, max_nodes=int(store.num_atoms[biggest]) - 1)
    else:
        lay = dataclasses.replace(lay, max_edges=int(edge_counts(store, CUTOFF)[biggest]) - 2)
    record = int(store.ids[biggest])
    with pytest.raises(
        LoaderError, match=rf"molecule {biggest} \(record {record}\).* {what}.*max_"
    ):
        assemble_batch(dataset.arrays, lay, [[biggest]])


def test_a_pack_over_its_limits_is_an_error(store):
    dataset = make_dataset(store)
    pack = np.arange(dataset.layout.max_graphs + 1)
    with pytest.raises(LoaderError, match="pack 0 holds"):
        assemble_batch(dataset.arrays, dataset.layout, [pack])


def test_forces_are_gathered_like_positions(store, tmp_path):
    z, pos = store.concatenated()
    forces = np.random.default_rng(0).normal(size=pos.shape).astype(np.float32)
    path = write_store(
        tmp_path / "forces.h5", z, pos, {"U0": store.target("U0")}, {"U0": "eV"},
        offsets=store.offsets, forces=forces, forces_unit="eV/Angstrom",
    )  # fmt: skip
    with_forces = MoleculeStore(path)
    for b in epoch_batches(PackedLoader(make_dataset(with_forces, radius=True)), 0):
        assert b.forces.shape == b.pos.shape and b.forces.dtype == torch.float32
        assert torch.all(b.forces[~b.node_mask] == 0)
        for slot in torch.nonzero(b.graph_mask).flatten().tolist():
            m = int(b.molecule_index[slot])
            want = forces[store.offsets[m] : store.offsets[m + 1]]
            assert torch.equal(b.forces[b.graph == slot], torch.from_numpy(want))


def reference_batch(packs: list[list[PackMolecule]], layout: Layout) -> dict[str, torch.Tensor]:
    """The batch of ``packs`` written out atom by atom and pair by pair from the conventions
    in schnet_ipu.batch, with its own distance test (float32, x + y + z, <= cutoff**2)."""
    B, size, slots = layout.packs_per_batch, layout.max_nodes, layout.max_graphs
    N, G, E = B * size, B * slots, B * layout.max_edges
    z, pos, graph = np.zeros(N, np.int64), np.zeros((N, 3), np.float32), np.full(N, G)
    y, graph_mask, index = np.zeros(G, np.float32), np.zeros(G, bool), np.full(G, -1)
    forward = []
    limit = np.float32(layout.cutoff) * np.float32(layout.cutoff)
    for p, pack in enumerate(packs):
        row = p * size
        for s, m in enumerate(pack):
            slot = p * slots + s
            y[slot], graph_mask[slot], index[slot] = m.y, True, m.index
            xyz = np.asarray(m.pos, np.float32)
            for i in range(len(m.z)):
                z[row + i], pos[row + i], graph[row + i] = m.z[i], xyz[i], slot
                for j in range(i + 1, len(m.z)):
                    d = xyz[i] - xyz[j]
                    if d[0] * d[0] + d[1] * d[1] + d[2] * d[2] <= limit:
                        forward.append((row + i, row + j))
            row += len(m.z)
    padding = np.flatnonzero(graph == G)
    pos[padding, 0] = 1000.0 + 100.0 * np.arange(len(padding))
    filler = padding[0] if len(padding) else 0
    half = np.full((2, E // 2), filler)
    half[:, : len(forward)] = np.array(forward, dtype=np.int64).reshape(-1, 2).T
    mask = np.arange(E // 2) < len(forward)
    return {
        "z": torch.from_numpy(z),
        "pos": torch.from_numpy(pos),
        "graph": torch.from_numpy(graph),
        "node_mask": torch.from_numpy(graph < G),
        "y": torch.from_numpy(y),
        "graph_mask": torch.from_numpy(graph_mask),
        "molecule_index": torch.from_numpy(index),
        "edge_index": torch.from_numpy(np.concatenate([half, half[::-1]], 1)),
        "edge_mask": torch.from_numpy(np.concatenate([mask, mask])),
    }


def test_assembly_equals_a_batch_written_out_by_hand(store):
    """Edge cases of the array program against the conventions written out one by one:
    empty packs, a lone atom and a far-apart pair (no pairs), a pack and a batch exactly full
    (no padding atom: padding edges join atom 0; no padding edge at all)."""
    targets = store.target("U0")
    real = [PackMolecule(*store.molecule(m), float(targets[m]), m) for m in range(12)]
    lone = PackMolecule(np.array([1], np.uint8), np.zeros((1, 3), np.float32), -1.5, -1)
    apart = np.array([[0, 0, 0], [CUTOFF + 1e-3, 0, 0]], np.float32)
    far = PackMolecule(np.array([8, 1], np.uint8), apart, 2.5, -1)
    full = [[real[7]], [real[7]], [real[7]]]  # every pack full: no padding atom
    cases = [  # (packs, spare directed edges per pack)
        ([[real[0], lone], [], [far, real[1], real[3]]], 0),
        (full, 0),  # and no padding edge
        (full, 2),  # padding edges join atom 0
        ([[real[4], real[5]], [real[6]], []], 4),
    ]
    for packs, spare in cases:
        pairs = [sum(len(molecule_pairs(m.pos, CUTOFF)[0]) for m in pack) for pack in packs]
        layout = Layout(
            packs_per_batch=3,
            max_nodes=max(sum(len(m.z) for m in pack) for pack in packs),
            max_graphs=max(len(pack) for pack in packs),
            max_edges=max(2 * max(pairs), 2) + spare,
            cutoff=CUTOFF,
        )
        batch = collate(packs, layout)
        for name, expected in reference_batch(packs, layout).items():
            got = getattr(batch, name)
            assert got.dtype == expected.dtype and torch.equal(got, expected), name


def test_more_packs_than_a_batch_holds_is_an_error():
    layout = Layout(packs_per_batch=1, max_nodes=3, max_graphs=1)
    water = PackMolecule(np.array([8, 1, 1], np.uint8), np.eye(3, dtype=np.float32), 0.0, -1)
    assert collate([[water]], layout).num_molecules == 1
    with pytest.raises(LoaderError, match="2 packs for a batch of 1"):
        collate([[water], [water]], layout)
