"""The ``triton`` op flavour: fused kernels against the torch flavour and a plain-torch table.

The kernel tests (marker ``triton``, opt-in: ``pytest -m triton tests/model/test_triton_ops.py``)
run on CUDA tensors where a GPU is present, else on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, which tests/conftest.py sets without a GPU). The interpreter is
slow: the batches are a few packs of real QM9 molecules or water clusters, with padding, one
small QM9 molecule (finite differences) and a periodic EMT cell (stress). They compare outputs,
every gradient and, for the table, every second derivative (force training's double
backward) in float32 and float64. Over 400 lines because every pass of both fused primitives
is checked against the same fixtures and references here, kept in one place.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from schnet_ipu.backends import TorchBackend
from schnet_ipu.batch import Batch
from schnet_ipu.config import ConfigError
from schnet_ipu.data import MoleculeStore, generate_water
from schnet_ipu.model import SchNet
from schnet_ipu.model.ops import get_ops, torch_ops, triton_ops
from schnet_ipu.model.ops.common import edge_distance
from schnet_ipu.response import energy_response
from schnet_ipu.task import masked_mse
from tests.helpers import molecules_to_batch, pair_array, plan_packs
from tests.model.test_fused_table import CUTOFF as CELL_CUTOFF
from tests.model.test_fused_table import emt_cell, force_training_pass

CUTOFF = 6.0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KNOTS = 37  # table knots: h = 1/6 A
# gradcheck's repeat of a backward: a GPU's float64 atomic adds land in any order, so two
# runs differ in the last bits (seen on an H200: "Backward is not reentrant" at 0)
NONDET_TOL = 1e-10 if DEVICE == "cuda" else 0.0
needs_triton = pytest.mark.skipif(
    not triton_ops.AVAILABLE or (DEVICE == "cpu" and not triton_ops.interpreted()),
    reason="triton is not installed, or no GPU and TRITON_INTERPRET is not 1 (conftest.py)",
)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.fixture(scope="module")
def water_store(tmp_path_factory) -> Path:
    """Eight relaxed TIP3P water clusters of 2-5 molecules."""
    return generate_water(tmp_path_factory.mktemp("water") / "water.h5", 8, sizes=(2, 5))


@pytest.fixture(scope="module", params=["qm9", "water"])
def packed_batch(request, qm9_store, water_store) -> Batch:
    """Real molecules (14 QM9 rows, or the 8 water clusters) in packs of 48 atom slots / 5
    molecule slots, with padding atoms, padding pair slots and one empty pack, on ``DEVICE``."""
    if request.param == "qm9":
        store = MoleculeStore(qm9_store)
        molecules = [store.molecule(i) for i in range(100, 1400, 93)]
    else:
        store = MoleculeStore(water_store)
        molecules = [store.molecule(i) for i in range(len(store))]
    packs = plan_packs([len(z) for z, _ in molecules], 48, 5)
    pairs = [len(pair_array(pos, CUTOFF)) for _, pos in molecules]
    max_edges = 2 * max(sum(pairs[m] for m in pack) for pack in packs) + 24
    return molecules_to_batch(molecules, [*packs, []], 48, 5, max_edges, CUTOFF).to(DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Relative agreement, measured against the largest entry (sums of many terms cancel to
    entries near zero, whose own relative error says nothing)."""
    rtol = RTOL[want.dtype]
    atol = rtol * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=name)


def pair_inputs(batch: Batch, dtype: torch.dtype, features: int = 24):
    """x [N, F], the forward pairs' distances and mask [P], a smooth per-pair filter [P, F]
    (zero on masked pairs, like the model's), all leaves; and the upstream gradient [N, F]."""
    gen = torch.Generator().manual_seed(5)
    pairs = batch.edge_index.shape[1] // 2
    mask = batch.edge_mask[:pairs]
    dist = edge_distance(batch.pos.to(dtype), batch.edge_index[:, :pairs], mask, CUTOFF)
    width = torch.rand(features, generator=gen, dtype=dtype).to(DEVICE) + 0.5
    filt = torch.exp(-dist.unsqueeze(1) * width) * torch.where(mask, 1.0, 0.0).unsqueeze(1)
    x = torch.randn(batch.num_nodes, features, generator=gen, dtype=dtype).to(DEVICE)
    grad = torch.randn(batch.num_nodes, features, generator=gen, dtype=dtype).to(DEVICE)
    return x.requires_grad_(), dist.detach(), mask, filt.detach().requires_grad_(), grad


