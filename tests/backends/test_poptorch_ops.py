"""The emulator's PopTorch op check: the ipu flavour passes it, the torch flavour cannot."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from schnet_ipu.backends import make_backend
from schnet_ipu.backends.poptorch_ops import (
    UnsupportedOpError,
    check_poptorch_ops,
    load_op_lists,
    poptorch_node_kind,
    record_aten_ops,
    unsupported_ops,
)
from schnet_ipu.config import BackendConfig
from schnet_ipu.model import SchNet
from schnet_ipu.task import masked_mse
from tests.backends.test_backend import TinyModel, make_batch
from tests.model.test_model import tight_batch


def forward_and_loss(graph: str, ops: str):
    """A zero-argument forward + loss of SchNet (``ops`` flavour) on packed QM9 rows."""
    torch.manual_seed(0)
    model = SchNet(graph=graph, k=12, max_nodes_per_pack=64, ops=ops)
    batch = tight_batch(radius=graph == "radius")
    return lambda: masked_mse(model(batch), batch.y, batch.graph_mask, 2.0)


@pytest.mark.parametrize("graph", ["radius", "knn"])
def test_ipu_flavour_uses_only_ops_poptorch_lowers(graph):
    loss, ops = record_aten_ops(forward_and_loss(graph, "ipu"))
    assert {"aten::scatter_add", "aten::index_select", "aten::log1p"} <= ops
    assert unsupported_ops(ops) == set()
    assert torch.equal(check_poptorch_ops(forward_and_loss(graph, "ipu")), loss)


@pytest.mark.parametrize(("graph", "named"), [("radius", "index_add"), ("knn", "eye")])
def test_torch_flavour_is_refused_by_name(graph, named):
    with pytest.raises(UnsupportedOpError, match=named) as refused:
        check_poptorch_ops(forward_and_loss(graph, "torch"))
    assert "aten::logaddexp" in str(refused.value)
    # the pair-symmetric conv (radius) multiplies a view of its messages in place
    written = "in-place writes into a view, whose aliasing PopTorch does not keep: aten::mul_"
    assert (written in str(refused.value)) == (graph == "radius")


def test_inplace_write_into_a_view_is_refused():
    x = torch.ones(4, 3)
    check_poptorch_ops(lambda: x.clone().mul_(2.0).sum())  # a fresh tensor: fine
    with pytest.raises(UnsupportedOpError, match=r"view.*aten::mul_"):
        check_poptorch_ops(lambda: x.clone()[:2].mul_(2.0).sum())


def test_inplace_ops_are_checked_out_of_place():
    assert poptorch_node_kind("aten::scatter_add_") == "scatter_add"
    assert poptorch_node_kind("aten::zero_") == "zeros_like"
    assert poptorch_node_kind("aten::copy_") == "copy_"
    assert poptorch_node_kind("aten::__and__") == "__and__"
    assert unsupported_ops({"aten::index_add_", "aten::add_"}) == {"aten::index_add_"}


def test_composite_kernels_are_expanded_as_on_the_ipu():
    """torch.zeros runs its composite kernel on the IPU (PopTorch registers no zeros for the IPU
    key), so PopTorch sees the calls inside it, not aten::zeros."""
    assert "zeros" not in load_op_lists()["ipu_key"]
    out, ops = record_aten_ops(lambda: torch.zeros(3) + 1)
    assert "aten::zeros" not in ops and "aten::add" in ops
    assert torch.equal(out, torch.ones(3))


def test_ipu_model_backend_refuses_unmapped_op_on_first_step():
    """The TinyModel of test_backend sums with scatter_add (mapped); swapping in index_add makes
    backend.device=ipu-model refuse the first step, naming the op."""

    class IndexAddModel(TinyModel):
        def forward(self, batch):
            atom = self.out(torch.tanh(self.mix(torch.cat([self.embed(batch.z), batch.pos], 1))))
            slots = atom.new_zeros(batch.num_graphs + 1)
            return slots.index_add(0, batch.graph, atom.squeeze(1))[:-1]

    def loss(model, batch):
        return masked_mse(model(batch), batch.y, batch.graph_mask, 1.0)

    cfg = BackendConfig(device="ipu-model")
    good = TinyModel()
    backend = make_backend(cfg, good, torch.optim.SGD(good.parameters(), lr=0.01), loss)
    backend.train_call([make_batch(0)])
    backend.predict(make_batch(1))
    bad = IndexAddModel()
    backend = make_backend(cfg, bad, torch.optim.SGD(bad.parameters(), lr=0.01), loss)
    with pytest.raises(UnsupportedOpError, match="aten::index_add"):
        backend.train_call([make_batch(0)])
    with pytest.raises(UnsupportedOpError, match="aten::index_add"):
        backend.predict(make_batch(1))
    cpu = make_backend(
        BackendConfig(device="cpu"), bad, torch.optim.SGD(bad.parameters(), lr=0.01), loss
    )
    cpu.train_call([make_batch(0)])  # the check is the emulator's only


class WithConstant(nn.Module):
    """TinyModel plus a constant: a registered buffer (moved to the IPU with the model), a
    plain tensor attribute (left on the CPU) or a tensor made from numpy in forward (CPU)."""

    def __init__(self, constant: str) -> None:
        super().__init__()
        self.base = TinyModel()
        self.constant = constant
        if constant == "buffer":
            self.register_buffer("shift", torch.tensor([0.5]))
        else:
            self.shift = torch.tensor([0.5])

    def forward(self, batch):
        pred = self.base(batch) + torch.zeros(1)  # PopTorch gives this factory device="ipu"
        if self.constant == "numpy":
            return pred + torch.from_numpy(np.full(1, 0.5, dtype=np.float32))
        return pred + self.shift


@pytest.mark.parametrize("constant", ["buffer", "attribute", "numpy"])
def test_a_tensor_made_on_the_cpu_inside_the_model_is_refused(constant):
    """PopTorch moves inputs, parameters and buffers to the IPU; anything else made on the
    CPU and mixed with them raises "Expected an IPU tensor"."""
    model, batch = WithConstant(constant), make_batch(0)
    on_ipu = [*batch.as_tuple(), *model.parameters(), *model.buffers()]
    if constant == "buffer":
        check_poptorch_ops(lambda: model(batch), on_ipu)
        return
    with pytest.raises(UnsupportedOpError, match="Expected an IPU tensor: add got"):
        check_poptorch_ops(lambda: model(batch), on_ipu)
