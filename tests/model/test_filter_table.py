"""The tabulated filter (``model.filter: table``): the table is the network and its exact
derivative, every flavour's ``table_conv`` agrees with the torch ops, and whole models with
tables match the exact filter on real QM9, water (knn) and EMT forces, converging in K."""

from __future__ import annotations

import pytest
import torch

from schnet_ipu.backends.poptorch_ops import check_poptorch_ops
from schnet_ipu.config import ConfigError, load_config
from schnet_ipu.data import MoleculeStore
from schnet_ipu.data.water_sampled import generate_water_sampled
from schnet_ipu.model import SchNet
from schnet_ipu.model.filter_table import filter_tables, grid_position, hermite_filter
from schnet_ipu.model.ops import fused_table, ipu_ops, torch_ops
from schnet_ipu.response import energy_response
from tests.helpers import load_molecules, molecules_to_batch, pair_array, plan_packs
from tests.training.test_forces import emt_batch, emt_frames, forces_pass_gradcheck

CUTOFF = 6.0
PAPER = dict(hidden_channels=100, num_filters=100, num_interactions=4, num_gaussians=25)


def paper_model(graph: str, filter_: str, points: int = 256, **kwargs) -> SchNet:
    torch.manual_seed(0)
    return SchNet(
        **PAPER,
        cutoff=CUTOFF,
        graph=graph,
        filter=filter_,
        filter_points=points,
        max_nodes_per_pack=kwargs.pop("max_nodes_per_pack", 64),
        **kwargs,
    )


# --- the table and its interpolation ------------------------------------------------------


def test_table_is_the_filter_and_its_exact_derivative():
    """Every block's table (all built in one batched pass) is that block's own filter."""
    model = paper_model("radius", "exact").double()
    blocks = [interaction.conv for interaction in model.interactions]
    tables = filter_tables([block.nn for block in blocks], model.distance_expansion, CUTOFF, 97)
    assert tables[0].shape == tables[1].shape == (len(blocks), 97, 100)
    grid = (torch.arange(97, dtype=torch.float64) * (CUTOFF / 96)).requires_grad_(True)
    mask = torch.ones(97, dtype=torch.bool)
    rbf, cut = model.edge_features(grid, mask)
    for block, values, slopes in zip(blocks, *tables):
        exact = block.filter(rbf, cut)  # [K, F]
        torch.testing.assert_close(values, exact, rtol=1e-12, atol=1e-12)
        # dW_f/dd at every grid point by reverse mode, one feature at a time
        columns = [exact[:, f].sum() for f in range(100)]
        derivative = torch.stack(
            [torch.autograd.grad(c, grid, retain_graph=True)[0] for c in columns], dim=1
        )
        torch.testing.assert_close(slopes, derivative, rtol=1e-10, atol=1e-12)


def test_grid_position_follows_the_contract():
    """s = d / h, k = clamp(floor(s), 0, K - 2), t = s - k: the last point is t = 1 of the
    last interval, grid points start their interval."""
    dist = torch.tensor([0.0, 0.5, 2.0, 5.99, 6.0], dtype=torch.float64)
    index, t = grid_position(dist, 4, CUTOFF)  # h = 2
    assert index.tolist() == [0, 0, 1, 2, 2]
    torch.testing.assert_close(t, torch.tensor([0.0, 0.25, 0.0, 0.995, 1.0], dtype=torch.float64))


def test_hermite_reproduces_cubics_exactly():
    """A cubic Hermite interpolant is exact for cubic polynomials (values and slopes given)."""
    grid = torch.arange(5, dtype=torch.float64) * 1.5  # K = 5 on [0, 6]

    def cubic(d):
        return torch.stack([d**3 - 2 * d, 0.5 * d**2 + 1.0, -(d**3) / 7], dim=-1)

    def slope(d):
        return torch.stack([3 * d**2 - 2, d, -3 * d**2 / 7], dim=-1)

    dist = torch.linspace(0, CUTOFF, 101, dtype=torch.float64)
    mask = torch.ones(101, dtype=torch.bool)
    filt = hermite_filter(dist, mask, cubic(grid), slope(grid), CUTOFF)
    torch.testing.assert_close(filt, cubic(dist), rtol=1e-12, atol=1e-12)


# --- the flavours' table_conv -------------------------------------------------------------


def random_conv_inputs(pair_symmetric: bool, seed: int = 0):
    """x [N, F], edge_index [2, E], dist/edge_mask [E'] (masked ones at a random length, not
    the cutoff, so only the mask can silence them), values/slopes [K, F], float64."""
    gen = torch.Generator().manual_seed(seed)
    nodes, features, pairs, points = 40, 7, 150, 33
    src = torch.randint(0, nodes, (pairs,), generator=gen)
    dst = torch.randint(0, nodes, (pairs,), generator=gen)
    if pair_symmetric:
        edge_index = torch.cat([torch.stack([src, dst]), torch.stack([dst, src])], dim=1)
    else:
        edge_index = torch.stack([src, dst])
    dist = torch.rand(pairs, generator=gen, dtype=torch.float64) * CUTOFF
    dist[:3] = torch.tensor([0.0, CUTOFF, CUTOFF * 16 / 32])  # grid points, both ends
    mask = torch.rand(pairs, generator=gen) < 0.8
    x = torch.randn(nodes, features, generator=gen, dtype=torch.float64)
    values = torch.randn(points, features, generator=gen, dtype=torch.float64)
    slopes = torch.randn(points, features, generator=gen, dtype=torch.float64)
    return x, edge_index, dist, mask, values, slopes