def table_inputs(batch: Batch, dtype: torch.dtype, storage: str = "pairs", seed: int = 9):
    """:func:`pair_inputs`' x, dist, mask and grad, with dist and mask [E / 2] for
    pair-symmetric storage or [E] for one row per edge, and a random table (values and
    slopes [K, F]): (x, edge_index, dist, mask, values, slopes, grad), none requiring grad."""
    x, dist, mask, _, grad = pair_inputs(batch, dtype)
    if storage == "edges":
        dist, mask = torch.cat([dist, dist.flip(0)]), torch.cat([mask, mask.flip(0)])
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(KNOTS, x.shape[1], generator=gen, dtype=dtype).to(DEVICE)
    slopes = torch.randn(KNOTS, x.shape[1], generator=gen, dtype=dtype).to(DEVICE)
    return x.detach(), batch.edge_index, dist, mask, values, slopes, grad


def hermite_table_conv(x, edge_index, dist, edge_mask, values, slopes, cutoff):
    """The contract's interpolation in plain torch (autograd gives every gradient)."""
    knots = values.shape[0]
    h = cutoff / (knots - 1)
    s = dist / h
    k = torch.clamp(torch.floor(s), 0, knots - 2)
    t = (s - k).unsqueeze(1)
    k = k.long()
    filt = (
        (2 * t**3 - 3 * t**2 + 1) * values[k]
        + (t**3 - 2 * t**2 + t) * h * slopes[k]
        + (-2 * t**3 + 3 * t**2) * values[k + 1]
        + (t**3 - t**2) * h * slopes[k + 1]
    ) * edge_mask.unsqueeze(1)
    if filt.shape[0] < edge_index.shape[1]:
        filt = torch.cat([filt, filt])
    messages = x[edge_index[0]] * filt
    return torch.zeros_like(x).index_add(0, edge_index[1], messages)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pair_symmetric_conv_equals_torch_flavour(packed_batch, dtype):
    x, _, _, filt, grad = pair_inputs(packed_batch, dtype)
    edge_index = packed_batch.edge_index
    got = triton_ops.pair_symmetric_conv(x, edge_index, filt)
    want = torch_ops.pair_symmetric_conv(x, edge_index, filt)
    assert want.abs().max() > 0.1  # real messages reach real atoms
    assert_close(got, want, "out")
    got_grads = torch.autograd.grad(got, (x, filt), grad)
    want_grads = torch.autograd.grad(want, (x, filt), grad)
    for name, a, b in zip(("x", "filt"), got_grads, want_grads):
        assert_close(a, b, name)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pair_symmetric_conv_second_derivatives_equal_torch_flavour(packed_batch, dtype):
    """Under create_graph the fused backward is differentiable again (fused ops): the
    gradients in x, filter and the incoming gradient of L = <U_x, grad x> + <U_f, grad filt>
    equal the torch flavour's."""
    x, _, _, filt, grad = pair_inputs(packed_batch, dtype)
    gen = torch.Generator().manual_seed(7)
    upstream = [torch.randn(t.shape, generator=gen, dtype=dtype).to(DEVICE) for t in (x, filt)]
    results = []
    for flavour in (triton_ops, torch_ops):
        leaves = [t.detach().clone().requires_grad_() for t in (x, filt, grad)]
        xi, fi, gi = leaves
        out = flavour.pair_symmetric_conv(xi, packed_batch.edge_index, fi)
        first = torch.autograd.grad(out, (xi, fi), gi, create_graph=True)
        loss = sum((f * u).sum() for f, u in zip(first, upstream))
        results.append(torch.autograd.grad(loss, leaves))
    for name, got, want in zip(("x", "filt", "grad"), *results):
        assert want.abs().max() > 0, name
        assert_close(got, want, name)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("storage", ["pairs", "edges"])
