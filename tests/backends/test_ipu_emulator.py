"""backend.device=ipu-model without PopTorch: R replicas in one process, as PopTorch runs them.

The emulator must equal one replica on the concatenated batch of each step (PopTorch's mean
over replicas and accumulation, then PopART's Adam: L2 decay added before the global norm is
clipped), for R up to 64, and the loader must give every molecule to exactly one of 64
replicas per epoch. It must fail where PopTorch 3.4.0 fails: wrapped buffers that
``weights_only`` loading refuses, replica counts PopTorch cannot reserve, no host device.
An emulated 2-replica run with decay, clipping, a schedule and a resume is then evaluated.
"""

from __future__ import annotations

import io
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from schnet_ipu.backends import (
    Backend,
    ReplicaInfo,
    make_backend,
    processes_for,
    replicas_in_call,
)
from schnet_ipu.backends.ipu_emulator import IpuEmulatorBackend, WrappedBuffer
from schnet_ipu.backends.poptorch_ops import UnsupportedOpError
from schnet_ipu.checkpoint import load_checkpoint, save_checkpoint
from schnet_ipu.config import BackendConfig, ConfigError, load_config
from schnet_ipu.training.data import make_loader, prepare_data
from schnet_ipu.training.finished_runs import evaluate_run, predict_split
from schnet_ipu.training.log import read_records
from schnet_ipu.training.loop import train
from tests.backends.test_backend import TinyModel, make_batch, masked_mse
from tests.helpers import qm9_rows, smoke_overrides, tiny_model

ROOT = Path(__file__).resolve().parents[2]
STEPS, ACCUM = 2, 2


def popart_reference_step(model: nn.Module, opt: torch.optim.Adam, clip: float) -> None:
    """PopART 3.4's Adam (L2 mode) on the mean gradient, written out: g + wd * w first
    (willow/src/patterns/adamdecompose.cpp), then the global norm of that clipped to
    ``clip`` by clip / max(clip, norm) (transforms/clipweightgradientsbynorm.cpp), then
    Adam without decay. ``opt`` is built with weight_decay=0; the decay is ``DECAY``."""
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        p.grad += DECAY * p.detach()
    if clip:
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
        for p in params:
            p.grad *= clip / max(clip, norm)
    opt.step()


DECAY = 0.01


def emulator_and_reference(
    replicas: int, clip: float, accum: int = ACCUM
) -> tuple[nn.Module, nn.Module, list]:
    """Train the emulator and the one-replica PopART reference from the same start on the
    same micro-batches; return both models and the emulator's records."""
    batches = [make_batch(seed) for seed in range(STEPS * replicas * accum)]
    torch.manual_seed(0)
    model = TinyModel()
    torch.manual_seed(0)
    ref = TinyModel()
    backend = IpuEmulatorBackend(
        model,
        torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=DECAY),
        masked_mse,
        replicas=replicas,
        device_iterations=STEPS,
        gradient_accumulation=accum,
        grad_clip=clip,
    )
    records = backend.train_call(batches)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=0.0)
    per_step = replicas * accum
    for step in range(STEPS):
        opt.zero_grad()
        group = batches[step * per_step : (step + 1) * per_step]
        torch.stack([masked_mse(ref, b) for b in group]).mean().backward()
        popart_reference_step(ref, opt, clip)
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


def test_decay_is_added_before_clipping_as_popart_does():
    """Defect 4: decay 0.01 and clip 1.0 (the issue's numbers). The emulator follows PopART;
    torch's order (clip, then Adam's own decay) gives other weights, so the test can fail."""
    model, ref, _ = emulator_and_reference(2, 1.0, accum=1)
    for (name, x), y in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=name)
    torch.manual_seed(0)
    torch_order = TinyModel()
    opt = torch.optim.Adam(torch_order.parameters(), lr=0.01, weight_decay=DECAY)
    batches = [make_batch(seed) for seed in range(STEPS * 2)]
    for step in range(STEPS):
        opt.zero_grad()
        torch.stack(
            [masked_mse(torch_order, b) for b in batches[2 * step : 2 * step + 2]]
        ).mean().backward()
        nn.utils.clip_grad_norm_(torch_order.parameters(), 1.0)
        opt.step()
    differences = [
        float((x - y).abs().max())
        for x, y in zip(model.state_dict().values(), torch_order.state_dict().values())
    ]
    assert max(differences) > 1e-3, differences


