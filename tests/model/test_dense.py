"""Dense message passing computes the sparse model: outputs and every parameter gradient."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from schnet_ipu.batch import Batch
from schnet_ipu.config import ModelConfig
from schnet_ipu.model import SchNet
from schnet_ipu.model.dense import dense_graph, pair_efficiency
from tests.helpers import load_molecules, molecules_to_batch, pair_array, plan_packs

CUTOFF = 6.0


def random_molecules(count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random clouds of 2..29 atoms, some wider than the cutoff (so some pairs are out)."""
    rng = np.random.default_rng(seed)
    molecules = []
    for n in rng.integers(2, 30, size=count):
        pos = rng.uniform(-1.0, 1.0, size=(n, 3)) * 1.6 * n ** (1 / 3)
        molecules.append((rng.choice([1, 6, 7, 8, 9], size=n), pos.astype(np.float32)))
    return molecules


def qm9_molecules(store: Path, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return load_molecules(str(store), count, seed=3)


def padded_batch(molecules, graph: str) -> tuple[Batch, int]:
    """Packs with spare atoms, slots and edges, plus one empty pack; positions in float64."""
    sizes = [len(z) for z, _ in molecules]
    max_nodes = max(sizes) + 11
    packs = [*plan_packs(sizes, max_nodes, 5), []]
    edges = None
    if graph == "radius":
        pairs = [len(pair_array(pos, CUTOFF)) for _, pos in molecules]
        edges = 2 * max(sum(pairs[m] for m in p) for p in packs) + 6
    batch = molecules_to_batch(molecules, packs, max_nodes, 6, edges, CUTOFF)
    batch.pos = batch.pos.double()
    return batch, max_nodes


def run(model: SchNet, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    pred = model(batch)
    weights = torch.linspace(-1.0, 2.0, len(pred), dtype=pred.dtype)
    (pred * weights).sum().backward()
    return pred.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("source", ["qm9", "random"])
@pytest.mark.parametrize(("graph", "k"), [("radius", 24), ("knn", 6)])
def test_dense_equals_sparse(source, graph, k, qm9_store):
    molecules = qm9_molecules(qm9_store, 14) if source == "qm9" else random_molecules(14, seed=5)
    batch, max_nodes = padded_batch(molecules, graph)
    results = {}
    for layout in ("sparse", "dense"):
        torch.manual_seed(0)
        model = SchNet(
            hidden_channels=16, num_filters=12, num_interactions=2, num_gaussians=10,
            cutoff=CUTOFF, graph=graph, k=k, max_nodes_per_pack=max_nodes,
            message_passing=layout, mean=0.3, std=1.7,
        ).double()  # fmt: skip
        results[layout] = run(model, batch)
    (pred_s, grads_s), (pred_d, grads_d) = results["sparse"], results["dense"]
    assert pred_s[batch.graph_mask].abs().min() > 0  # real molecules get real predictions
    torch.testing.assert_close(pred_d, pred_s, rtol=0, atol=1e-6)
    assert grads_s.keys() == grads_d.keys()
    for name, grad in grads_s.items():
        assert grad.abs().max() > 0, name  # every parameter is exercised
        torch.testing.assert_close(grads_d[name], grad, rtol=0, atol=1e-6, msg=name)


def test_dense_mask_is_the_radius_graph():
    """The dense mask holds exactly the batch's real radius edges; padding pairs none."""
    batch, max_nodes = padded_batch(random_molecules(10, seed=1), "radius")
    _, mask = dense_graph(batch, max_nodes, CUTOFF)
    src, dst = batch.edge_index[:, batch.edge_mask]
    pack = dst // max_nodes
    expected = torch.zeros_like(mask)
    expected[pack, dst % max_nodes, src % max_nodes] = True
    assert torch.equal(mask, expected)
    assert 0 < pair_efficiency(mask) < 1
    padding = ~batch.node_mask.view(mask.shape[:2])
    assert not mask[padding].any() and not mask.transpose(1, 2)[padding].any()


def test_knn_mask_keeps_k_nearest():
    batch, max_nodes = padded_batch(random_molecules(10, seed=2), "knn")
    dist, mask = dense_graph(batch, max_nodes, CUTOFF, k=4)
    assert mask.sum(-1).max() == 4
    _, within = dense_graph(batch, max_nodes, CUTOFF)
    # a receiver with fewer than k neighbours within the cutoff keeps them all
    few = within.sum(-1) <= 4
    assert torch.equal(mask[few], within[few])
    # every kept neighbour is nearer than (or as near as) every dropped one
    kept = torch.where(mask, dist, -1.0).amax(-1)
    dropped = torch.where(within & ~mask, dist, float("inf")).amin(-1)
    assert (kept <= dropped).all()


def test_from_config_reads_message_passing():
    model = SchNet.from_config(ModelConfig(message_passing="dense"), max_nodes_per_pack=32)
    assert model.message_passing == "dense"
    with pytest.raises(ValueError, match="max_nodes_per_pack"):
        SchNet(graph="radius", message_passing="dense")


def test_dense_runs_in_the_ipu_flavour():
    """The dense layout uses only ops the ipu flavour allows: it gives the torch flavour's
    outputs and gradients."""
    batch, max_nodes = padded_batch(random_molecules(8, seed=7), "knn")
    results = []
    for ops in ("torch", "ipu"):
        torch.manual_seed(0)
        model = SchNet(
            hidden_channels=8, num_filters=8, num_interactions=1, num_gaussians=6, k=5,
            max_nodes_per_pack=max_nodes, message_passing="dense", ops=ops,
        ).double()  # fmt: skip
        results.append(run(model, batch))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-10)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=0, atol=1e-10, msg=name)
