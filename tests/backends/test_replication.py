"""Replication over real gloo processes: R replicas == one process on the same R batches.

Each replica trains on its own batches; gradients are averaged over replicas (merged into one
flat all-reduce, or one all-reduce per parameter) and clipped after the reduction. The
reference is a single process stepping on the mean loss of the same R x A batches, which for
batches with equal molecule counts is the same reduction (mean over replicas of means over A).
"""

from __future__ import annotations

import atexit
import io
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from tqdm import tqdm

from schnet_ipu.backends import (
    ReplicaInfo,
    TorchBackend,
    init_replica,
    launch_replicas,
    processes_for,
)
from schnet_ipu.backends.distributed import (
    prepare_once,
    replicas_in_call,
    shared_memory_reduction,
    shutdown_replica,
)
from schnet_ipu.backends.shared_memory import SHARED_DIR
from schnet_ipu.batch import Batch
from schnet_ipu.config import BackendConfig, ConfigError
from schnet_ipu.errors import ReplicaWaitError
from schnet_ipu.model import SchNet
from schnet_ipu.task import masked_mse
from tests.backends.test_backend import TinyModel, make_batch
from tests.backends.test_backend import masked_mse as tiny_loss

CALLS, STEPS, ACCUM = 1, 2, 2  # train_calls, device iterations, gradient accumulation
CLIP = 0.2  # small enough to be active, so clipping before the reduction would show
SCENARIOS = {  # name -> (model, merge_allreduce, shared_memory_allreduce, grad_clip, replicas)
    "tiny-merged": ("tiny", True, True, 0.0, (2, 4)),
    "tiny-merged-gloo": ("tiny", True, False, 0.0, (2, 4)),
    "tiny-per-parameter": ("tiny", False, False, 0.0, (2, 4)),
    "tiny-merged-clipped": ("tiny", True, True, CLIP, (2, 4)),
    "schnet-merged-clipped": ("schnet", True, True, CLIP, (2,)),
}


def build_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "tiny":
        return TinyModel()
    return SchNet(16, 16, 2, 8, cutoff=5.0, graph="knn", k=4, max_nodes_per_pack=10)


def schnet_loss(model: nn.Module, batch: Batch) -> Tensor:
    return masked_mse(model(batch), batch.y, batch.graph_mask, 1.0)


def batches_for(call: int, rank: int) -> list[Batch]:
    """The D x A micro-batches of one replica in one train_call."""
    return [make_batch(1000 * call + 100 * rank + i) for i in range(STEPS * ACCUM)]


def replica_worker(rank: int, world: int, out_dir: Path) -> None:
    """Train every scenario on this replica's batches; save weights and step records."""
    replica = init_replica(BackendConfig(device="cpu", replicas=world), "cpu")
    assert replica == ReplicaInfo(rank, world, rank)
    results = {}
    for name, (kind, merge, shared, clip, worlds) in SCENARIOS.items():
        if world not in worlds:
            continue
        model = build_model(kind, seed=rank)  # differs per rank until the broadcast
        backend = TorchBackend(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            tiny_loss if kind == "tiny" else schnet_loss,
            device_iterations=STEPS,
            gradient_accumulation=ACCUM,
            merge_allreduce=merge,
            shared_memory_allreduce=shared,
            grad_clip=clip,
            replica=replica,
        )
        records = [r for call in range(CALLS) for r in backend.train_call(batches_for(call, rank))]
        results[name] = {"state": model.state_dict(), "records": records}
    torch.save(results, out_dir / f"rank{rank}.pt")
    shutdown_replica()