def test_table_conv_equals_hermite_reference(packed_batch, dtype, storage):
    """Pair-symmetric storage (dist [E/2]) and one row per edge (dist [E]), with masked
    edges; gradients in x, dist, values and slopes."""
    x, edge_index, dist, mask, values, slopes, grad = table_inputs(packed_batch, dtype, storage)
    assert not mask.all() and mask.any()
    leaves = tuple(t.requires_grad_() for t in (x, dist, values, slopes))
    args = (x, edge_index, dist, mask, values, slopes, CUTOFF)
    got = triton_ops.table_conv(*args)
    want = hermite_table_conv(*args)
    assert_close(got, want, "out")
    got_grads = torch.autograd.grad(got, leaves, grad)
    want_grads = torch.autograd.grad(want, leaves, grad)
    for name, a, b in zip(("x", "dist", "values", "slopes"), got_grads, want_grads):
        assert_close(a, b, name)
    assert (got_grads[1][~mask] == 0).all()  # masked edges: no force


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("fused", [True, False])
def test_table_conv_equals_torch_flavour(packed_batch, fused, monkeypatch):
    """The triton kernel against the torch flavour's table_conv (issue 34's reference):
    its numba loop and its plain torch ops; outputs and the gradients of every input."""
    from schnet_ipu.model.ops import fused_table

    monkeypatch.setattr(fused_table, "AVAILABLE", fused and fused_table.AVAILABLE)
    x, edge_index, dist, mask, values, slopes, grad = table_inputs(
        packed_batch, torch.float64, seed=5
    )
    leaves = tuple(t.requires_grad_() for t in (x, dist, values, slopes))
    args = (x, edge_index, dist, mask, values, slopes, CUTOFF)
    got, want = triton_ops.table_conv(*args), torch_ops.table_conv(*args)
    assert_close(got, want, "out")
    got_grads = torch.autograd.grad(got, leaves, grad)
    want_grads = torch.autograd.grad(want, leaves, grad)
    for name, a, b in zip(("x", "dist", "values", "slopes"), got_grads, want_grads):
        assert_close(a, b, name)


def first_and_second_derivatives(conv, inputs: tuple, upstream: tuple) -> tuple:
    """``conv``'s first derivatives (x, dist, values, slopes) under ``create_graph`` with the
    incoming gradient ``grad`` a leaf too, and the gradients of L = sum of <upstream, first
    derivative> (None: left out of L) in (x, dist, values, slopes, grad): every quantity of
    force training's double backward."""
    x, edge_index, dist, mask, values, slopes, grad = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (x, dist, values, slopes, grad)]
    xi, di, vi, si, gi = leaves
    out = conv(xi, edge_index, di, mask, vi, si, CUTOFF)
    first = torch.autograd.grad(out, leaves[:4], gi, create_graph=True)
    loss = sum((f * u).sum() for f, u in zip(first, upstream) if u is not None)
    return first, torch.autograd.grad(loss, leaves)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize(
    ("dtype", "storage", "upstream"),
    [
        (torch.float32, "pairs", "all"),
        (torch.float64, "pairs", "all"),
        (torch.float64, "edges", "all"),
        (torch.float32, "edges", "forces"),
        (torch.float64, "pairs", "forces"),
    ],
)
def test_table_conv_second_derivatives_equal_unfused(packed_batch, dtype, storage, upstream):
    """The fused double backward against autograd through the torch flavour's unfused ops
    (the interpolated [E', F] filter): first derivatives and the gradients in x, dist,
    values, slopes and the incoming gradient of L = <U_x, grad x> + <u_d, grad dist>, plus
    <U_v, grad values> + <U_s, grad slopes> with ``upstream="all"`` (in force training the
    table is off the path to the positions, so its upstream is absent)."""
    inputs = table_inputs(packed_batch, dtype, storage, seed=6)
    x, _, dist, _, values, _, _ = inputs
    gen = torch.Generator().manual_seed(7)
    up = [torch.randn(t.shape, generator=gen, dtype=dtype).to(DEVICE) for t in (x, dist, values)]
    up_slopes = torch.randn(values.shape, generator=gen, dtype=dtype).to(DEVICE)
    upstream_terms = (*up, up_slopes) if upstream == "all" else (*up[:2], None, None)
    got = first_and_second_derivatives(triton_ops.table_conv, inputs, upstream_terms)
    want = first_and_second_derivatives(torch_ops.table_conv_unfused, inputs, upstream_terms)
    for name, a, b in zip(("x", "dist", "values", "slopes"), got[0], want[0]):
        assert_close(a, b, f"first {name}")
    for name, a, b in zip(("x", "dist", "values", "slopes", "grad"), got[1], want[1]):
        assert b.abs().max() > 0, name
        assert_close(a, b, f"second {name}")