def test_replicas_take_consecutive_micro_batches_in_rotation():
    """PopART's stepiosplitter hands micro-batch i of a step to replica i mod R: with R = 2
    and A = 2, replica 0 computes batches 0 and 2, replica 1 batches 1 and 3."""
    batches = [make_batch(seed) for seed in range(4)]
    seen = []

    def recording_loss(model, batch):
        seen.append(next(i for i, b in enumerate(batches) if b is batch))
        return masked_mse(model, batch)

    model = TinyModel()
    backend = IpuEmulatorBackend(
        model, torch.optim.SGD(model.parameters(), lr=0.1), recording_loss, replicas=2,
        gradient_accumulation=2,
    )  # fmt: skip
    backend.train_call(batches)
    assert seen == [0, 2, 1, 3]


class BufferedModel(TinyModel):
    """TinyModel with a buffer, as SchNet's ``offset`` and ``initial_atomref``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.tensor([0.5]))

    def forward(self, batch):
        return super().forward(batch) + self.shift


def test_buffers_are_wrapped_and_refused_by_weights_only_loading_as_poptorch_s(tmp_path):
    """Defect 1: like PopTorch's ``PoptorchBuffer`` the wrapped buffer survives ``detach()``
    (state_dict) and pickles as a call that ``weights_only`` refuses; the checkpoint writer
    saves plain tensors, so the checkpoint loads."""
    model = BufferedModel()
    backend = IpuEmulatorBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), masked_mse)
    backend.train_call([make_batch(0)])
    state = model.state_dict()
    assert type(state["shift"]) is WrappedBuffer
    raw = io.BytesIO()
    torch.save(state, raw)
    raw.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="rewrap_buffer"):
        torch.load(raw, weights_only=True)
    names = ("model", "optimizer", "scheduler", "rng", "epoch", "call", "best_mae", "config")
    checkpoint = {**{key: {} for key in names}, "model": state}
    save_checkpoint(tmp_path / "last.pt", checkpoint)
    loaded = load_checkpoint(tmp_path / "last.pt")["model"]
    assert type(loaded["shift"]) is torch.Tensor and torch.equal(loaded["shift"], state["shift"])
    model.load_state_dict(loaded)
    assert type(model.shift) is WrappedBuffer  # still held by the executable


def test_the_emulator_offers_the_backend_interface_with_the_cpu_as_host_device():
    """Defect 3: host-side autograd (forces in evaluation) of an IPU run runs on the CPU:
    the emulator, like PoptorchBackend, says so through the Backend interface."""
    model = TinyModel()
    backend = IpuEmulatorBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), masked_mse)
    assert backend.device == torch.device("cpu") and backend.graph_captures == 0
    members = [name for name in dir(Backend) if not name.startswith("_")]
    assert members and all(hasattr(backend, name) for name in members)


@pytest.mark.parametrize(
    ("device", "replicas", "refused"),
    [("ipu", 3, "power of two"), ("ipu", 128, "at most 64"), ("ipu", 64, None),
     ("ipu-model", 65, "at most 64"), ("ipu-model", 3, None)],
)  # fmt: skip
def test_replica_counts_poptorch_cannot_reserve_are_refused(device, replicas, refused):
    """Defect 2: popart_compiler/source/CompilerImpl.cpp reserves a power of two of IPUs
    (hardware) and at most 64 per process (hardware and IPU Model)."""
    overrides = [f"backend.device={device}", f"backend.replicas={replicas}"]
    if refused is None:
        assert load_config(None, overrides).backend.replicas == replicas
    else:
        with pytest.raises(ConfigError, match=refused):
            load_config(None, overrides)


@pytest.mark.parametrize(("instances", "ok"), [(2, True), (3, False)])
def test_poprun_checks_the_replicas_of_each_instance(instances, ok):
    """128 replicas: 64 per instance over 2 instances is fine, 3 instances cannot split
    them into a power of two each."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/poprun.py"), "backend.device=ipu",
         "backend.replicas=128", f"--instances={instances}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert (result.returncode == 0) == ok, result.stderr
    if not ok:
        assert "per instance" in result.stderr and len(result.stderr.strip().splitlines()) == 1


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