def plain_table_conv(x, edge_index, dist, mask, values, slopes, cutoff):
    """The definition: masked edges dropped, W of the others from the Hermite formula,
    messages summed."""
    copies = edge_index.shape[1] // dist.shape[0]
    dist, keep = dist.repeat(copies), mask.repeat(copies)
    edge_index, dist = edge_index[:, keep], dist[keep]
    filt = hermite_filter(dist, torch.ones_like(dist, dtype=torch.bool), values, slopes, cutoff)
    out = torch.zeros_like(x)
    return out.index_add(0, edge_index[1], x[edge_index[0]] * filt)


def table_conv_of(flavour: str):
    """torch with numba's fused loops, torch in torch ops alone, or the ipu flavour's."""
    if flavour == "ipu":
        return ipu_ops.table_conv

    def conv(*args):
        fused = fused_table.AVAILABLE
        fused_table.AVAILABLE = fused and flavour == "torch fused"
        try:
            return torch_ops.table_conv(*args)
        finally:
            fused_table.AVAILABLE = fused

    return conv


FLAVOURS = ["torch fused", "torch ops", "ipu"]


@pytest.mark.parametrize("pair_symmetric", [True, False])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_table_conv_matches_definition_with_first_and_second_derivatives(flavour, pair_symmetric):
    if flavour == "torch fused" and not fused_table.AVAILABLE:
        pytest.skip("numba is not installed: no fused loop")
    x, edge_index, dist, mask, values, slopes = random_conv_inputs(pair_symmetric)
    grad_out = torch.randn_like(x)
    results = []
    for conv in (table_conv_of(flavour), plain_table_conv):
        inputs = [t.clone().requires_grad_(True) for t in (x, dist, values, slopes)]
        xi, di, vi, si = inputs
        out = conv(xi, edge_index, di, mask, vi, si, CUTOFF)
        first = torch.autograd.grad((out * grad_out).sum(), inputs, create_graph=True)
        # a force-like second derivative: d/d(everything) of |d energy / d dist|^2
        second = torch.autograd.grad(first[1].square().sum(), inputs, allow_unused=True)
        results.append((out, first, second))
    (out, first, second), (ref, ref_first, ref_second) = results
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(first, ref_first):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(second, ref_second):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-8)


