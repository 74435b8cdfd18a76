"""TorchBackend in one process: accumulation, device iterations, shape guard, device choice.

The helpers at the top (a tiny model on Batch, a hand-built Batch, the masked MSE loss and a
plain reference step) are shared with tests/backends/test_replication.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import Tensor, nn

from schnet_ipu.backends import (
    DeviceError,
    RecompilationError,
    TorchBackend,
    make_backend,
    poptorch_available,
    select_device,
)
from schnet_ipu.backends.ipu_emulator import IpuEmulatorBackend
from schnet_ipu.batch import Batch, stack_batches
from schnet_ipu.config import BackendConfig


class TinyModel(nn.Module):
    """Per-atom MLP on (embedding of z, position), summed per molecule slot: Batch -> [G]."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, hidden)
        self.mix = nn.Linear(hidden + 3, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, batch: Batch) -> Tensor:
        h = torch.tanh(self.mix(torch.cat([self.embed(batch.z), batch.pos * 0.3], dim=1)))
        atom = self.out(h).squeeze(1) * batch.node_mask
        slots = torch.zeros(batch.num_graphs + 1, dtype=atom.dtype, device=atom.device)
        return slots.scatter_add(0, batch.graph, atom)[:-1]  # PopTorch lowers scatter_add


def masked_mse(model: nn.Module, batch: Batch) -> Tensor:
    """Mean over real molecules of the squared error: Tensor []."""
    err = (model(batch) - batch.y) ** 2 * batch.graph_mask
    return err.sum() / batch.graph_mask.sum()


def make_batch(
    seed: int, packs: int = 2, max_nodes: int = 10, max_graphs: int = 3, per_pack: int = 2
) -> Batch:
    """B = packs packs, each with ``per_pack`` molecules of 2-4 atoms, padded (knn layout)."""
    gen = torch.Generator().manual_seed(seed)
    num_nodes, num_graphs = packs * max_nodes, packs * max_graphs
    z = torch.zeros(num_nodes, dtype=torch.long)
    pos = 1000.0 + 100.0 * torch.arange(num_nodes, dtype=torch.float32)[:, None].repeat(1, 3)
    graph = torch.full((num_nodes,), num_graphs, dtype=torch.long)
    graph_mask = torch.zeros(num_graphs, dtype=torch.bool)
    molecule_index = torch.full((num_graphs,), -1, dtype=torch.long)
    for p in range(packs):
        row = p * max_nodes
        for m in range(per_pack):
            size = int(torch.randint(2, 5, (), generator=gen))
            slot = p * max_graphs + m
            z[row : row + size] = torch.randint(1, 10, (size,), generator=gen)
            pos[row : row + size] = torch.randn(size, 3, generator=gen)
            graph[row : row + size] = slot
            graph_mask[slot] = True
            molecule_index[slot] = seed * 100 + slot
            row += size
    return Batch(
        z=z,
        pos=pos,
        graph=graph,
        node_mask=z > 0,
        y=torch.randn(num_graphs, generator=gen),
        graph_mask=graph_mask,
        molecule_index=molecule_index,
    )


def reference_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Batch], clip: float = 0.0
) -> None:
    """One plain optimiser step on the mean of the batches' losses."""
    optimizer.zero_grad()
    loss = torch.stack([masked_mse(model, b) for b in batches]).mean()
    loss.backward()
    if clip:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def make_pair(seed: int = 0, lr: float = 0.05) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyModel()
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def assert_same_weights(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-5, msg=f"parameter {name} differs")


def test_accumulation_equals_one_large_batch() -> None:
    """A micro-batches with mean reduction == one stacked batch of A times the size."""
    accum = 4
    batches = [make_batch(seed) for seed in range(3 * accum)]
    model, opt = make_pair()
    backend = TorchBackend(model, opt, masked_mse, gradient_accumulation=accum)
    ref_model, ref_opt = make_pair()
    for step in range(3):
        group = batches[step * accum : (step + 1) * accum]
        records = backend.train_call(group)
        reference_step(ref_model, ref_opt, [stack_batches(group)])
        assert records[0]["molecules"] == sum(b.num_molecules for b in group)
    assert_same_weights(model, ref_model)
    assert not torch.equal(model.out.weight, make_pair()[0].out.weight), "training did nothing"


def test_device_iterations_equal_separate_calls() -> None:
    """One call with D x A micro-batches == D calls of A micro-batches each."""
    steps, accum = 3, 2
    batches = [make_batch(seed) for seed in range(steps * accum)]
    model, opt = make_pair()
    together = TorchBackend(
        model, opt, masked_mse, device_iterations=steps, gradient_accumulation=accum
    )
    records = together.train_call(batches)
    ref_model, ref_opt = make_pair()
    one_by_one = TorchBackend(ref_model, ref_opt, masked_mse, gradient_accumulation=accum)
    ref_records = [
        one_by_one.train_call(batches[s * accum : (s + 1) * accum])[0] for s in range(steps)
    ]
    assert len(records) == steps
    for got, want in zip(records, ref_records, strict=True):
        assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-6)
        assert got["molecules"] == want["molecules"] == accum * 4
        assert got["collectives"] == 0
    assert_same_weights(model, ref_model)