@needs_triton
@pytest.mark.triton
def test_table_conv_double_backward_equals_torch_flavour(packed_batch):
    """Both fused double backwards agree: the triton kernel's and the torch flavour's (numba's
    loop, in the cubic's power basis), float64, every upstream present."""
    inputs = table_inputs(packed_batch, torch.float64, seed=8)
    x, _, dist, _, values, slopes, _ = inputs
    upstream = tuple(torch.randn_like(t) for t in (x, dist, values, slopes))
    got = first_and_second_derivatives(triton_ops.table_conv, inputs, upstream)
    want = first_and_second_derivatives(torch_ops.table_conv, inputs, upstream)
    for name, a, b in zip(("x", "dist", "values", "slopes", "grad"), got[1], want[1]):
        assert b.abs().max() > 0, name
        assert_close(a, b, f"second {name}")


def molecule_inputs(store: Path, storage: str = "pairs") -> tuple:
    """One real QM9 molecule (6 atoms, 15 pairs; two masked), float64 on ``DEVICE``: x [6, 2],
    edge_index [2, 30], dist and mask [15] (pair-symmetric) or [30] (``storage="edges"``), a
    random table [6, 2] (values, slopes) and a smooth per-pair filter [15, 2], zero where
    masked."""
    z, pos = MoleculeStore(store).molecule(7)
    pos = torch.as_tensor(pos, dtype=torch.float64)
    pairs = torch.as_tensor(pair_array(pos.numpy(), CUTOFF)).T
    edge_index = torch.cat([pairs, pairs.flip(0)], dim=1)
    dist = (pos[pairs[0]] - pos[pairs[1]]).norm(dim=1)
    mask = torch.ones_like(dist, dtype=torch.bool)
    mask[[1, 4]] = False
    filt = torch.exp(-dist.unsqueeze(1) * torch.tensor([0.7, 1.3], dtype=torch.float64))
    filt = filt * mask.unsqueeze(1)
    if storage == "edges":
        dist, mask = torch.cat([dist, dist]), torch.cat([mask, mask.roll(1)])
    gen = torch.Generator().manual_seed(3)
    values, slopes = torch.randn(2, 6, 2, generator=gen, dtype=torch.float64)
    x = torch.randn(len(z), 2, generator=gen, dtype=torch.float64)
    tensors = (x, edge_index, dist, mask, values, slopes, filt)
    return tuple(t.to(DEVICE) for t in tensors)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("conv", ["table pairs", "table edges", "exact"])
def test_gradgradcheck_on_a_molecule(qm9_store, conv):
    """Finite differences (float64) of the fused convolutions' first and second derivatives
    on one real QM9 molecule: table_conv in x, dist, values and slopes (pair-symmetric and
    per-edge storage), pair_symmetric_conv in x and filter."""
    storage = "edges" if conv == "table edges" else "pairs"
    x, edge_index, dist, mask, values, slopes, filt = molecule_inputs(qm9_store, storage)
    if conv == "exact":
        leaves = (x.requires_grad_(), filt.requires_grad_())

        def run(x, filt):
            return triton_ops.pair_symmetric_conv(x, edge_index, filt)

    else:
        leaves = tuple(t.requires_grad_() for t in (x, dist, values, slopes))

        def run(x, dist, values, slopes):
            return triton_ops.table_conv(x, edge_index, dist, mask, values, slopes, CUTOFF)

    assert torch.autograd.gradcheck(run, leaves, fast_mode=True, nondet_tol=NONDET_TOL)
    assert torch.autograd.gradgradcheck(run, leaves, fast_mode=True, nondet_tol=NONDET_TOL)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("wanted", ["dist", "x dist", "values dist", "x slopes"])
