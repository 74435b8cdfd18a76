"""``loader.shard``: each replica's loaders hold its share of every split and its feed reads
only those molecules; over the replicas every molecule is in exactly one share, each epoch,
with batches equal to the same packs gathered from the whole store."""

from __future__ import annotations

import numpy as np
import pytest

from schnet_ipu.config import ConfigError, load_config
from schnet_ipu.data import load_or_make_split
from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.feed.assembly import assemble_batch
from schnet_ipu.training.data import make_loader, prepare_data
from schnet_ipu.training.loop import train
from tests.helpers import assert_same_batches, epoch_batches, qm9_smoke_overrides

REPLICAS = 3


def config(store, tmp_path, *extra):
    overrides = qm9_smoke_overrides(store, tmp_path / "run", "loader.shard=true", *extra)
    return load_config(None, overrides)


@pytest.mark.parametrize("graph", ["radius", "knn"])
def test_shares_cover_every_split_once_each_epoch(qm9_small, tmp_path, graph):
    extra = [f"model.graph={graph}", "model.k=6"] + (["packing.algorithm=lpfhp"] * (graph == "knn"))
    cfg = config(qm9_small, tmp_path, *extra)
    seen = {split: {} for split in ("train", "val", "test")}
    calls = set()
    for replica in range(REPLICAS):
        data = prepare_data(cfg)
        for split, epochs in seen.items():
            loader = make_loader(cfg, data, split, replica, REPLICAS)
            calls.add((split, len(loader)))
            for epoch in (0, 1):
                ids = [b.molecule_index[b.graph_mask] for b in epoch_batches(loader, epoch)]
                epochs.setdefault(epoch, []).append(np.concatenate(ids))
        feed = data.feed_arrays("cpu")  # this replica's molecules only
        assert len(feed.num_atoms) == len(data.held) < len(data.store) // 2
        assert np.array_equal(feed.store_index.numpy(), data.held)
    assert len(calls) == 3  # every replica runs the same host calls of each split
    for split, epochs in seen.items():
        for shares in epochs.values():
            every = np.concatenate(shares)
            assert np.array_equal(np.sort(every), np.sort(data.split[split]))  # once each
        for replica in range(REPLICAS):  # the same share every epoch
            assert set(epochs[0][replica].tolist()) == set(epochs[1][replica].tolist())


def test_share_batches_equal_the_same_packs_from_the_whole_store(qm9_small, tmp_path):
    """Atoms, targets, radius pairs: what a replica reads of its share is what the whole
    store's arrays give for the same packs."""
    cfg = config(qm9_small, tmp_path)
    data = prepare_data(cfg)
    loader = make_loader(cfg, data, "train", 1, REPLICAS)
    whole = FeedArrays.from_store(data.store, data.targets, data.pairs)
    dataset = loader.dataset
    stores = dataset.arrays.store_index
    batches = epoch_batches(loader, 1)
    molecules, lengths, first = dataset.batch_order(1)
    B = dataset.layout.packs_per_batch
    again = []
    for i in range(len(batches)):
        in_batch = stores[molecules[first[i] : first[i + 1]]].numpy()
        cuts = np.cumsum(lengths[i * B : (i + 1) * B].numpy())[:-1]
        again.append(assemble_batch(whole, dataset.layout, np.split(in_batch, cuts)))
    assert_same_batches(batches, again)


def test_a_split_with_fewer_packs_than_replicas_is_one_line(qm9_small, tmp_path):
    cfg = config(qm9_small, tmp_path, "data.val=3")
    data = prepare_data(cfg)
    with pytest.raises(ConfigError, match=r"the val split fills 1 pack\(s\), fewer than the 3"):
        make_loader(cfg, data, "train", 0, REPLICAS)


def test_shards_and_cost_model_grouping_are_refused_together(qm9_small, tmp_path):
    with pytest.raises(ConfigError, match=r"replica_balance=cost_model .* loader\.shard=true"):
        config(qm9_small, tmp_path, "packing.replica_balance=cost_model")


def test_a_run_records_the_molecules_it_trained_on(qm9_small, tmp_path):
    """logging.seen_molecules: per epoch, the store indices the rank trained on (one rank:
    the whole training split, in that epoch's order)."""
    cfg = config(qm9_small, tmp_path, "optim.epochs=2", "logging.seen_molecules=true")
    train(cfg)
    files = sorted((tmp_path / "run/seen").iterdir())
    assert [f.name for f in files] == ["e0.c0.r0.npy", "e1.c0.r0.npy"]
    split = load_or_make_split(qm9_small, 400, 60, 60, seed=0)["train"]
    epochs = [np.load(f) for f in files]
    for molecules in epochs:
        assert np.array_equal(np.sort(molecules), np.sort(split))
    assert not np.array_equal(epochs[0], epochs[1])  # packs are drawn anew each epoch
