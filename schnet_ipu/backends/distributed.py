"""Data-parallel replicas as processes over ``torch.distributed``.

A replica is one process. Three ways to get R of them:

* ``launch_replicas(fn, R, ...)`` spawns R local processes (CPU gloo, or one GPU each) on a
  free localhost port, unless the program already runs under ``torchrun``;
* ``torchrun --nproc-per-node ...`` (multi-node GPU clusters) sets RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT, which :func:`init_replica` reads;
* PopRun (multi-host IPU-PODs) starts one instance per host group; the instance index and
  count come from popdist, PopTorch replicates inside each instance (R / instances local
  replicas), and a gloo group over the instances (rank and size from popdist, rendezvous at
  MASTER_ADDR:MASTER_PORT, which scripts/poprun.py exports) serves evaluation sums,
  barriers and broadcasts.

PopTorch and its CPU emulator (``backend.device`` ipu or ipu-model) drive all replicas of an
instance from one process: :func:`processes_for` and :func:`replicas_in_call` say so.

Gradient reduction is a mean over replicas (sum, then divide by R), PopTorch's default. With
``merge_allreduce`` all gradients travel in one flat buffer: one collective per optimiser step.
CPU replicas that ``launch_replicas`` spawned on this host sum that buffer through shared
memory (:mod:`~schnet_ipu.backends.shared_memory`) instead of a gloo all-reduce.

About 470 lines, one module: every way of starting replicas (spawned, torchrun, PopRun) ends
in the same :class:`ReplicaInfo` and process group, and the reductions over that group
(merged or per parameter, shared memory on one host) are chosen from how it was started;
split, each half would import the other's private state.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from tqdm import tqdm

from schnet_ipu.backends.shared_memory import SharedMemoryReduction
from schnet_ipu.config import IPU_DEVICES, BackendConfig, ConfigError
from schnet_ipu.errors import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    INTERRUPTED,
    ReplicaWaitError,
    UserError,
    configure_logging,
    on_ctrl_c,
)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_spawn_barrier = None  # the barrier of the replicas spawned together with this process


@dataclass(frozen=True)
class ReplicaInfo:
    """Where this process sits among the replicas."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs and checkpoints."""
        return self.rank == 0


def dist_backend_for(backend_cfg: BackendConfig, device: str) -> str:
    """``backend.dist_backend`` with ``auto`` resolved: nccl on CUDA, gloo otherwise."""
    if backend_cfg.dist_backend != "auto":
        return backend_cfg.dist_backend
    return "nccl" if device.startswith("cuda") else "gloo"


def popdist_instance() -> ReplicaInfo | None:
    """The PopRun instance index and count when running under ``poprun``, else None."""
    try:
        import popdist
    except ImportError:
        return None
    if not popdist.isPopdistEnvSet():
        return None
    return ReplicaInfo(popdist.getInstanceIndex(), popdist.getNumInstances(), 0)


def one_process_drives_replicas(backend_cfg: BackendConfig, device: str) -> bool:
    """True for PopTorch and its CPU emulator (``backend.device=ipu-model`` resolved to
    "cpu"), which replicate inside one process per instance."""
    return device in IPU_DEVICES or backend_cfg.device in IPU_DEVICES


def processes_for(backend_cfg: BackendConfig, device: str) -> int:
    """Replica processes to launch here: R for torch devices, 1 for PopTorch and its
    emulator (``device`` is what :func:`~schnet_ipu.backends.select_device` gave). Spawned
    CUDA replicas take one GPU each, so more of them than GPUs is refused before any starts."""
    if one_process_drives_replicas(backend_cfg, device):
        return 1
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    if gpus and not under_torchrun() and backend_cfg.replicas > gpus:
        raise ConfigError(
            f"backend.replicas={backend_cfg.replicas}, but this host has {gpus} CUDA "
            f"device(s) and each replica takes one: set backend.replicas={gpus}"
        )
    return backend_cfg.replicas