def test_table_conv_gradients_of_some_inputs_only(qm9_store, wanted):
    """The passes skip the gradients nobody asks for (inference: a frozen table gives
    forces from dist alone): what they still give, once and twice, is right."""
    x, edge_index, dist, mask, values, slopes, _ = molecule_inputs(qm9_store)
    inputs = {"x": x, "dist": dist, "values": values, "slopes": slopes}
    names = wanted.split()
    leaves = tuple(inputs[name].requires_grad_() for name in names)

    def run(*leaves):
        given = dict(inputs, **dict(zip(names, leaves)))
        return triton_ops.table_conv(
            given["x"], edge_index, given["dist"], mask, given["values"], given["slopes"], CUTOFF
        )

    assert torch.autograd.gradcheck(run, leaves, fast_mode=True, nondet_tol=NONDET_TOL)
    assert torch.autograd.gradgradcheck(run, leaves, fast_mode=True, nondet_tol=NONDET_TOL)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("filter_", ["exact", "table"])
def test_model_equals_torch_flavour_with_forces(packed_batch, filter_):
    """SchNet with ops=triton and ops=torch, same weights, float64: predictions, forces
    (dE/dpos through the kernels' backward) and every parameter's gradient of a loss on both
    (a double backward, the force-training path)."""
    results = []
    for ops in ("torch", "triton"):
        torch.manual_seed(4)
        model = SchNet(hidden_channels=16, num_filters=16, num_interactions=2, graph="radius",
                       ops=ops, mean=0.3, std=1.5, filter=filter_,
                       filter_points=KNOTS).to(DEVICE, torch.float64)  # fmt: skip
        batch = packed_batch.to(DEVICE)
        batch.pos = batch.pos.to(torch.float64)
        energies, forces, _ = energy_response(model, batch, create_graph=True)
        loss = energies.square().sum() + forces.square().sum()
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        results.append((energies.detach(), forces.detach(), grads))
    (e_torch, f_torch, g_torch), (e_triton, f_triton, g_triton) = results
    assert f_torch.abs().max() > 0
    assert_close(e_triton, e_torch, "energies")
    assert_close(f_triton, f_torch, "forces")
    for name, grad in g_torch.items():
        assert_close(g_triton[name], grad, name)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_table_model_force_training_equals_torch_flavour_with_stress(dtype):
    """Force training of SchNet (filter=table) on a periodic EMT cell (8 atoms, a padding
    atom and a masked pair slot): energies, forces, stress and every parameter's gradient of
    a loss on all three by ops=triton (the fused double backward) equal ops=torch's (numba's
    loops), 1e-10 (float64) or 1e-5 (float32) of the largest entry."""
    batch = emt_cell().to(DEVICE)
    batch = dataclasses.replace(batch, pos=batch.pos.to(dtype), cell=batch.cell.to(dtype))
    results = []
    for ops in ("torch", "triton"):
        torch.manual_seed(2)
        model = SchNet(hidden_channels=16, num_filters=12, num_interactions=3, num_gaussians=10,
                       cutoff=CELL_CUTOFF, graph="radius", filter="table", filter_points=48,
                       mean=-1.0, std=0.7, ops=ops).to(DEVICE, dtype)  # fmt: skip
        results.append(force_training_pass(model, batch, periodic=True))
    want, got = results
    assert want["forces"].abs().max() > 0 and want["stress"].abs().max() > 0
    assert len(want) == 3 + len(list(model.parameters()))
    for name, value in want.items():
        assert_close(got[name], value, name)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("filter_", ["exact", "table"])