def reference(kind: str, world: int, clip: float) -> nn.Module:
    """One process: each step on the mean loss over all replicas' micro-batches of that step."""
    model = build_model(kind, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = tiny_loss if kind == "tiny" else schnet_loss
    for call in range(CALLS):
        per_rank = [batches_for(call, rank) for rank in range(world)]
        for step in range(STEPS):
            group = [b for batches in per_rank for b in batches[step * ACCUM : (step + 1) * ACCUM]]
            opt.zero_grad()
            torch.stack([loss_fn(model, b) for b in group]).mean().backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return model


@pytest.mark.parametrize("world", [2, 4])
def test_replicas_match_one_process(world: int, tmp_path: Path) -> None:
    launch_replicas(replica_worker, world, world, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name, (kind, merge, _, clip, worlds) in SCENARIOS.items():
        if world not in worlds:
            continue
        want = reference(kind, world, clip).state_dict()
        for rank, results in enumerate(ranks):
            for key, value in results[name]["state"].items():
                torch.testing.assert_close(
                    value, want[key], atol=2e-6, rtol=1e-5, msg=f"{name} rank {rank} {key}"
                )
        num_grads = sum(p.requires_grad for p in build_model(kind, 0).parameters())
        expected = 1 if merge else num_grads
        records = ranks[0][name]["records"]
        assert len(records) == CALLS * STEPS
        assert {r["collectives"] for r in records} == {expected}, name
        assert all(r["molecules"] == ACCUM * 4 for r in records)


def reduction_worker(rank: int, world: int, out_dir: Path) -> None:
    """Sum random buffers over the replicas both through shared memory and with gloo."""
    replica = init_replica(BackendConfig(device="cpu", replicas=world), "cpu")
    shared = shared_memory_reduction(replica)
    assert shared is not None
    sums = []
    for call in range(3):  # both sets of rows, then the first again
        flat = torch.randn(1000, generator=torch.Generator().manual_seed(10 * rank + call))
        expected = flat.clone()
        dist.all_reduce(expected)
        shared.sum_(flat)
        sums.append((flat, expected))
    with pytest.raises(ValueError, match="gradient size changed"):
        shared.sum_(torch.zeros(10))
    torch.save(sums, out_dir / f"sums{rank}.pt")
    shutdown_replica()


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_sum_equals_gloo_all_reduce(world: int, tmp_path: Path) -> None:
    before = set(Path(SHARED_DIR).glob("schnet-ipu-grads-*"))
    launch_replicas(reduction_worker, world, world, tmp_path)
    ranks = [torch.load(tmp_path / f"sums{r}.pt") for r in range(world)]
    for call, (flat, expected) in enumerate(ranks[0]):
        torch.testing.assert_close(flat, expected, msg=f"call {call}")
        for rank in range(1, world):  # every replica holds the very same sum
            assert torch.equal(ranks[rank][call][0], flat), f"call {call} rank {rank}"
    assert set(Path(SHARED_DIR).glob("schnet-ipu-grads-*")) == before, "shared file left over"


def test_no_shared_memory_reduction_outside_spawned_replicas() -> None:
    assert shared_memory_reduction(ReplicaInfo(0, 2, 0)) is None


def failing_worker(rank: int) -> None:
    if rank == 1:
        raise ValueError("replica 1 failed on purpose")
    init_replica(BackendConfig(device="cpu", replicas=2), "cpu")  # waits for rank 1 forever


def test_child_failure_raises_in_parent_without_hanging() -> None:
    with pytest.raises(mp.ProcessRaisedException, match="replica 1 failed on purpose"):
        launch_replicas(failing_worker, 2)


def interrupted_worker(rank: int) -> None:
    raise KeyboardInterrupt  # as a Ctrl-C before the training loop takes it over


def test_ctrl_c_in_replicas_before_training_exits_130_without_a_traceback(capfd) -> None:
    with pytest.raises(SystemExit) as stopped:
        launch_replicas(interrupted_worker, 2)
    assert stopped.value.code == 130
    assert "Traceback" not in capfd.readouterr().err


def aborts_at_teardown(rank: int) -> None:
    atexit.register(os.abort)  # as native state failing to tear down at the process's exit


def test_a_finished_replica_exits_without_the_interpreters_teardown() -> None:
    """A replica that finished its work leaves at once: a crash the interpreter's teardown
    would meet afterwards cannot turn a complete run into a failed one."""
    launch_replicas(aborts_at_teardown, 2)  # else: process 0 terminated with SIGABRT


def shows_a_progress_bar(rank: int) -> None:
    for _ in tqdm(range(2), file=io.StringIO()):
        pass


def named_semaphores() -> set[str]:
    return {path.name for path in Path("/dev/shm").glob("sem.mp-*")}


def test_a_finished_replica_leaves_no_named_semaphore_behind() -> None:
    """Since a replica skips the interpreter's teardown, nothing it made may need it: a
    named semaphore left in /dev/shm is removed only by the resource tracker at the
    launcher's exit, with a warning after the run's last line."""
    before = named_semaphores()
    launch_replicas(shows_a_progress_bar, 2)
    assert named_semaphores() <= before


def test_one_replica_runs_in_process() -> None:
    seen: list[int] = []
    launch_replicas(seen.append, 1)
    assert seen == [0]


def test_alone_with_replicas_configured_is_an_error() -> None:
    with pytest.raises(ConfigError, match="launch_replicas"):
        init_replica(BackendConfig(replicas=2), "cpu")


def test_replicas_not_a_multiple_of_poprun_instances_is_one_line() -> None:
    with pytest.raises(ConfigError, match="multiple of the 3 PopRun instances"):
        replicas_in_call(BackendConfig(replicas=4), "ipu", ReplicaInfo(0, 3))


def test_poptorch_devices_replicate_in_one_process() -> None:
    cfg = BackendConfig(replicas=4)
    assert processes_for(cfg, "cpu") == 4
    assert processes_for(cfg, "ipu") == processes_for(cfg, "ipu-model") == 1
    assert init_replica(cfg, "ipu") == ReplicaInfo()


def test_more_cuda_replicas_than_gpus_is_refused_before_any_starts(monkeypatch) -> None:
    """configs/qm9.yaml's 2 replicas on a one-GPU host: one line naming the setting to use
    (a host with one GPU is what the device count says; none is here)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"backend.replicas=2, but this host has 1 CUDA.*=1"):
        processes_for(BackendConfig(replicas=2), "cuda")
    assert processes_for(BackendConfig(replicas=1), "cuda") == 1
    assert processes_for(BackendConfig(replicas=2), "cpu") == 2


def preparing_worker(rank: int, world: int, work_dir: Path, rank0_seconds: float) -> None:
    """Each rank 'prepares' by appending its rank to a log; rank 0 takes rank0_seconds."""
    replica = init_replica(BackendConfig(device="cpu", replicas=world), "cpu")

    def prepare() -> int:
        if rank == 0:
            time.sleep(rank0_seconds)
        with (work_dir / "log").open("a") as log:
            log.write(f"{rank}\n")
        return rank

    assert prepare_once(prepare, replica, work_dir, timeout_s=2.0) == rank
    shutdown_replica()


def test_rank0_prepares_the_data_before_the_others(tmp_path: Path) -> None:
    launch_replicas(preparing_worker, 2, 2, tmp_path, 0.5)
    order = (tmp_path / "log").read_text().split()
    assert order == ["0", "1"]
    assert not list(tmp_path.glob(".prepared-*"))  # the marker is removed afterwards


def test_waiting_for_rank0_times_out_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ReplicaWaitError, match="rank 0 did not finish preparing"):
        launch_replicas(preparing_worker, 2, 2, tmp_path, 30.0)