def replicas_in_call(backend_cfg: BackendConfig, device: str, replica: ReplicaInfo) -> int:
    """Replicas one process feeds per host call: 1 for torch devices, this instance's
    replicas (R / instances; R without PopRun) for PopTorch and its emulator."""
    if not one_process_drives_replicas(backend_cfg, device):
        return 1
    if backend_cfg.replicas % replica.world_size:
        raise ConfigError(
            f"backend.replicas={backend_cfg.replicas} must be a multiple of the "
            f"{replica.world_size} PopRun instances"
        )
    return backend_cfg.replicas // replica.world_size


def init_replica(backend_cfg: BackendConfig, device: str, timeout_s: float = 600.0) -> ReplicaInfo:
    """Join the process group described by the environment; one process means no group.

    Under PopRun the instance comes from popdist, PopTorch reduces the gradients, and the
    instances join a gloo group (:func:`join_poprun_group`) for evaluation sums and barriers.
    PopTorch or its emulator on one host is one process, without a group. Otherwise
    WORLD_SIZE > 1 (set by torchrun or by :func:`launch_replicas`) initialises
    ``torch.distributed`` with gloo (CPU) or nccl (CUDA); ``backend.replicas`` must be that
    WORLD_SIZE (every node's processes together), else :class:`ConfigError`.
    """
    instance = popdist_instance()
    if instance is not None:
        join_poprun_group(backend_cfg, instance, timeout_s)
        return instance
    if one_process_drives_replicas(backend_cfg, device):  # replicas inside this process
        return ReplicaInfo()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        if backend_cfg.replicas > 1:
            raise ConfigError(
                f"backend.replicas={backend_cfg.replicas} but this process is alone; start it "
                "through launch_replicas (train.py does) or torchrun --nproc-per-node"
            )
        return ReplicaInfo()
    if backend_cfg.replicas != world_size:  # the global batch is backend.replicas' to say
        raise ConfigError(
            f"backend.replicas={backend_cfg.replicas}, but the launcher started {world_size} "
            f"processes (WORLD_SIZE, all nodes together); set backend.replicas={world_size}: "
            "it is the run's total, and with it the global batch (molecules per step)"
        )
    replica = ReplicaInfo(
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    if device.startswith("cuda"):  # one GPU per replica of this host: cuda:LOCAL_RANK
        if replica.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"replica {replica.rank} has LOCAL_RANK {replica.local_rank}, but this host has "
                f"{torch.cuda.device_count()} CUDA device(s); start at most one replica per GPU"
            )
        torch.cuda.set_device(replica.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            dist_backend_for(backend_cfg, device),
            rank=replica.rank,
            world_size=replica.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return replica


def join_poprun_group(backend_cfg: BackendConfig, instance: ReplicaInfo, timeout_s: float) -> None:
    """Check PopRun's replica counts against the config, then join the instances' gloo group.

    popdist's rank and size are the instance index and count; the rendezvous is
    MASTER_ADDR:MASTER_PORT (exported to every instance by the command scripts/poprun.py
    writes).
    """
    import popdist

    total, local = popdist.getNumTotalReplicas(), popdist.getNumLocalReplicas()
    if total != backend_cfg.replicas or local * instance.world_size != total:
        raise ConfigError(
            f"PopRun runs {total} replicas ({local} per instance, {instance.world_size} "
            f"instances) but backend.replicas={backend_cfg.replicas}; pass the same count to "
            "poprun --num-replicas and the config (scripts/poprun.py does)"
        )
    if instance.world_size == 1 or dist.is_initialized():
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(
            f"PopRun with {instance.world_size} instances needs {' and '.join(missing)} in "
            "every instance's environment for the evaluation process group; start it with "
            "the command scripts/poprun.py prints (it exports them)"
        )
    dist.init_process_group(
        "gloo",
        rank=instance.rank,
        world_size=instance.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def prepare_once(
    prepare: Callable[[], Any], replica: ReplicaInfo, marker_dir: Path, timeout_s: float = 7200
) -> Any:
    """``prepare()`` on rank 0 first, then on the others (which then only read its caches).

    The others wait for a marker file that rank 0 writes in ``marker_dir`` (a folder every
    process sees, the data folder) when it is done; its name carries a token rank 0
    broadcasts, so a marker left by an earlier run is never taken for this one. Raises
    :class:`ReplicaWaitError` after ``timeout_s`` seconds without the marker. One process:
    just prepare.
    """
    if replica.world_size == 1:
        return prepare()
    token = [uuid.uuid4().hex if replica.is_main else None]
    dist.broadcast_object_list(token, src=0)
    marker = Path(marker_dir) / f".prepared-{token[0]}"
    if replica.is_main:
        result = prepare()
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    else:
        deadline = time.monotonic() + timeout_s
        while not marker.exists():
            if time.monotonic() > deadline:
                raise ReplicaWaitError(
                    f"rank {replica.rank}: rank 0 did not finish preparing the data within "
                    f"{timeout_s:.0f} s (no {marker}); check rank 0's log, and that "
                    f"{marker_dir} is on a file system every instance shares"
                )
            time.sleep(1.0)
        result = prepare()
    dist.barrier()
    if replica.is_main:
        marker.unlink()
    return result


def shutdown_replica() -> None:
    """Leave the process group, if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()


def under_torchrun() -> bool:
    """True when the launcher already set the rendezvous variables for this process."""
    return all(name in os.environ for name in TORCHRUN_VARS)


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_replicas(fn: Callable[..., Any], replicas: int, *args: Any) -> None:
    """Run ``fn(rank, *args)`` in each of ``replicas`` processes, or here if there is one.

    Under torchrun (or with one replica) this process is the replica and ``fn`` runs in it.
    Otherwise R processes are spawned, each with 1/R of the host's intra-op threads; ``fn``
    and ``args`` must be picklable. If any child
    fails, the others are terminated and the child's error is raised here: a
    :class:`~schnet_ipu.errors.UserError` as itself (one line at the command's boundary),
    anything else as ``torch.multiprocessing.ProcessRaisedException`` with its traceback; a
    crash never leaves the parent waiting on a collective. A Ctrl-C goes to the replicas,
    which save and stop together; then this raises ``SystemExit(130)`` too.
    """
    if under_torchrun():
        fn(int(os.environ["RANK"]), *args)
        return
    if replicas == 1:
        fn(0, *args)
        return
    context = spawn_replicas(fn, replicas, *args)
    # when one replica fails, torch terminates the others and says so in a warning line;
    # the failure itself is what the user needs (a one-line UserError, or the traceback)
    logging.getLogger(mp.spawn.__module__).setLevel(logging.ERROR)
    try:
        with ctrl_c_passed_to(context.pids()):
            while not context.join():
                pass
    except mp.ProcessExitedException:
        if context.user_errors.empty():
            raise
        raise context.user_errors.get() from None
    if not context.interrupted.empty():  # they saved and stopped on a Ctrl-C, and said so
        raise SystemExit(EXIT_INTERRUPTED)


@contextmanager
def ctrl_c_passed_to(pids: list[int]):
    """While the replicas run, a Ctrl-C is theirs to handle (they checkpoint, then stop):
    this launcher passes it on (a ``kill -INT`` of the launcher alone reaches them too; a
    terminal's reached them already, and a second one changes nothing) and keeps waiting."""

    def pass_on() -> None:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)

    with on_ctrl_c(pass_on):
        yield


def spawn_replicas(fn: Callable[..., Any], replicas: int, *args: Any) -> mp.ProcessContext:
    """Start ``fn(rank, *args)`` in ``replicas`` new processes (rendezvous on a free local
    port, 1/R of the host's threads each) and return at once; ``context.join()`` waits and
    raises a child's error."""
    port = free_port()
    spawn = mp.get_context("spawn")
    barrier = spawn.Barrier(replicas)
    user_errors, interrupted = spawn.SimpleQueue(), spawn.SimpleQueue()
    log_level = logging.getLogger().getEffectiveLevel()
    context = mp.spawn(
        _replica_main,
        args=(fn, replicas, port, barrier, user_errors, interrupted, log_level, args),
        nprocs=replicas,
        join=False,
    )
    context.barrier = barrier  # the children find its semaphores by name while it lives
    context.user_errors = user_errors  # a child's UserError, passed whole to the parent
    context.interrupted = interrupted  # the ranks that stopped on a Ctrl-C
    return context


def _replica_main(
    rank: int,
    fn: Callable[..., Any],
    replicas: int,
    port: int,
    barrier,
    user_errors,
    interrupted,
    log_level: int,
    args: tuple[Any, ...],
) -> None:
    global _spawn_barrier
    _spawn_barrier = barrier
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(replicas),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, torch.get_num_threads() // replicas))  # share the host's cores
    configure_logging(log_level if rank == 0 else max(log_level, logging.WARNING))
    faulthandler.enable()  # a crash in native code still prints where each thread was
    # a replica's progress bars are its own: tqdm's default lock is a named semaphore that
    # the exit below would leave for the resource tracker to remove (with a warning)
    tqdm.set_lock(threading.RLock())
    try:
        fn(rank, *args)
    except UserError as err:  # the parent reports it as one line, not a child's traceback
        user_errors.put(err)
        sys.exit(EXIT_USER_ERROR)
    except SystemExit as stop:
        if stop.code != EXIT_INTERRUPTED:
            raise
        # saved and stopped at the host call every replica agreed on: a clean exit, so the
        # parent waits for all instead of terminating the others when the first one leaves
        interrupted.put(rank)
    except KeyboardInterrupt:  # before the training loop took Ctrl-C over: nothing to save
        logging.getLogger("schnet_ipu").warning(INTERRUPTED)
        interrupted.put(rank)
    _leave_finished()


def _leave_finished() -> NoReturn:
    """End a replica whose work is done (or saved and stopped) without the interpreter's
    teardown.

    Everything it wrote is on disk already (records are fsynced, checkpoints renamed into
    place) and the queues above are written synchronously. What the teardown would add is
    the destruction of torch.distributed's native state while another replica may still be
    connected to it: in the test suite a replica sometimes died there with SIGABRT
    ("terminate called without an active exception") after a complete run, which the
    launcher must report as a failed run. So: leave the process group, flush, and exit.
    """
    shutdown_replica()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def trainable_grads(model: nn.Module) -> list[Tensor]:
    """Gradients of every trainable parameter; a missing one becomes zeros.

    Every replica must send the same buffers in the same order, even when a parameter got
    no gradient on one of them this step.
    """
    grads = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    return grads


def shared_memory_reduction(replica: ReplicaInfo) -> SharedMemoryReduction | None:
    """A shared-memory gradient sum for this replica when ``launch_replicas`` spawned it with
    the others on this host; None under torchrun or PopRun (use the process group)."""
    if _spawn_barrier is None or replica.world_size == 1:
        return None
    return SharedMemoryReduction(_spawn_barrier, replica.rank, replica.world_size)


def merged_allreduce(
    grads: list[Tensor], world_size: int, shared: SharedMemoryReduction | None = None
) -> int:
    """Mean the gradients over replicas with ONE reduction of a flat buffer; returns 1.

    The reduction is a gloo/nccl all-reduce, or ``shared`` (same-host CPU replicas).
    Shapes: the buffer is [sum of numels]; each gradient is copied back in place.
    """
    flat = torch.cat([g.reshape(-1) for g in grads])
    if shared is None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    else:
        shared.sum_(flat)
    flat.div_(world_size)
    unflatten_into(grads, flat)
    return 1


def unflatten_into(grads: list[Tensor], flat: Tensor) -> None:
    """Copy the flat buffer [sum of numels] back into ``grads``, in place, in order."""
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def per_parameter_allreduce(grads: list[Tensor], world_size: int) -> int:
    """Mean the gradients over replicas with one all-reduce each; returns the count."""
    for grad in grads:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        grad.div_(world_size)
    return len(grads)


def from_rank0(obj: Any, replica: ReplicaInfo) -> Any:
    """Rank 0's ``obj`` (any picklable object, e.g. a checkpoint) on every rank."""
    if replica.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_parameters(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every replica so all start identical."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)