def test_compiled_model_keeps_the_kernels_in_one_graph(packed_batch, filter_):
    """torch.compile(fullgraph=True) through dynamo and AOTAutograd ("aot_eager": their fake
    tensors meet the kernels' custom ops, forward and backward) of SchNet with ops=triton,
    exact and table filter (whose backward is an autograd.Function of its own): no graph
    break, and the eager model's predictions and gradients."""
    torch.manual_seed(4)
    model = SchNet(hidden_channels=16, num_filters=16, num_interactions=2, graph="radius",
                   ops="triton", filter=filter_, filter_points=KNOTS).to(DEVICE)  # fmt: skip
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
    results = []
    for run in (compiled, model):
        model.zero_grad()
        pred = run(packed_batch)
        pred.square().sum().backward()
        results.append((pred.detach(), [p.grad.clone() for p in model.parameters()]))
    (pred, grads), (want_pred, want_grads) = results
    assert_close(pred, want_pred, "predictions")
    for (name, _), got, want in zip(model.named_parameters(), grads, want_grads):
        assert_close(got, want, name)


def schnet_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return masked_mse(model(batch), batch.y + 1.0, batch.graph_mask, 1.0)


@needs_triton
@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("filter_", ["exact", "table"])
def test_captured_fused_step_trains_like_eager_torch_ops(packed_batch, compile, filter_):
    """ops=triton inside the captured CUDA graph (with backend.compile: inductor around the
    kernels) follows the eager torch-flavour step, captures once and never recompiles."""
    runs = []
    for ops, graphs, compiled in (("torch", False, False), ("triton", True, compile)):
        torch.manual_seed(4)
        model = SchNet(hidden_channels=16, num_filters=16, num_interactions=2, graph="radius",
                       ops=ops, filter=filter_, filter_points=KNOTS)  # fmt: skip
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        backend = TorchBackend(model, optimizer, schnet_loss, device="cuda",
                               cuda_graphs=graphs, compile=compiled)  # fmt: skip
        losses = [backend.train_call([packed_batch])[0]["loss"].item()]
        graphs_after_first = backend.compiled_graphs
        losses += [backend.train_call([packed_batch])[0]["loss"].item() for _ in range(4)]
        assert backend.compiled_graphs == graphs_after_first
        runs.append((backend, losses))
    (eager, eager_losses), (fused, fused_losses) = runs
    assert fused.graph_captures == 1
    assert fused_losses == pytest.approx(eager_losses, rel=1e-4)
    for got, want in zip(fused.model.parameters(), eager.model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_missing_triton_is_a_config_error(monkeypatch):
    monkeypatch.setattr(triton_ops, "AVAILABLE", False)
    with pytest.raises(ConfigError, match=r"model\.ops=torch"):
        get_ops("triton")


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.ones(3, 4)
    edge_index = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(ConfigError, match="CUDA tensors"):
        triton_ops.pair_symmetric_conv(x, edge_index, torch.ones(1, 4))


def test_table_conv_refuses_mismatched_rows():
    x = torch.ones(3, 4)
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    dist, mask = torch.ones(2), torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="need E or E/2"):
        triton_ops.table_conv(x, edge_index, dist, mask, torch.ones(5, 4), torch.ones(5, 4), 6.0)


def test_hermite_reference_reproduces_a_cubic():
    """The test's own reference is right: cubic Hermite interpolation is exact for a cubic
    given its values and derivatives at the knots."""
    grid = torch.linspace(0.0, CUTOFF, KNOTS, dtype=torch.float64)
    coefficients = torch.tensor([0.3, -1.2, 0.5, -0.04], dtype=torch.float64)
    values = sum(c * grid**n for n, c in enumerate(coefficients)).unsqueeze(1)
    slopes = sum(n * c * grid ** (n - 1) for n, c in enumerate(coefficients) if n).unsqueeze(1)
    dist = torch.tensor([0.0, 0.05, 1.234, 3.0, 5.99, CUTOFF], dtype=torch.float64)
    exact = sum(c * dist**n for n, c in enumerate(coefficients))
    edge_index = torch.stack([torch.zeros(6, dtype=torch.long), torch.arange(6)])
    x = torch.ones(6, 1, dtype=torch.float64)
    mask = torch.ones(6, dtype=torch.bool)
    out = hermite_table_conv(x, edge_index, dist, mask, values, slopes, CUTOFF)
    torch.testing.assert_close(out[:, 0], exact, rtol=1e-12, atol=1e-12)
