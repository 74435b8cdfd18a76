"""The tabulated filter's fused loops (``model/ops/fused_table.py``) through every pass force
training needs: gradcheck and gradgradcheck of both autograd paths (autograd.Function and
the torch.library custom operators), and on real structures (EMT clusters, QM9 rows, a
periodic EMT cell with its stress) forces, stress and every parameter gradient of a loss on
energies, forces and stress equal to the unfused torch ops (hermite_filter + gather/scatter):
1e-10 relative in float64, 1e-5 in float32."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.calculators.emt import EMT

from schnet_ipu.model import SchNet
from schnet_ipu.model.filter_table import grid_position, hermite_coefficients
from schnet_ipu.model.ops import fused_table
from schnet_ipu.response import energy_response
from tests.feed.test_periodic import batch_of
from tests.helpers import load_molecules, molecules_to_batch, pair_array, plan_packs
from tests.training.test_forces import emt_batch, emt_frames

pytestmark = pytest.mark.skipif(not fused_table.AVAILABLE, reason="numba is not installed")

PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not fused_table.CUSTOM_OPS, reason="torch.library.custom_op needs torch >= 2.4"))]  # fmt: skip


def small_conv_inputs(pair_symmetric: bool, seed: int = 0):
    """x [N, F], edge_index [2, E], coeffs [K - 1, 4, F], index/t/mask [P], float64: a few
    filters share an interval, some are masked, one sits on a grid point (t = 0)."""
    gen = torch.Generator().manual_seed(seed)
    nodes, features, pairs, points, cutoff = 9, 3, 14, 6, 5.0
    src = torch.randint(0, nodes, (pairs,), generator=gen)
    dst = torch.randint(0, nodes, (pairs,), generator=gen)
    edge_index = torch.stack([src, dst])
    if pair_symmetric:
        edge_index = torch.cat([edge_index, edge_index.flip(0)], dim=1)
    dist = torch.rand(pairs, generator=gen, dtype=torch.float64) * cutoff
    dist[0] = 2.0  # a grid point
    index, t = grid_position(dist, points, cutoff)
    values = torch.randn(points, features, generator=gen, dtype=torch.float64)
    slopes = torch.randn(points, features, generator=gen, dtype=torch.float64)
    coeffs = hermite_coefficients(values, slopes, cutoff)
    mask = torch.rand(pairs, generator=gen) < 0.8
    x = torch.randn(nodes, features, generator=gen, dtype=torch.float64)
    return x, edge_index, coeffs, index, t, mask


@pytest.mark.parametrize("pair_symmetric", [True, False])
@pytest.mark.parametrize("custom_op", PATHS)
def test_gradcheck_and_gradgradcheck(custom_op, pair_symmetric):
    """First derivatives (the backward loop) and second derivatives (the double-backward
    loop, including the coefficient gradient's own gradient) against finite differences."""
    x, edge_index, coeffs, index, t, mask = small_conv_inputs(pair_symmetric)
    leaves = tuple(a.detach().requires_grad_(True) for a in (x, coeffs, t))

    def conv(x, coeffs, t):
        return fused_table.fused_table_conv(x, edge_index, coeffs, index, t, mask, custom_op)

    assert torch.autograd.gradcheck(conv, leaves, fast_mode=True)
    assert torch.autograd.gradgradcheck(conv, leaves, fast_mode=True)


@pytest.mark.parametrize("wanted", ["t", "x t", "coeffs t", "x coeffs"])
@pytest.mark.parametrize("custom_op", PATHS)
def test_gradients_of_some_inputs_only(custom_op, wanted):
    """The passes skip the gradients nobody asked for (inference: frozen table and first
    block): what they still compute, once and twice differentiated, is right."""
    x, edge_index, coeffs, index, t, mask = small_conv_inputs(True, seed=3)
    names = wanted.split()
    inputs = {"x": x, "coeffs": coeffs, "t": t}
    leaves = tuple(inputs[name].detach().requires_grad_(True) for name in names)

    def conv(*leaves):
        given = dict(inputs, **dict(zip(names, leaves)))
        return fused_table.fused_table_conv(
            given["x"], edge_index, given["coeffs"], index, given["t"], mask, custom_op
        )

    assert torch.autograd.gradcheck(conv, leaves, fast_mode=True)
    assert torch.autograd.gradgradcheck(conv, leaves, fast_mode=True)


def test_loops_keep_torch_thread_count(restore_threads):
    """numba's pool start used to leave torch at all cores (backend.threads ignored)."""
    torch.set_num_threads(1)
    x, edge_index, coeffs, index, t, mask = small_conv_inputs(True, seed=1)
    fused_table.fused_table_conv(x, edge_index, coeffs, index, t, mask)
    assert torch.get_num_threads() == 1


# --- whole models on real structures -------------------------------------------------------

CUTOFF = 5.0


def table_model(dtype: torch.dtype) -> SchNet:
    torch.manual_seed(2)
    model = SchNet(
        hidden_channels=16, num_filters=12, num_interactions=3, num_gaussians=10,
        cutoff=CUTOFF, graph="radius", filter="table", filter_points=48, mean=-1.0, std=0.7,
    )  # fmt: skip
    return model.to(dtype)


def qm9_batch(store) -> object:
    """16 real QM9 molecules in radius packs with pair-symmetric edges."""
    molecules = load_molecules(str(store), 16, seed=3)
    packs = plan_packs([len(z) for z, _ in molecules], 48, 6)
    pairs = [len(pair_array(pos, CUTOFF)) for _, pos in molecules]
    edges = 2 * max(sum(pairs[m] for m in pack) for pack in packs) + 8
    return molecules_to_batch(molecules, packs, 48, 6, edges, CUTOFF)


def emt_cell():
    """A rattled 8-atom Cu/Au fcc cell (periodic, one pack), float64 batch."""
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((2, 1, 1))
    atoms.numbers[::3] = 79
    atoms.rattle(0.08, seed=5)
    atoms.calc = EMT()
    return batch_of(atoms)


def force_training_pass(model: SchNet, batch, periodic: bool) -> dict[str, torch.Tensor]:
    """Energies, forces (stress), and the gradient of a loss on all of them with respect to
    every parameter: the passes of a force-training step."""
    if periodic:
        energy, forces, stress = energy_response(model, batch, stress=True, create_graph=True)
    else:
        energy, forces, _ = energy_response(model, batch, create_graph=True)
        stress = forces.new_zeros(())
    target = torch.linspace(-1.0, 1.0, forces.numel(), dtype=forces.dtype, device=forces.device)
    target = target.view_as(forces)
    loss = energy.square().sum() + (forces - target).square().sum() + 10 * stress.square().sum()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    out = {"energy": energy, "forces": forces, "stress": stress}
    out.update({name: g for (name, _), g in zip(model.named_parameters(), grads)})
    return out


@pytest.fixture(scope="module")
def structures(qm9_store):
    return {
        "emt": emt_batch(emt_frames(4, seed=3))[0],
        "qm9": qm9_batch(qm9_store),
        "bulk": emt_cell(),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("data", ["emt", "qm9", "bulk"])
def test_force_training_equals_unfused_ops(structures, data, dtype, monkeypatch):
    batch = structures[data]
    batch = dataclasses.replace(batch, pos=batch.pos.to(dtype))
    if batch.cell is not None:
        batch = dataclasses.replace(batch, cell=batch.cell.to(dtype))
    model = table_model(dtype)
    fused = force_training_pass(model, batch, batch.cell is not None)
    monkeypatch.setattr(fused_table, "AVAILABLE", False)  # torch ops: the reference
    reference = force_training_pass(model, batch, batch.cell is not None)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    assert reference["forces"].abs().max() > 0
    if data == "bulk":
        assert reference["stress"].abs().max() > 0
    assert len(reference) == 3 + len(list(model.parameters()))
    for name, want in reference.items():
        got = fused[name]
        error = float(
            (got - want).detach().abs().max() / want.detach().abs().max().clamp(min=1e-30)
        )
        assert np.isfinite(error) and error <= tolerance, (name, error)


def test_force_pass_skips_the_coefficient_gradient(structures, monkeypatch):
    """The force pass (autograd.grad to positions) never reaches the table's parameters, so
    its backward loop leaves the coefficient gradient out; the loss pass computes it."""
    asked = []
    run_backward = fused_table._run_backward

    def spy(*args):
        asked.append(args[-1])  # need_coeffs
        return run_backward(*args)

    monkeypatch.setattr(fused_table, "_run_backward", spy)
    model = table_model(torch.float64)
    batch = structures["emt"]
    force_training_pass(model, dataclasses.replace(batch, pos=batch.pos.double()), False)
    blocks = len(model.interactions)
    # per block: the force pass's backward, then the loss pass through the energy
    assert sorted(asked) == [False] * blocks + [True] * blocks


@pytest.mark.skipif(not fused_table.CUSTOM_OPS, reason="torch.library.custom_op: torch >= 2.4")
def test_compiled_table_conv_keeps_the_fused_loops(monkeypatch):
    """torch.compile (fullgraph, AOTAutograd with fake tensors) of the torch flavour's
    table_conv: one graph around the custom ops, the loops run, eager's output and grads."""
    from schnet_ipu.model.ops import torch_ops

    x, edge_index, _, _, t, mask = small_conv_inputs(True, seed=2)
    values = torch.randn(6, 3, dtype=torch.float64)
    dist = torch.rand(t.shape[0], dtype=torch.float64) * 5.0
    leaves = [a.clone().requires_grad_(True) for a in (x, dist, values, values.flip(0))]
    calls = []
    run_forward = fused_table._run_forward
    monkeypatch.setattr(fused_table, "_run_forward", lambda *a: calls.append(1) or run_forward(*a))

    def loss(x, dist, values, slopes):
        out = torch_ops.table_conv(x, edge_index, dist, mask, values, slopes, 5.0)
        return out.square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    results = [torch.autograd.grad(run(*leaves), leaves) for run in (compiled, loss)]
    assert len(calls) >= 2  # the compiled call and the eager one both ran the loop
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_table_coefficients_backward_equals_autograd_of_the_plain_version():
    """The written-out backward of the Hermite stage against autograd through
    ``hermite_coefficients``, and itself differentiable (gradgradcheck, float64)."""
    values = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    slopes = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    up = torch.randn(6, 4, 3, dtype=torch.float64)
    fast = fused_table.table_coefficients(values, slopes, 2.0)
    plain = hermite_coefficients(values, slopes, 2.0)
    torch.testing.assert_close(fast, plain, rtol=0, atol=0)
    got = torch.autograd.grad(fast, (values, slopes), up)
    want = torch.autograd.grad(plain, (values, slopes), up)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradgradcheck(
        lambda v, s: fused_table.table_coefficients(v, s, 2.0), (values, slopes)
    )
