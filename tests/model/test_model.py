"""SchNet model: equivalence with PyG, stable softplus, padding inertness, gradients, knn.
Over 400 lines because each property is checked for both graphs (radius and knn) with the
helpers that build their reference batches (PyG's model, brute-force edges, padded pairs)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn.models import SchNet as PygSchNet

from schnet_ipu.batch import Batch
from schnet_ipu.config import ModelConfig
from schnet_ipu.model import SchNet
from schnet_ipu.model.ops import FLAVOURS, Ops, get_ops, naive_shifted_softplus
from schnet_ipu.model.ops.torch_ops import (
    _ShiftedSoftplusFused,
    knn_graph_packed,
    pair_symmetric_conv,
    scatter_sum,
    shifted_softplus,
)
from schnet_ipu.task import ENERGY_LOSSES, masked_mse
from tests.helpers import (
    load_molecules,
    molecules_to_batch,
    pair_array,
    plan_packs,
)

CUTOFF = 6.0


def random_molecules(count: int, seed: int = 0, sizes: tuple[int, int] = (2, 29)):
    """Physically plausible stand-ins for QM9 rows: H, C, N, O, F atoms at least 0.95 A apart,
    as compact as small organic molecules, some larger than the 6 A cutoff."""
    rng = np.random.default_rng(seed)
    molecules = []
    for n in rng.integers(sizes[0], sizes[1] + 1, size=count):
        pos: list[np.ndarray] = []
        radius = 1.1 * n ** (1 / 3)
        while len(pos) < n:
            c = rng.uniform(-radius, radius, size=3)
            if all(np.linalg.norm(c - p) > 0.95 for p in pos):
                pos.append(c)
        z = rng.choice([1, 6, 7, 8, 9], size=n, p=[0.5, 0.35, 0.06, 0.07, 0.02])
        molecules.append((z, np.asarray(pos, dtype=np.float32)))
    return molecules


def qm9_or_random(count: int):
    """Real QM9 rows (random, seeded) from the store when it is there, else stand-ins."""
    store = Path(__file__).resolve().parents[2] / "data" / "qm9.h5"
    try:
        return load_molecules(str(store), count, seed=0)
    except (ImportError, OSError, ValueError):
        return random_molecules(count)


MOLECULES = qm9_or_random(16)
SIZES = [len(z) for z, _ in MOLECULES]


def max_pairs(molecules, packs) -> int:
    """Most unordered radius pairs in one pack."""
    pairs = [len(pair_array(pos, CUTOFF)) for _, pos in molecules]
    return max(sum(pairs[m] for m in pack) for pack in packs)


def tight_batch(max_nodes: int = 64, max_graphs: int = 8, radius: bool = True) -> Batch:
    packs = plan_packs(SIZES, max_nodes, max_graphs)
    edges = 2 * max_pairs(MOLECULES, packs) + 8 if radius else None
    return molecules_to_batch(MOLECULES, packs, max_nodes, max_graphs, edges, CUTOFF)


def brute_force_edges(graph: str, k: int) -> list[tuple[int, int]]:
    """(source j, receiver i) pairs over the concatenated real atoms, molecule by molecule."""
    edges = []
    start = 0
    for _, pos in MOLECULES:
        d = np.linalg.norm(pos[:, None].astype(np.float64) - pos[None], axis=-1)
        for i in range(len(pos)):
            order = [j for j in np.argsort(d[i], kind="stable") if j != i and d[i, j] <= CUTOFF]
            chosen = order[:k] if graph == "knn" else order
            edges += [(start + j, start + i) for j in chosen]
        start += len(pos)
    return edges


def pyg_predictions(model: SchNet, graph: str, readout: str) -> torch.Tensor:
    """PyG's SchNet with the same weights on the plain molecules (no packing, no padding),
    given an independently built interaction graph in pure torch."""
    edge_index = torch.tensor(brute_force_edges(graph, model.k)).t()

    def interaction_graph(pos, batch):
        return edge_index, (pos[edge_index[0]] - pos[edge_index[1]]).norm(dim=-1)

    pyg = PygSchNet(
        hidden_channels=model.hidden_channels,
        num_filters=model.num_filters,
        num_interactions=model.num_interactions,
        num_gaussians=model.num_gaussians,
        cutoff=model.cutoff,
        interaction_graph=interaction_graph,
        readout="add" if readout == "sum" else "mean",
        mean=model.mean,
        std=model.std,
        atomref=model.initial_atomref,
    )
    pyg.load_state_dict(model.state_dict(), strict=True)
    z = torch.cat([torch.as_tensor(z, dtype=torch.long) for z, _ in MOLECULES])
    pos = torch.cat([torch.as_tensor(p) for _, p in MOLECULES])
    batch = torch.repeat_interleave(torch.arange(len(MOLECULES)), torch.tensor(SIZES))
    return pyg(z, pos, batch).view(-1)


@pytest.mark.parametrize(
    ("graph", "pair_symmetric", "readout"),
    [
        ("knn", True, "sum"),
        ("knn", False, "mean"),
        ("radius", True, "sum"),
        ("radius", False, "sum"),
        ("radius", True, "mean"),
    ],
)
def test_matches_pyg_schnet(graph, pair_symmetric, readout):
    torch.manual_seed(0)
    model = SchNet(
        graph=graph,
        k=12,
        readout=readout,
        pair_symmetric=pair_symmetric,
        max_nodes_per_pack=64,
        mean=-0.4,
        std=1.7,
        atomref=torch.randn(119),
    )
    batch = tight_batch(radius=graph == "radius")
    ours = model(batch)
    expected = pyg_predictions(model, graph, readout)
    real = batch.graph_mask
    assert torch.equal(ours[~real], torch.zeros_like(ours[~real]))
    torch.testing.assert_close(
        ours[real], expected[batch.molecule_index[real]], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(("graph", "readout"), [("knn", "sum"), ("radius", "mean")])
def test_ipu_flavour_equals_torch_flavour(graph, readout):
    """Both op flavours compute the same model: outputs and every parameter gradient."""
    results = []
    for ops in ("torch", "ipu"):
        torch.manual_seed(0)
        model = SchNet(graph=graph, k=12, readout=readout, max_nodes_per_pack=64, ops=ops)
        model = model.double()
        batch = tight_batch(radius=graph == "radius")
        batch.pos = batch.pos.double()
        pred = model(batch)
        pred.square().sum().backward()
        results.append((pred.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-10, atol=1e-10)
    assert len(results[0][1]) == len(results[1][1])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["torch", "ipu"])
def test_op_flavours_conform_to_the_ops_protocol(name):
    """Every primitive the Protocol names is there, callable, and the flavour knows its name
    (the triton flavour needs the triton package: its own tests, marker ``triton``)."""
    ops = get_ops(name)
    assert isinstance(ops, Ops) and ops.name == name
    primitives = [n for n in vars(Ops) if not n.startswith("_") and callable(vars(Ops)[n])]
    assert len(primitives) == 8
    assert all(callable(getattr(ops, n)) for n in primitives)
    assert issubclass(FLAVOURS["triton"], FLAVOURS["torch"])  # the rest is the torch flavour's


def test_state_dict_names_match_pyg():
    ours = SchNet(max_nodes_per_pack=32, atomref=torch.zeros(100))
    pyg = PygSchNet(100, 100, 4, 25, 6.0, atomref=torch.zeros(100, 1))
    pyg_shapes = {k: v.shape for k, v in pyg.state_dict().items()}
    assert {k: v.shape for k, v in ours.state_dict().items()} == pyg_shapes


def test_stable_softplus_matches_reference():
    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(-60, 60, 10001, dtype=dtype)
        reference = F.softplus(x) - math.log(2.0)
        torch.testing.assert_close(shifted_softplus(x), reference)
        x.requires_grad_(True)
        (grad,) = torch.autograd.grad(shifted_softplus(x).sum(), x)
        torch.testing.assert_close(grad, torch.sigmoid(x.detach()))
    x = torch.randn(20, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(shifted_softplus, (x * 10,))


def test_compiled_softplus_polynomial_matches_reference():
    """The form used under torch.compile (log1p as a polynomial in exp(-|x|), the slope kept
    for the backward pass) agrees with float64 softplus and sigmoid to float32 rounding."""
    x = torch.linspace(-40, 40, 200001).requires_grad_(True)
    exact = x.detach().double()
    compiled = torch.compile(shifted_softplus, backend="eager", fullgraph=True)
    for fn in (_ShiftedSoftplusFused.apply, compiled):
        y = fn(x)
        (grad,) = torch.autograd.grad(y.sum(), x)
        value_error = (y.double() - (F.softplus(exact) - math.log(2.0))).abs()
        assert (value_error <= 2e-7 * exact.abs().clamp(min=1.0)).all()
        assert (grad.double() - torch.sigmoid(exact)).abs().max() < 1e-7
    assert torch.isfinite(_ShiftedSoftplusFused.apply(torch.tensor([-1e30, 1e30]))).all()


def test_stable_softplus_finite_where_naive_overflows():
    x = torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4], requires_grad=True)
    y = shifted_softplus(x)
    assert torch.isfinite(y).all()
    log2 = math.log(2.0)
    torch.testing.assert_close(
        y.detach(), torch.tensor([-log2, -log2, 0.0, 100 - log2, 1e4 - log2])
    )
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert not torch.isfinite(naive_shifted_softplus(x.detach())).all()


def scatter_reference(src, index, size):
    out = torch.zeros(size, src.shape[1], dtype=src.dtype)
    for e in range(len(index)):
        out[index[e]] += src[e]
    return out


def test_scatter_sum_unsorted_index():
    src = torch.randn(50, 3, dtype=torch.float64)
    index = torch.randint(0, 7, (50,))
    torch.testing.assert_close(scatter_sum(src, index, 9), scatter_reference(src, index, 9))


def test_pair_symmetric_conv_matches_autograd_reference():
    """The hand-written forward and backward equal plain gather * filter -> scatter."""
    gen = torch.Generator().manual_seed(3)
    pairs = torch.randint(0, 11, (2, 40), generator=gen)
    edge_index = torch.cat([pairs, pairs.flip(0)], dim=1)
    x = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    filt = torch.randn(40, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    grad = torch.randn(11, 5, dtype=torch.float64, generator=gen)
    out = pair_symmetric_conv(x, edge_index, filt)
    ref = scatter_reference(x[edge_index[0]] * torch.cat([filt, filt]), edge_index[1], 11)
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad(out, (x, filt), grad)
    want = torch.autograd.grad(ref, (x, filt), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda a, f: pair_symmetric_conv(a, edge_index, f), (x, filt))


def padded_pair(graph: str) -> tuple[Batch, Batch, int, int]:
    """The same molecules tightly packed and generously padded (more atoms, slots, edges
    and an empty pack), with their pack sizes."""
    sizes = SIZES[:10]
    tight_nodes = max(sum(sizes[:4]), max(sizes))
    packs = plan_packs(sizes, tight_nodes, 4)
    radius = graph == "radius"
    pairs = 2 * max_pairs(MOLECULES, packs)
    tight = molecules_to_batch(MOLECULES, packs, tight_nodes, 4, pairs if radius else None)
    roomy_nodes = tight_nodes + 13
    roomy = molecules_to_batch(
        MOLECULES, [*packs, []], roomy_nodes, 6, 3 * pairs if radius else None
    )
    return tight, roomy, tight_nodes, roomy_nodes


def per_molecule(pred: torch.Tensor, batch: Batch) -> torch.Tensor:
    out = torch.zeros(len(MOLECULES), dtype=pred.dtype)
    real = batch.graph_mask
    return out.index_add(0, batch.molecule_index[real], pred[real])


@pytest.mark.parametrize("graph", ["knn", "radius"])
def test_padding_is_inert(graph):
    torch.manual_seed(1)
    model = SchNet(graph=graph, k=8, max_nodes_per_pack=1, mean=0.5, std=2.0)
    tight, roomy, tight_nodes, roomy_nodes = padded_pair(graph)
    assert roomy.num_nodes > tight.num_nodes and roomy.num_graphs > tight.num_graphs
    weights = torch.randn(len(MOLECULES))
    results = []
    for batch, nodes in ((tight, tight_nodes), (roomy, roomy_nodes)):
        model.max_nodes_per_pack = nodes
        model.zero_grad()
        batch.y = torch.full_like(batch.y, float("nan"))  # padding targets are arbitrary
        batch.y[batch.graph_mask] = 1.0
        pred = model(batch)
        loss = (
            masked_mse(pred, batch.y, batch.graph_mask, 3.0)
            + (per_molecule(pred, batch) * weights).sum()
        )
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((per_molecule(pred, batch).detach(), loss.detach(), grads))
    (pred_a, loss_a, grads_a), (pred_b, loss_b, grads_b) = results
    torch.testing.assert_close(pred_a, pred_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-5)
    for name, grad in grads_a.items():
        assert torch.isfinite(grads_b[name]).all(), name
        torch.testing.assert_close(grad, grads_b[name], rtol=1e-4, atol=1e-5, msg=name)


def tiny_model(graph: str, pair_symmetric: bool = True) -> SchNet:
    torch.manual_seed(2)
    model = SchNet(
        hidden_channels=6,
        num_filters=5,
        num_interactions=2,
        num_gaussians=7,
        cutoff=CUTOFF,
        graph=graph,
        k=4,
        pair_symmetric=pair_symmetric,
        max_nodes_per_pack=8,
        atomref=torch.randn(10),
    )
    return model.double()


@pytest.mark.parametrize("graph", ["knn", "radius"])
def test_gradcheck_tiny_model(graph):
    model = tiny_model(graph)
    small = random_molecules(5, seed=3, sizes=(2, 6))
    packs = plan_packs([len(z) for z, _ in small], 8, 3)
    batch = molecules_to_batch(small, [*packs, []], 8, 3, 80 if graph == "radius" else None)
    batch.pos = batch.pos.double()
    names = ["embedding.weight", "interactions.0.mlp.0.weight", "interactions.1.conv.lin1.weight"]
    names += ["interactions.1.mlp.2.bias", "lin2.weight", "atomref.weight"]
    params = dict(model.named_parameters())

    def fn(pos, *tensors):
        batch.pos = pos
        overrides = dict(zip(names, tensors, strict=True))
        return torch.func.functional_call(model, {**params, **overrides}, (batch,))

    inputs = [batch.pos.clone().requires_grad_(True)]
    inputs += [params[n].detach().clone().requires_grad_(True) for n in names]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, fast_mode=True)


def test_pair_symmetric_filter_equals_per_edge_filter():
    model = tiny_model("radius")
    batch = tight_batch(radius=True)
    edge_index, dist, edge_mask = model.interaction_graph(batch)
    half = edge_index.shape[1] // 2
    rbf, cut = model.edge_features(dist, edge_mask)
    shared_rbf, shared_cut = model.edge_features(dist[:half], edge_mask[:half])
    for block in model.interactions:
        full = block.conv.filter(rbf, cut)
        shared = block.conv.filter(shared_rbf, shared_cut)
        torch.testing.assert_close(full[:half], shared)
        torch.testing.assert_close(full[half:], shared)
    # the cutoff is the masked cosine cutoff
    expected_cut = 0.5 * (torch.cos(dist * math.pi / CUTOFF) + 1) * edge_mask
    torch.testing.assert_close(cut, expected_cut)
    # the whole model, outputs and gradients
    results = []
    for flag in (True, False):
        model.pair_symmetric = flag
        model.zero_grad()
        pred = model(batch)
        pred.square().sum().backward()
        results.append((pred.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    assert len(results[0][1]) == len(results[1][1])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def test_padding_edges_are_masked_even_on_a_real_atom():
    # a batch without padding atoms: its padding edges are self loops on (real) atom 0
    sizes = SIZES[:3]
    batch = molecules_to_batch(MOLECULES, [[0, 1, 2]], sum(sizes), 3, 2 * sum(sizes) ** 2)
    assert batch.node_mask.all() and not batch.edge_mask.all()
    assert (batch.edge_index[:, ~batch.edge_mask] == 0).all()
    trimmed = molecules_to_batch(MOLECULES, [[0, 1, 2]], sum(sizes), 3, int(batch.edge_mask.sum()))
    assert trimmed.edge_mask.all()
    model = tiny_model("radius").float()
    torch.testing.assert_close(model(batch), model(trimmed))


@pytest.mark.parametrize(("k", "nodes"), [(5, 40), (12, 40), (30, 40), (50, 40)])
def test_knn_graph_is_true_nearest_within_molecule(k, nodes):
    molecules = MOLECULES[:12]
    packs = plan_packs([len(z) for z, _ in molecules], nodes, 5)
    batch = molecules_to_batch(molecules, [*packs, []], nodes, 5)
    edge_index, dist, mask = knn_graph_packed(
        batch.pos, batch.graph, batch.node_mask, nodes, k, CUTOFF
    )
    n = batch.num_nodes
    assert edge_index.shape == (2, n * k) and dist.shape == mask.shape == (n * k,)
    src, dst = edge_index
    assert torch.equal(torch.bincount(dst, minlength=n), torch.full((n,), k))  # k per atom
    assert torch.equal(batch.graph[src], batch.graph[dst])  # never across molecules
    assert (src[~mask] == dst[~mask]).all() and (dist[~mask] == CUTOFF).all()
    assert batch.node_mask[src[mask]].all() and batch.node_mask[dst[mask]].all()
    pos = batch.pos.double()
    for i in range(n):
        row = slice(i * k, (i + 1) * k)
        got = sorted(src[row][mask[row]].tolist())
        if not batch.node_mask[i]:
            assert got == []
            continue
        same = torch.nonzero((batch.graph == batch.graph[i]) & (torch.arange(n) != i)).view(-1)
        d = (pos[same] - pos[i]).norm(dim=-1)
        within = same[d <= CUTOFF][torch.argsort(d[d <= CUTOFF])]
        assert got == sorted(within[:k].tolist()), i
        torch.testing.assert_close(
            dist[row][mask[row]].double(),
            (pos[src[row][mask[row]]] - pos[i]).norm(dim=-1),
            rtol=1e-6,
            atol=1e-6,
        )


@pytest.mark.parametrize(
    "kind, expected", [("mse", (0.5**2 + 1.5**2) / 2), ("l1", (0.5 + 1.5) / 2)]
)
def test_energy_losses_skip_padding(kind, expected):
    loss_fn = ENERGY_LOSSES[kind]
    pred = torch.tensor([1.0, 2.0, 3.0, 4.0])
    y = torch.tensor([0.0, 5.0, float("nan"), float("inf")])
    mask = torch.tensor([True, True, False, False])
    assert loss_fn(pred, y, mask, 2.0).item() == pytest.approx(expected)
    pred.requires_grad_(True)
    loss_fn(pred, y, mask, 2.0).backward()
    assert torch.isfinite(pred.grad).all() and torch.equal(pred.grad[2:], torch.zeros(2))
    pred.grad = None
    loss = loss_fn(pred, y, torch.zeros(4, dtype=torch.bool), 2.0)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(pred.grad, torch.zeros(4))


def test_from_config():
    cfg = ModelConfig(hidden_channels=8, num_filters=6, num_interactions=3, k=5, graph="radius")
    model = SchNet.from_config(cfg, max_nodes_per_pack=32, mean=1.0, std=2.0, atomref=None)
    assert len(model.interactions) == 3 and model.interactions[0].mlp[2].out_features == 6
    assert (model.graph, model.k, model.mean, model.std) == ("radius", 5, 1.0, 2.0)
    with pytest.raises(ValueError, match="max_nodes_per_pack"):
        SchNet(graph="knn")
