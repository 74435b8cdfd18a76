"""backend.device=ipu-model without PopTorch: R replicas in one process, as PopTorch runs them.

The emulator must equal one replica on the concatenated batch of each step (PopTorch's mean
over replicas and accumulation, clipping after the reduction), for R up to 64, and the
loader must give every molecule to exactly one of 64 replicas per epoch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_backend import TinyModel, make_batch, masked_mse
from torch import nn

from schnet_ipu.backends import ReplicaInfo, make_backend, processes_for, replicas_in_call
from schnet_ipu.backends.ipu_emulator import IpuEmulatorBackend
from schnet_ipu.config import BackendConfig, load_config
from schnet_ipu.data import import_qm9
from schnet_ipu.pipeline import make_loader, prepare_data

STEPS, ACCUM = 2, 2


def emulator_and_reference(replicas: int, clip: float) -> tuple[nn.Module, nn.Module, list]:
    """Train the emulator and the one-replica reference from the same start on the same
    micro-batches; return both models and the emulator's records."""
    batches = [make_batch(seed) for seed in range(STEPS * replicas * ACCUM)]
    torch.manual_seed(0)
    model = TinyModel()
    torch.manual_seed(0)
    ref = TinyModel()
    backend = IpuEmulatorBackend(
        model,
        torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01),
        masked_mse,
        replicas=replicas,
        device_iterations=STEPS,
        gradient_accumulation=ACCUM,
        grad_clip=clip,
    )
    records = backend.train_call(batches)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=0.01)
    per_step = replicas * ACCUM
    for step in range(STEPS):
        opt.zero_grad()
        group = batches[step * per_step : (step + 1) * per_step]
        torch.stack([masked_mse(ref, b) for b in group]).mean().backward()
        if clip:
            nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
    return model, ref, records


@pytest.mark.parametrize(("replicas", "clip"), [(64, 0.05), (3, 0.0)])
def test_replicas_in_one_process_equal_one_replica_on_the_concatenated_batch(replicas, clip):
    model, ref, records = emulator_and_reference(replicas, clip)
    for (name, x), y in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=name)
    assert len(records) == STEPS
    assert all(r["collectives"] == 1 for r in records)
    molecules = [make_batch(seed).num_molecules for seed in range(STEPS * replicas * ACCUM)]
    per_step = replicas * ACCUM
    assert [r["molecules"] for r in records] == [
        sum(molecules[s * per_step : (s + 1) * per_step]) for s in range(STEPS)
    ]


def test_clipping_changes_the_step():
    """The clipped scenario above is not vacuous: the clip is below the gradient norm."""
    clipped, _, _ = emulator_and_reference(3, 0.05)
    unclipped, _, _ = emulator_and_reference(3, 0.0)
    assert not torch.allclose(clipped.out.weight, unclipped.out.weight)


def test_wrong_number_of_micro_batches_is_refused():
    torch.manual_seed(0)
    model = TinyModel()
    backend = IpuEmulatorBackend(
        model, torch.optim.SGD(model.parameters(), lr=0.1), masked_mse, replicas=4
    )
    with pytest.raises(ValueError, match="1 x 4 x 1 = 4 micro-batches, got 3"):
        backend.train_call([make_batch(s) for s in range(3)])


def test_ipu_model_without_poptorch_is_one_process_driving_all_replicas():
    cfg = BackendConfig(device="ipu-model", replicas=64, device_iterations=2)
    assert processes_for(cfg, "cpu") == 1
    assert replicas_in_call(cfg, "cpu", ReplicaInfo()) == 64
    assert replicas_in_call(BackendConfig(device="cpu", replicas=4), "cpu", ReplicaInfo()) == 1
    model = TinyModel()
    backend = make_backend(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1), masked_mse,
                           device="cpu")  # fmt: skip
    assert isinstance(backend, IpuEmulatorBackend) and backend.replicas == 64
    batch = make_batch(5)
    torch.testing.assert_close(backend.predict(batch), model(batch).detach())


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qm9") / "qm9_300.h5"
    import_qm9(path, limit=300)
    return path


@pytest.mark.parametrize("instances", [1, 64], ids=["one-process", "64-instances"])
def test_64_replicas_read_every_training_molecule_once_per_epoch(store, tmp_path, instances):
    """R = 64 fed by one process (the emulator, PopTorch) or by 64 PopRun instances."""
    cfg = load_config(
        None,
        [
            f"data.path={store}",
            "data.val=20",
            "data.test=20",
            "model.graph=knn",
            "packing.algorithm=lpfhp",
            "model.k=4",
            "packing.packs_per_batch=1",
            "backend.device=ipu-model",
            "backend.replicas=64",
            "loader.workers=0",
            f"logging.run_dir={tmp_path}",
        ],
    )
    data = prepare_data(cfg)
    seen = []
    for rank in range(instances):
        in_call = replicas_in_call(cfg.backend, "cpu", ReplicaInfo(rank, instances))
        loader = make_loader(cfg, data, "train", rank, instances, replicas_in_call=in_call)
        for call in loader.epoch(1):
            assert len(call) == in_call
            seen += [int(i) for b in call for i in b.molecule_index[b.graph_mask]]
    assert sorted(seen) == sorted(data.split["train"].tolist())