def test_train_call_rejects_wrong_number_of_micro_batches() -> None:
    model, opt = make_pair()
    backend = TorchBackend(model, opt, masked_mse, device_iterations=2, gradient_accumulation=3)
    with pytest.raises(ValueError, match="2 x 3 = 6 micro-batches, got 5"):
        backend.train_call([make_batch(s) for s in range(5)])


def test_changed_shape_raises_and_counts() -> None:
    model, opt = make_pair()
    backend = TorchBackend(model, opt, masked_mse)
    backend.train_call([make_batch(0)])
    backend.train_call([make_batch(1)])
    assert backend.recompilations == 0
    with pytest.raises(RecompilationError, match=r"z \[20\] int64 -> \[30\] int64"):
        backend.train_call([make_batch(2, packs=3)])
    assert backend.recompilations == 1
    with pytest.raises(RecompilationError, match=r"y \[6\] float32 -> \[8\] float32"):
        backend.train_call([make_batch(3, max_graphs=4)])
    assert backend.recompilations == 2
    backend.train_call([make_batch(4)])  # the original shape still runs


def test_predict_is_eval_no_grad_with_its_own_guard() -> None:
    model, opt = make_pair()
    backend = TorchBackend(model, opt, masked_mse)
    batch = make_batch(0)
    pred = backend.predict(batch)
    assert pred.shape == (batch.num_graphs,) and not pred.requires_grad
    assert not model.training
    torch.testing.assert_close(pred, model(batch).detach())
    with pytest.raises(RecompilationError, match="prediction batch shape changed"):
        backend.predict(make_batch(0, packs=1))
    backend.train_call([make_batch(0, packs=1)])  # training has its own first signature
    assert model.training


def test_compiled_step_matches_eager() -> None:
    """torch.compile(dynamic=False) gives the eager weights; one signature, no recompiles.

    The "eager" compile backend keeps the test fast: dynamo traces and guards as with inductor.
    """
    batches = [make_batch(seed) for seed in range(4)]
    model, opt = make_pair()
    compiled = TorchBackend(
        model, opt, masked_mse, gradient_accumulation=2, compile=True, compile_backend="eager"
    )
    ref_model, ref_opt = make_pair()
    eager = TorchBackend(ref_model, ref_opt, masked_mse, gradient_accumulation=2)
    for step in range(2):
        compiled.train_call(batches[2 * step : 2 * step + 2])
        eager.train_call(batches[2 * step : 2 * step + 2])
    assert_same_weights(model, ref_model, atol=1e-5)
    graphs = compiled.compiled_graphs
    assert graphs >= 1
    compiled.train_call(batches[:2])
    assert compiled.compiled_graphs == graphs, "same signature must not recompile"


def test_collectives_are_zero_with_one_replica() -> None:
    model, opt = make_pair()
    backend = TorchBackend(model, opt, masked_mse, merge_allreduce=False)
    assert backend.train_call([make_batch(0)])[0]["collectives"] == 0
    assert backend.collectives_per_step == 0


def test_make_backend_builds_torch_backend_from_config() -> None:
    cfg = BackendConfig(device="cpu", device_iterations=2, gradient_accumulation=3)
    model, opt = make_pair()
    backend = make_backend(cfg, model, opt, masked_mse, grad_clip=1.0)
    assert isinstance(backend, TorchBackend)
    assert (backend.device_iterations, backend.gradient_accumulation) == (2, 3)
    records = backend.train_call([make_batch(s) for s in range(6)])
    assert [r["molecules"] for r in records] == [12, 12]


def test_auto_selects_cpu_here() -> None:
    if poptorch_available() or torch.cuda.is_available():
        pytest.skip("an accelerator stack is installed; auto would not pick cpu")
    assert select_device("auto") == "cpu"


def test_ipu_without_poptorch_names_the_poplar_sdk() -> None:
    if poptorch_available():
        pytest.skip("poptorch is installed")
    with pytest.raises(DeviceError, match="Graphcore Poplar SDK"):
        select_device("ipu")
    with pytest.raises(DeviceError, match="Poplar SDK"):
        make_backend(BackendConfig(device="ipu"), *make_pair(), masked_mse)


def test_ipu_model_without_poptorch_emulates_on_cpu(caplog: pytest.LogCaptureFixture) -> None:
    if poptorch_available():
        pytest.skip("poptorch is installed; ipu-model runs PopTorch's IPU Model")
    cfg = BackendConfig(device="ipu-model", gradient_accumulation=2)
    with caplog.at_level(logging.WARNING, logger="schnet_ipu.backends"):
        backend = make_backend(cfg, *make_pair(), masked_mse)
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 1 and "emulating the IPU execution model on CPU" in notices[0]
    assert isinstance(backend, IpuEmulatorBackend)
    assert backend.device == torch.device("cpu")  # host-side autograd, as PoptorchBackend
    backend.train_call([make_batch(0), make_batch(1)])
    with pytest.raises(RecompilationError):
        backend.train_call([make_batch(2, packs=3), make_batch(3, packs=3)])