def test_a_copy_to_the_host_inside_the_step_is_refused():
    """PopTorch refuses ``item`` in a traced model (RegisterAtenOverloads.cpp)."""
    model = TinyModel()
    backend = IpuEmulatorBackend(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, b: masked_mse(m, b) / masked_mse(m, b).item(),
    )  # fmt: skip
    with pytest.raises(UnsupportedOpError, match="eager mode: aten::_local_scalar_dense"):
        backend.train_call([make_batch(0)])


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return qm9_rows(tmp_path_factory.mktemp("qm9"), limit=300)


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


def emulated_run(store: Path, run_dir: Path, *overrides: str):
    """The issue's target run: emulated IPU, 2 replicas, weight decay, clipping, cosine."""
    return load_config(
        None,
        smoke_overrides(
            store,
            run_dir,
            "data.val=20",
            "data.test=20",
            "model.graph=knn",
            "packing.algorithm=lpfhp",
            "model.k=4",
            "backend.device=ipu-model",
            "backend.replicas=2",
            "backend.threads=0",
            "optim.weight_decay=0.01",
            "optim.grad_clip=1.0",
            "optim.schedule=cosine",
            "logging.plot=true",
            *overrides,
            width=16,
        ),
    )


def test_emulated_two_replica_run_resumes_and_is_evaluated(store, tmp_path):
    """Defect 1 end to end: every checkpoint of a run with wrapped buffers loads under
    ``weights_only`` (best.pt before the test, last.pt on resume, evaluate, predict)."""
    run_dir = tmp_path / "run"
    train(emulated_run(store, run_dir, "optim.epochs=1"))
    final = train(emulated_run(store, run_dir, "optim.epochs=2"))  # resumes from last.pt
    assert [r["epoch"] for r in read_records(run_dir / "metrics.jsonl", "epoch")] == [0, 1]
    assert final["test_molecules"] == 20 and math.isfinite(final["test_mae"])
    for name in ("last", "best"):
        state = torch.load(run_dir / f"checkpoints/{name}.pt", weights_only=True)
        assert type(state["model"]["distance_expansion.offset"]) is torch.Tensor
    result = evaluate_run(run_dir, "test")
    assert result["molecules"] == 20 and math.isfinite(result["mae"])
    assert predict_split(run_dir, "test", tmp_path / "test.csv") == 20


def test_emulated_run_on_forces_data_is_evaluated_predicted_and_used_by_the_calculator(tmp_path):
    """Defect 3: host-side force evaluation (on the CPU), ``predict --input`` and the
    calculator of an IPU run (the model file alone, no PopTorch). Energy-only training
    (PopTorch refuses force training), forces in the store."""
    import ase.io

    from schnet_ipu.inference.calculator import SchNetCalculator
    from schnet_ipu.inference.predictor import predict_file
    from tests.training.test_forces import emt_frames

    frames = tmp_path / "emt.extxyz"
    ase.io.write(frames, emt_frames(48), format="extxyz")
    run_dir = tmp_path / "run"
    overrides = [
        f"data.files=[{frames}]",
        f"data.path={tmp_path / 'emt.h5'}",
        "data.val=8",
        "data.test=8",
        "packing.packs_per_batch=2",
        "packing.max_nodes=20",
        *tiny_model(16),
        "optim.forces_weight=0",
        "optim.beat_baseline=false",  # a smoke run, too short to learn
        "optim.warmup_steps=0",
        "optim.weight_decay=0.01",
        "optim.grad_clip=1.0",
        "backend.device=ipu-model",
        "backend.replicas=2",
        "backend.threads=0",
        "logging.progress=false",
        f"logging.run_dir={run_dir}",
    ]
    config = ROOT / "configs/emt_forces.yaml"
    train(load_config(config, [*overrides, "optim.epochs=1"]))
    train(load_config(config, [*overrides, "optim.epochs=2"]))  # resumes
    result = evaluate_run(run_dir, "test")
    assert result["force_mae"] > 0 and math.isfinite(result["mae"])
    assert predict_file(run_dir, frames, tmp_path / "out.extxyz") == 48
    atoms = emt_frames(1, seed=3)[0]
    atoms.calc = SchNetCalculator(run_dir)
    assert atoms.get_forces().shape == (len(atoms), 3)
