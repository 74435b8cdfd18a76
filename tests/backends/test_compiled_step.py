"""backend.compile=true: the training step compiles forward and loss as one function (and, by
AOTAutograd, their backward), never recompiles for the fixed batch signature, and trains as
the eager step does. On CUDA the same step runs inside the captured graph (test_cuda.py
and bench gpu); here it runs on CPU inductor."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from schnet_ipu.backends import TorchBackend
from schnet_ipu.batch import Batch
from schnet_ipu.model import SchNet
from schnet_ipu.task import masked_mse
from tests.backends.test_precision import BATCHES, schnet


class TracedLoss:
    """The masked MSE of a model's predictions; ``traced`` is 1 after a call that dynamo
    traced, 0 after an eager one (a tensor written in place: no guard on its value)."""

    def __init__(self) -> None:
        self.traced = torch.full((), -1.0)

    def __call__(self, model: nn.Module, batch: Batch) -> Tensor:
        self.traced.fill_(1.0 if torch.compiler.is_compiling() else 0.0)
        return masked_mse(model(batch), batch.y, batch.graph_mask, 1.0)


def train(
    compile_backend: str | None,
    calls: int = 3,
    model: nn.Module | None = None,
    precision: str = "fp32",
) -> tuple[TorchBackend, TracedLoss]:
    """``calls`` host calls of 2 accumulated micro-batches; compiled unless None."""
    model = model if model is not None else schnet()
    loss = TracedLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    backend = TorchBackend(
        model, optimizer, loss, gradient_accumulation=2, grad_clip=10.0, precision=precision,
        compile=compile_backend is not None, compile_backend=compile_backend or "inductor",
    )  # fmt: skip
    for call in range(calls):
        backend.train_call([BATCHES[call % 3], BATCHES[(call + 1) % 3]])
    return backend, loss


def test_compiled_step_traces_the_loss_and_never_recompiles() -> None:
    """dynamo (the "eager" compile backend: tracing and guards without code generation)
    sees the loss function, in one graph, compiled at the first micro-batch only."""
    backend, loss = train("eager", calls=1)
    assert loss.traced.item() == 1.0
    graphs = backend.compiled_graphs
    assert graphs == 1  # forward + loss: no graph break
    for batch in BATCHES:
        backend.train_call([batch, batch])
    assert backend.compiled_graphs == graphs and backend.recompilations == 0


def test_bf16_with_the_tabulated_filter_compiles_in_one_graph() -> None:
    """The model's fp32 regions inside bf16 autocast (filter tables, readout) are nested
    autocast contexts, which dynamo traces without a graph break."""
    torch.manual_seed(0)
    table = SchNet(
        16, 16, 2, 8, cutoff=5.0, graph="knn", k=4, max_nodes_per_pack=10, filter="table"
    )
    backend, loss = train("eager", model=table, precision="bf16")
    assert loss.traced.item() == 1.0
    assert backend.compiled_graphs == 1 and backend.recompilations == 0


@pytest.mark.slow
def test_inductor_step_trains_like_eager() -> None:
    """CPU inductor's generated forward + loss + backward give the eager weights."""
    compiled, loss = train("inductor")
    eager, eager_loss = train(None)
    assert loss.traced.item() == 1.0 and eager_loss.traced.item() == 0.0
    assert compiled.compiled_graphs == 1
    for (name, got), want in zip(
        compiled.model.state_dict().items(), eager.model.state_dict().values()
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
