"""The CUDA path on a real GPU: skipped where torch sees no CUDA device (CI, the dev VM).

pytest -q tests/backends/test_cuda.py   # on a GPU machine
"""

from __future__ import annotations

from pathlib import Path

import ase.io
import pytest
import torch

from schnet_ipu.backends import TorchBackend
from schnet_ipu.config import load_config
from schnet_ipu.data import import_qm9
from schnet_ipu.training.log import read_records
from schnet_ipu.training.loop import train
from tests.backends.test_backend import make_batch
from tests.backends.test_precision import schnet, schnet_loss
from tests.training.test_forces import ROOT, emt_frames

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BATCHES = [make_batch(seed, packs=3) for seed in range(8)]


def run(graphs: bool, precision: str = "fp32", calls: int = 6) -> tuple[TorchBackend, list]:
    """``calls`` host calls of 2 steps x 2 micro-batches, a per-step LambdaLR schedule."""
    model = schnet()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, fused=True)
    backend = TorchBackend(
        model, optimizer, schnet_loss, device="cuda", device_iterations=2,
        gradient_accumulation=2, grad_clip=1.0, precision=precision, cuda_graphs=graphs,
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    losses = []
    for call in range(calls):
        start = 4 * call % len(BATCHES)
        for record in backend.train_call(BATCHES[start : start + 4]):
            scheduler.step()
            losses.append(record["loss"])
    return backend, torch.stack(losses).tolist()


def test_captured_step_matches_eager_steps() -> None:
    graphed, graphed_losses = run(graphs=True)
    eager, eager_losses = run(graphs=False)
    assert graphed.graph_captures == 1 and eager.graph_captures == 0
    assert graphed_losses == pytest.approx(eager_losses, rel=1e-4)
    for got, want in zip(graphed.model.parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert float(graphed.optimizer.param_groups[0]["lr"]) == pytest.approx(3e-3 / 13)


@pytest.mark.parametrize(("precision", "rel"), [("tf32", 0.02), ("bf16", 0.05)])
def test_each_precision_trains_with_a_graph(precision: str, rel: float) -> None:
    """A captured step in each precision follows fp32's losses step by step."""
    backend, losses = run(graphs=True, precision=precision, calls=12)
    fp32_losses = run(graphs=False, calls=12)[1]
    assert backend.graph_captures == 1
    assert losses == pytest.approx(fp32_losses, rel=rel)
    assert sum(losses[-4:]) < sum(losses[:4])


def train_small(store: Path, run_dir: Path, device_resident: str) -> dict:
    overrides = [
        f"data.path={store}", "data.val=40", "data.test=40", "model.hidden_channels=16",
        "model.num_filters=16", "model.num_interactions=1", "optim.epochs=2",
        "optim.beat_baseline=false",
        "loader.workers=0", "logging.progress=false", "logging.log_every=3",
        f"logging.run_dir={run_dir}", "backend.device=cuda",
        f"loader.device_resident={device_resident}",
    ]  # fmt: skip
    return train(load_config(None, overrides))


def test_training_run_captures_once(tmp_path: Path) -> None:
    """Device-resident batches (gathered on the GPU) and host-fed ones (pinned, copied)
    train alike, each with one graph capture."""
    store = import_qm9(tmp_path / "qm9.h5", limit=300, progress=False)
    on_device = train_small(store, tmp_path / "on_device", "true")
    from_host = train_small(store, tmp_path / "from_host", "false")
    for final in (on_device, from_host):
        assert final["cuda_graph_captures"] == 1 and final["recompilations"] == 0
    assert on_device["test_mae"] == pytest.approx(from_host["test_mae"], rel=1e-3)


def test_force_training_run_captures_once(tmp_path: Path) -> None:
    """Force training (the step's double backward and the per-atom energy error) inside
    one CUDA graph, as backend.cuda_graphs=auto trains on a GPU, against the eager step."""
    path = tmp_path / "emt.extxyz"
    ase.io.write(path, emt_frames(48), format="extxyz")
    finals = []
    for graphs in ("true", "false"):
        overrides = [
            f"data.files=[{path}]", f"data.path={tmp_path / 'emt.h5'}", "data.val=8",
            "data.test=8", "packing.packs_per_batch=1", "model.hidden_channels=16",
            "model.num_filters=16", "model.num_interactions=1", "optim.epochs=2",
            "optim.beat_baseline=false",
            "logging.progress=false", f"logging.run_dir={tmp_path / graphs}",
            "backend.device=cuda", f"backend.cuda_graphs={graphs}",
        ]  # fmt: skip
        finals.append(train(load_config(ROOT / "configs/emt_forces.yaml", overrides)))
    graphed, eager = finals
    assert graphed["cuda_graph_captures"] == 1 and graphed["recompilations"] == 0
    assert graphed["test_force_mae"] == pytest.approx(eager["test_force_mae"], rel=1e-3)
    # the epoch's training errors, summed inside the captured step (the first epoch's also
    # count the graph's warm-up steps)
    last = [
        read_records(tmp_path / graphs / "metrics.jsonl", "epoch")[-1]
        for graphs in ("true", "false")
    ]
    assert last[0]["train_force_mae"] == pytest.approx(last[1]["train_force_mae"], rel=1e-3)
