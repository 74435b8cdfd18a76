"""The PopTorch backend against the real poptorch (IPU Model); skipped where it is absent."""

from __future__ import annotations

import pytest
import torch
from test_backend import TinyModel, make_batch, masked_mse

from schnet_ipu.backends import RecompilationError
from schnet_ipu.config import BackendConfig

pytestmark = pytest.mark.ipu
poptorch = pytest.importorskip(
    "poptorch", reason="poptorch ships with the Graphcore Poplar SDK, not PyPI; not installed"
)
from schnet_ipu.backends.poptorch_backend import (  # noqa: E402 (needs poptorch)
    PoptorchBackend,
    make_options,
    to_device_tuple,
)


def test_options_carry_the_config() -> None:
    cfg = BackendConfig(device="ipu-model", replicas=1, device_iterations=3)
    options = make_options(cfg, prefetch=2, seed=7)
    assert options.device_iterations == 3
    assert options.replication_factor == 1


def test_ipu_model_training_matches_the_cpu_reference() -> None:
    """D=2, A=2 on the IPU Model == the same mean-reduced steps in plain PyTorch."""
    cfg = BackendConfig(device="ipu-model", device_iterations=2, gradient_accumulation=2)
    batches = [make_batch(seed) for seed in range(4)]
    torch.manual_seed(0)
    model = TinyModel()
    backend = PoptorchBackend(
        cfg, model, poptorch.optim.SGD(model.parameters(), lr=0.05), masked_mse
    )
    records = backend.train_call(batches)
    assert [r["molecules"] for r in records] == [8, 8]
    torch.manual_seed(0)
    ref = TinyModel()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(2):
        opt.zero_grad()
        torch.stack(
            [masked_mse(ref, b) for b in batches[2 * step : 2 * step + 2]]
        ).mean().backward()
        opt.step()
    backend._train.copyWeightsToHost()
    for x, y in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    pred = backend.predict(batches[0])
    assert pred.shape == (batches[0].num_graphs,)
    with pytest.raises(RecompilationError):
        backend.predict(make_batch(0, packs=3))


def test_device_tuple_concatenates_along_dim0() -> None:
    tensors = to_device_tuple([make_batch(0), make_batch(1)])
    assert tensors[0].shape == (40,) and tensors[1].shape == (40, 3)