def test_fused_backward_matches_torch_ops_without_create_graph():
    """The compiled backward loop (no create_graph: energy training, the calculator)."""
    if not fused_table.AVAILABLE:
        pytest.skip("numba is not installed: no fused loop")
    x, edge_index, dist, mask, values, slopes = random_conv_inputs(True, seed=1)
    grad_out = torch.randn_like(x)
    grads = {}
    for flavour in ("torch fused", "torch ops"):
        inputs = [t.clone().requires_grad_(True) for t in (x, dist, values, slopes)]
        out = table_conv_of(flavour)(inputs[0], edge_index, inputs[1], mask, *inputs[2:], CUTOFF)
        grads[flavour] = torch.autograd.grad((out * grad_out).sum(), inputs)
    for a, b in zip(grads["torch fused"], grads["torch ops"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        assert b.abs().max() > 0


# --- whole models on real data ------------------------------------------------------------


@pytest.fixture(scope="module")
def qm9_batches(qm9_store):
    """Real QM9 molecules packed twice: knn (LPFHP) and radius with edges."""
    molecules = load_molecules(str(qm9_store), 48, seed=1)
    sizes = [len(z) for z, _ in molecules]
    knn_packs = plan_packs(sizes, 64, 8)
    pairs = [len(pair_array(pos, CUTOFF)) for _, pos in molecules]
    edges = 2 * max(sum(pairs[m] for m in pack) for pack in knn_packs) + 8
    return {
        "knn": molecules_to_batch(molecules, knn_packs, 64, 8),
        "radius": molecules_to_batch(molecules, knn_packs, 64, 8, edges, CUTOFF),
    }


def relative_error(pred: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((pred - reference).abs().max() / reference.abs().max()).detach())


@pytest.mark.parametrize(("graph", "pair_symmetric"), [("radius", True), ("knn", True)])
def test_energies_match_exact_on_qm9_and_converge_in_k(qm9_batches, graph, pair_symmetric):
    batch = qm9_batches[graph]
    exact = paper_model(graph, "exact", pair_symmetric=pair_symmetric)
    table = paper_model(graph, "table", pair_symmetric=pair_symmetric)
    table.load_state_dict(exact.state_dict())
    with torch.no_grad():
        reference = exact(batch)
        assert relative_error(table(batch), reference) < 1e-5  # float32, K = 256
        # float64: the error falls as h^4 (16x per doubling of K); a table coarsened or an
        # index off by one breaks this at once
        exact64, table64 = exact.double(), table.double()
        batch.pos = batch.pos.double()
        reference = exact64(batch)
        errors = []
        for points in (64, 128, 256):
            table64.filter_points = points
            errors.append(relative_error(table64(batch), reference))
        batch.pos = batch.pos.float()
    assert errors[0] / errors[1] > 8 and errors[1] / errors[2] > 8, errors
    assert errors[2] < 2e-7, errors


def test_state_dict_and_parameter_gradients_through_the_table(qm9_batches):
    """Same names; a state dict moves both ways; gradients reach the filter network through
    the table (values and slopes) and equal the exact model's as K grows (float64)."""
    batch = qm9_batches["radius"]
    exact = paper_model("radius", "exact").double()
    table = paper_model("radius", "table", points=512).double()
    assert list(table.state_dict()) == list(exact.state_dict())
    table.load_state_dict(exact.state_dict())
    exact.load_state_dict(table.state_dict())
    batch.pos = batch.pos.double()
    for model in (exact, table):
        model(batch).sum().backward()
    batch.pos = batch.pos.float()
    table_grads = dict(table.named_parameters())
    for name, param in exact.named_parameters():
        grad = table_grads[name].grad
        assert grad is not None, name
        torch.testing.assert_close(grad, param.grad, rtol=1e-5, atol=1e-7 * param.grad.abs().max())


@pytest.fixture(scope="module")
def water_batch(tmp_path_factory):
    """TIP3P water clusters of 3-6 molecules (real generator), packed for knn graphs."""
    path = generate_water_sampled(
        tmp_path_factory.mktemp("water") / "w.h5", 24, (3, 6), templates=2, progress=False
    )
    store = MoleculeStore(path)
    molecules = [store.molecule(i) for i in range(len(store))]
    packs = plan_packs([len(z) for z, _ in molecules], 64, 8)
    return molecules_to_batch(molecules, packs, 64, 8)


@pytest.mark.parametrize("data", ["water", "emt"])
def test_energies_and_forces_match_exact(water_batch, data):
    """float32: energies within 1e-5 and forces within 1e-4 (relative) of the exact filter."""
    if data == "water":
        batch, graph, nodes = water_batch, "knn", 64
    else:
        batch, _ = emt_batch(emt_frames(6, seed=4))
        batch.pos, batch.forces, graph, nodes = batch.pos.float(), None, "radius", 24
    results = {}
    for filter_ in ("exact", "table"):
        model = paper_model(graph, filter_, k=16, max_nodes_per_pack=nodes)
        results[filter_] = energy_response(model, batch, create_graph=False)[:2]
    (energy, forces), (energy_ref, forces_ref) = results["table"], results["exact"]
    assert forces_ref.abs().max() > 0
    assert relative_error(energy, energy_ref) < 1e-5
    assert relative_error(forces, forces_ref) < 1e-4


@pytest.mark.parametrize("graph", ["radius", "knn"])
def test_table_forces_twice_differentiable(graph):
    """gradcheck of pos -> forces through a table model: double backward for force training."""
    torch.manual_seed(1)
    model = SchNet(
        hidden_channels=6, num_filters=5, num_interactions=2, num_gaussians=7, cutoff=4.0,
        graph=graph, k=5, max_nodes_per_pack=24, filter="table", filter_points=16,
    ).double()  # fmt: skip
    assert forces_pass_gradcheck(model, radius=graph == "radius")


def test_dense_and_ipu_flavour_equal_sparse_torch(qm9_batches):
    batch = qm9_batches["knn"]
    reference = paper_model("knn", "table")
    with torch.no_grad():
        expected = reference(batch)
        for kwargs in ({"message_passing": "dense"}, {"ops": "ipu"}):
            model = paper_model("knn", "table", **kwargs)
            model.load_state_dict(reference.state_dict())
            torch.testing.assert_close(model(batch), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("graph", ["radius", "knn"])
def test_ipu_flavour_uses_only_poptorch_ops(qm9_batches, graph):
    """The emulator's op check on the forward pass with loss of a table model."""
    model = paper_model(graph, "table", ops="ipu")
    batch = qm9_batches[graph]
    loss = check_poptorch_ops(lambda: model(batch).square().mean())
    assert torch.isfinite(loss)


def test_bf16_autocast_runs_close_to_fp32(qm9_batches):
    batch = qm9_batches["radius"]
    model = paper_model("radius", "table")
    with torch.no_grad():
        fp32 = model(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(batch)
    assert bf16.dtype == torch.float32
    assert relative_error(bf16, fp32) < 0.05


def test_config_keys():
    cfg = load_config(None, ["model.filter=table", "model.filter_points=64"])
    assert (cfg.model.filter, cfg.model.filter_points) == ("table", 64)
    with pytest.raises(ConfigError, match=r"model\.filter = 'tabel'"):
        load_config(None, ["model.filter=tabel"])
    with pytest.raises(ConfigError, match=r"model\.filter_points must be >= 2"):
        load_config(None, ["model.filter_points=1"])
