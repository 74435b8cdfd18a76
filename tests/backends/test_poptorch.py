"""The PopTorch backend against the real poptorch (IPU Model); skipped where it is absent.

Ready for the first machine with the Poplar SDK: SchNet (ipu op flavour) trains with
``poptorch.optim.Adam``, a schedule that reaches the device, replication 2, validation
between steps, load-best-then-test and predict; each is compared with the same steps on
the CPU (PopART's Adam written out: weight decay added before clipping).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from schnet_ipu.backends import RecompilationError
from schnet_ipu.config import BackendConfig, load_config
from schnet_ipu.model import SchNet
from schnet_ipu.task import masked_mse as schnet_mse
from schnet_ipu.training.loop import train
from tests.backends.test_backend import TinyModel, make_batch, masked_mse
from tests.backends.test_ipu_emulator import DECAY, popart_reference_step
from tests.helpers import smoke_overrides

pytestmark = pytest.mark.ipu
poptorch = pytest.importorskip(
    "poptorch", reason="poptorch ships with the Graphcore Poplar SDK, not PyPI; not installed"
)
from schnet_ipu.backends.poptorch_backend import (  # noqa: E402 (needs poptorch)
    PoptorchBackend,
    make_optimizer,
    make_options,
    to_device_tuple,
)

LR = 0.01


def test_options_carry_the_config(tmp_path: Path) -> None:
    cfg = BackendConfig(device="ipu-model", replicas=2, device_iterations=3)
    options = make_options(cfg, prefetch=2, seed=7, cache_dir=str(tmp_path))
    assert options.device_iterations == 3 and options.replication_factor == 2
    inference = make_options(cfg, prefetch=2, seed=7, training=False)
    assert inference.device_iterations == 1 and inference.replication_factor == 1


def test_a_torch_optimiser_is_refused() -> None:
    model = TinyModel()
    with pytest.raises(TypeError, match=r"poptorch\.optim optimiser"):
        PoptorchBackend(
            BackendConfig(device="ipu-model"), model, torch.optim.Adam(model.parameters()), None
        )


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
    for x, y in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    pred = backend.predict(batches[0])
    assert pred.shape == (batches[0].num_graphs,)
    with pytest.raises(RecompilationError):
        backend.predict(make_batch(0, packs=3))


def test_device_tuple_concatenates_along_dim0() -> None:
    tensors = to_device_tuple([make_batch(0), make_batch(1)])
    assert tensors[0].shape == (40,) and tensors[1].shape == (40, 3)


def schnet(seed: int) -> SchNet:
    torch.manual_seed(seed)
    return SchNet(16, 16, 2, 8, cutoff=5.0, graph="knn", k=4, max_nodes_per_pack=10, ops="ipu")


def schnet_loss(model, batch) -> torch.Tensor:
    return schnet_mse(model(batch), batch.y, batch.graph_mask, 1.0)


def cpu_steps(model: SchNet, opt: torch.optim.Optimizer, calls: list[list]) -> None:
    """The reference: per step, the mean loss over both replicas' micro-batches, then
    PopART's Adam: decay ``DECAY`` added before the norm is clipped to 1 (``opt`` has none)."""
    for batches in calls:
        opt.zero_grad()
        torch.stack([schnet_loss(model, b) for b in batches]).mean().backward()
        popart_reference_step(model, opt, 1.0)


def test_schnet_adam_schedule_validation_best_weights_and_predict() -> None:
    """Two replicas; Adam's state survives a validation in between; an lr of 0 set on the
    host reaches the device; weights loaded on the host are the ones predict uses."""
    cfg = BackendConfig(device="ipu-model", replicas=2)
    calls = [[make_batch(10 * c + r) for r in range(2)] for c in range(3)]
    model, ref = schnet(0), schnet(0)
    optimizer = make_optimizer(
        model.parameters(), LR, weight_decay=DECAY, grad_clip=1.0, beta2=0.999
    )
    backend = PoptorchBackend(cfg, model, optimizer, schnet_loss)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR, weight_decay=0.0)

    backend.train_call(calls[0])
    pred = backend.predict(calls[0][0])  # a validation: the executables swap
    backend.train_call(calls[1])
    cpu_steps(ref, ref_opt, calls[:2])
    for (name, x), y in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-3, msg=name)
    assert pred.shape == (calls[0][0].num_graphs,)

    state = optimizer.state_dict()  # read back from the device for the checkpoint
    assert state["ipu_state"] is not None and state["ipu_param"] is not None
    best = {k: v.clone() for k, v in model.state_dict().items()}

    for group in optimizer.param_groups:  # the schedule: lr 0 must freeze the weights
        group["lr"] = 0.0
    backend.optimizer_changed()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backend.train_call(calls[2])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)

    for group in optimizer.param_groups:
        group["lr"] = LR
    backend.optimizer_changed()
    backend.train_call(calls[2])
    backend.predict(calls[0][0])  # the inference executable now holds the last weights
    model.load_state_dict(best)  # load-best-then-test
    backend.after_host_weight_load()
    ref.load_state_dict(best)
    with torch.no_grad():
        expected = ref(calls[0][0])
    torch.testing.assert_close(backend.predict(calls[0][0]), expected, atol=1e-4, rtol=1e-3)


def test_train_end_to_end_on_the_ipu_model(qm9_small: Path, tmp_path: Path) -> None:
    """The training application: 2 replicas, cosine schedule, weight decay and clipping,
    validation, best, test, a resume, evaluate and predict; on IPUs where there are some.
    Every checkpoint loads with ``weights_only`` (PopTorch's wrapped buffers are saved
    plain)."""
    from schnet_ipu.training.finished_runs import evaluate_run, predict_split

    device = "ipu" if poptorch.ipuHardwareIsAvailable() else "ipu-model"
    run_dir = tmp_path / "run"
    overrides = smoke_overrides(
        qm9_small,
        run_dir,
        "data.val=60",
        "data.test=60",
        "model.k=8",
        "optim.epochs=1",
        "optim.schedule=cosine",
        "optim.weight_decay=0.01",
        "optim.grad_clip=1.0",
        f"backend.device={device}",
        "backend.replicas=2",
        "backend.threads=0",
        "logging.plot=true",
        width=16,
    )
    cfg = load_config(None, overrides)
    train(cfg)
    cfg.optim.epochs = 2
    final = train(cfg)  # resumes from last.pt
    assert final["test_molecules"] == 60 and math.isfinite(final["test_mae"])
    if device == "ipu":  # PopTorch caches executables on hardware only (CompilerImpl.cpp)
        assert any((run_dir / "executables").iterdir())
    last = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    assert last["optimizer"]["ipu_state"] is not None  # the device's Adam state
    assert evaluate_run(run_dir, "test")["molecules"] == 60
    assert predict_split(run_dir, "test", tmp_path / "test.csv") == 60
