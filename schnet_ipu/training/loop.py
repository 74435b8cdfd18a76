"""The training loop: data -> packed batches -> steps -> validation -> checkpoints -> test.

    result = train(load_config("configs/qm9_quickstart.yaml"))

With ``backend.replicas > 1`` the loop runs in R processes (or under torchrun); rank 0
writes the logs and checkpoints. Re-running in the same run directory resumes from the
last checkpoint and ends with the same weights as an uninterrupted run.

The components come from :mod:`schnet_ipu.training.setup`, the loss and metrics from the task
(:mod:`schnet_ipu.task`); every checkpoint is a self-contained model file
(:mod:`schnet_ipu.inference.model_file`). The divergence guard
(:mod:`schnet_ipu.training.guard`, on unless
``optim.spike_guard=false``) rolls a blow-up of the loss back, and a run whose test MAE does
not beat the dressed-atom baseline ends with an error (``optim.beat_baseline``). What the
run writes in its folder besides checkpoints (the records, the plot) is
:mod:`schnet_ipu.training.records`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from tqdm import tqdm

from schnet_ipu.backends import Backend, select_device
from schnet_ipu.backends.distributed import (
    ReplicaInfo,
    broadcast_parameters,
    init_replica,
    launch_replicas,
    prepare_once,
    processes_for,
    replicas_in_call,
    shutdown_replica,
)
from schnet_ipu.checkpoint import load_checkpoint, load_model_state, save_checkpoint
from schnet_ipu.config import Config, global_batch
from schnet_ipu.errors import EXIT_INTERRUPTED, TrainingError, on_ctrl_c
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.task import Task
from schnet_ipu.training.budget import Budget, WeightAverage
from schnet_ipu.training.data import make_loader, prepare_data
from schnet_ipu.training.evaluation import evaluate
from schnet_ipu.training.guard import Spike, SpikeGuard, Trainee, check_beats_baseline
from schnet_ipu.training.lock import launcher_rank
from schnet_ipu.training.log import RunLog, read_records
from schnet_ipu.training.records import open_run_dir, write_epoch, write_final, write_seen
from schnet_ipu.training.setup import make_scheduler, make_trainer, model_spec
from schnet_ipu.training.state import Progress, RunState, read_resume

log = logging.getLogger("schnet_ipu")


def train(cfg: Config, fresh: bool = False) -> dict:
    """Train as configured (spawning replicas when asked) and return the final record.
    ``fresh`` discards an existing run directory, once the data has been checked. The run
    folder's lock (:mod:`schnet_ipu.training.lock`) is the caller's: ``train.py`` takes it before
    its heavy imports, so a second run is refused at once; spawned replicas run under it.
    Under torchrun or PopRun only rank 0 returns the final record; the other ranks ``{}``."""
    run_dir = Path(cfg.logging.run_dir)
    device = select_device(cfg.backend.device)
    launch_replicas(_run_replica, processes_for(cfg.backend, device), cfg, fresh)
    if launcher_rank() != 0:  # the records are rank 0's, which may not have written them yet
        return {}
    finals = read_records(run_dir / "metrics.jsonl", "final")
    final = finals[-1] if finals else {}
    if final and cfg.optim.beat_baseline:
        check_beats_baseline(final, run_dir)
    return final


def _run_replica(rank: int, cfg: Config, fresh: bool) -> None:
    run(cfg, fresh)


def run(cfg: Config, fresh: bool = False) -> None:
    """One replica's whole run. Rank 0 logs and writes checkpoints; every rank steps."""
    wall_start = time.perf_counter()
    device = select_device(cfg.backend.device)
    replica = init_replica(cfg.backend, device)
    run_dir = Path(cfg.logging.run_dir)
    last_path, best_path = run_dir / "checkpoints/last.pt", run_dir / "checkpoints/best.pt"
    resume = read_resume(cfg, last_path, fresh, replica)
    if cfg.backend.threads:
        torch.set_num_threads(cfg.backend.threads)
    np.random.seed(cfg.seed)
    # rank 0 imports and caches the data; the others wait for it, then read its caches
    data = prepare_once(lambda: prepare_data(cfg), replica, Path(cfg.data.path).parent)
    model, optimizer, backend, task = make_trainer(cfg, data, replica, device)
    # PopTorch (and its emulator) replicates inside one process, which feeds its replicas
    in_call = replicas_in_call(cfg.backend, device, replica)
    pin, rank, world = device.startswith("cuda"), replica.rank, replica.world_size
    train_loader = make_loader(cfg, data, "train", rank, world, pin, in_call, device)
    val_loader = make_loader(cfg, data, "val", rank, world, pin, 1, device)
    spent = float(resume.get("budget_seconds", 0)) if resume else 0.0
    budget = Budget(cfg.optim.max_minutes, spent, replica.world_size, backend.device)
    steps = len(train_loader) * cfg.backend.device_iterations
    scheduler = make_scheduler(cfg, optimizer, steps, budget)
    if replica.is_main:
        per_pack = len(data.split["train"]) / data.train_plan.num_packs
        packs = cfg.backend.replicas * cfg.backend.gradient_accumulation
        packs *= cfg.packing.packs_per_batch
        log.info(
            "%s; about %.0f molecules per step, %d steps per epoch",
            global_batch(cfg), per_pack * packs, steps,
        )  # fmt: skip
    average = WeightAverage(model, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
    spec = model_spec(cfg, data, model, task).to_dict()
    guard = None
    if cfg.optim.spike_guard:
        trainee = Trainee(model, optimizer, scheduler, average, backend)
        trivial = 1 + cfg.optim.forces_weight + cfg.optim.stress_weight  # standardised terms
        where = f" (replica {rank} of {world})" if world > 1 else ""
        guard = SpikeGuard(cfg.optim, trainee, best_path, trivial, where)
    state = RunState(cfg, model, optimizer, scheduler, spec, budget, average, guard)
    progress = Progress()
    if resume is not None:
        progress = state.restore(resume, last_path)
        backend.after_host_weight_load()
        log.info("resuming %s at epoch %d, host call %d", run_dir, progress.epoch, progress.call)
    if guard is not None:
        guard.begin(progress.epoch * steps + progress.call * cfg.backend.device_iterations)
    runlog = open_run_dir(cfg, run_dir, fresh, progress if resume else None, data.timings, replica)

    def checkpoint(path: Path) -> None:
        if runlog is not None:  # rank 0 writes
            save_checkpoint(path, state.checkpoint(progress, resumable=path == last_path))

    def stopped(when: str) -> NoReturn:
        if runlog is not None:  # one line, from rank 0, which saved
            log.warning("interrupted: saved %s %s; re-run to resume", last_path, when)
            runlog.close(exit_code=EXIT_INTERRUPTED)
        raise SystemExit(EXIT_INTERRUPTED)

    stop = StopFlag(replica.world_size)
    parts = EpochParts(
        cfg, backend, task, scheduler, train_loader, replica, stop, budget, runlog, average, guard
    )
    # Ctrl-C anywhere in an epoch (training, validation, checkpoints) is a stop request:
    # inside the training loop it stops at the next host call, later at the epoch's end
    with on_ctrl_c(stop.request):
        # an epoch is validated at its end, or (with a budget) in chunks of at most 10% of it
        while progress.epoch < cfg.optim.epochs and not budget.exhausted():
            epoch, first_call = progress.epoch, progress.call
            stats = train_epoch(parts, epoch, first_call, until=budget.next_validation())
            if stop.requested:
                progress.epoch, progress.call = epoch, stats["calls"]
                checkpoint(last_path)
                stopped(f"at epoch {epoch}")
            with averaged(average, backend):
                val = evaluate(task, backend, val_loader, "val", replica.world_size)
            budget.pause()  # the count from here to the next chunk: checkpoints record it
            stop.agree(budget)  # a Ctrl-C during validation, too, stops every replica
            calls = stats["calls"]
            spike = None
            if guard is not None:  # every replica has the same validation metrics
                step = epoch * steps + calls * cfg.backend.device_iterations
                spike = guard.check_validation(val["loss"], step)
            if spike is not None:
                roll_back(guard, spike, runlog, epoch, calls)
            elif cfg.optim.schedule == "plateau":
                scheduler.step(val["mae"])
                backend.optimizer_changed()
            improved = spike is None and val["mae"] < progress.best_mae
            best = progress.best_mae if spike is not None else min(progress.best_mae, val["mae"])
            whole = calls == len(train_loader)  # else the budget ended the epoch or the chunk
            progress = Progress(epoch + 1, 0, best) if whole else Progress(epoch, calls, best)
            if runlog is not None:
                stats.update(
                    budget_seconds=budget.seconds,
                    epoch_fraction=(calls - first_call) / len(train_loader),
                )
                write_epoch(runlog, epoch, stats, val, optimizer, task, data.unit)
            # the record is on disk before a checkpoint claims the epoch, and best.pt before
            # last.pt, so a crash between any two writes loses nothing on resume
            if improved:
                checkpoint(best_path)
            checkpoint(last_path)
            if stop.requested:
                stopped(f"after epoch {epoch}")

    if math.isinf(progress.best_mae):  # the divergence guard refused every validation
        raise TrainingError(
            f"no validation of {run_dir} passed the divergence guard, so there is no best.pt "
            "to test; lower optim.lr"
        )
    if runlog is not None:  # rank 0 wrote best.pt; the others get its weights through the group
        load_model_state(model, load_checkpoint(best_path)["model"])
    if replica.world_size > 1:
        broadcast_parameters(model)
    backend.after_host_weight_load()
    test = evaluate(task, backend, make_loader(cfg, data, "test", rank, world), "test", world)
    if runlog is not None:
        extra = {"best_val_mae": progress.best_mae, "budget_seconds": budget.seconds}
        extra.update(recompilations=backend.recompilations)
        extra.update(cuda_graph_captures=backend.graph_captures)  # > 1: a re-capture
        write_final(runlog, cfg, data, task, test, extra, time.perf_counter() - wall_start)
    shutdown_replica()


@dataclass
class EpochParts:
    """What every epoch of one replica's run trains with, built once by :func:`run`."""

    cfg: Config
    backend: Backend
    task: Task
    scheduler: Any  # torch's LR schedulers share no public base class
    loader: PackedLoader  # the training split's
    replica: ReplicaInfo
    stop: StopFlag
    budget: Budget
    runlog: RunLog | None  # rank 0's; None on the other replicas
    average: WeightAverage | None
    guard: SpikeGuard | None


def train_epoch(parts: EpochParts, epoch: int, first_call: int, until: float = math.inf) -> dict:
    """One epoch of host calls from ``first_call`` until the epoch ends, the budget is
    spent, its clock reaches ``until`` seconds (time to validate) or a stop is requested;
    returns its mean (finite) loss, throughput and time split. The weight average follows
    every call. Replicas agree on the budget's clock and on a stop request every
    ``logging.log_every`` calls, so all stop at the same call.

    The step losses stay on the device: they are read (one synchronisation) every
    ``logging.log_every`` host calls and at the end of the epoch, and checked then: by the
    guard (their mean, the largest over replicas, agreed with the clock), which may roll
    back; without one a non-finite loss stops the run.
    """
    cfg, backend, task, scheduler, loader = (
        parts.cfg, parts.backend, parts.task, parts.scheduler, parts.loader,
    )  # fmt: skip
    replica, stop, budget, runlog = parts.replica, parts.stop, parts.budget, parts.runlog
    average, guard = parts.average, parts.guard
    steps_per_call = cfg.backend.device_iterations

    def read_and_check(step: int) -> list[float]:
        read = read_losses(pending, epoch, step, refuse_non_finite=guard is None)
        shared = stop.agree(budget, [mean_or_inf(read), mean_or_inf(read[:1])] if guard else [])
        spike = None if guard is None else guard.check_read(*shared, step)
        if spike is not None:
            roll_back(guard, spike, runlog, epoch, calls)
        return read

    losses, molecules = [], 0
    pending: list = []  # losses of the steps since the last read, on the device
    seen: list | None = [] if cfg.logging.seen_molecules else None  # molecule indices
    data_seconds = step_seconds = 0.0
    calls = first_call
    bar = tqdm(
        total=len(loader),
        initial=first_call,
        desc=f"epoch {epoch}",
        disable=runlog is None or not cfg.logging.progress,
        leave=False,
    )
    batches = iter(loader.epoch(epoch, first_call))
    task.reset()
    budget.start()
    epoch_start = time.perf_counter()
    while not stop.requested and not budget.exhausted() and budget.seconds < until:
        tick = time.perf_counter()
        micro_batches = next(batches, None)
        if micro_batches is None:
            break
        if seen is not None:
            seen += [b.molecule_index[b.graph_mask] for b in micro_batches]
        tock = time.perf_counter()
        records = backend.train_call(micro_batches)
        done = time.perf_counter()
        data_seconds += tock - tick
        step_seconds += done - tock
        for record in records:
            if cfg.optim.schedule != "plateau":
                scheduler.step()
            pending.append(record["loss"])
            molecules += record["molecules"]
        backend.optimizer_changed()  # the device gets the new lr, once per host call
        if average is not None:
            average.update()
        calls += 1
        step = (epoch * len(loader) + calls) * steps_per_call  # steps done so far
        bar.update(1)
        if calls % cfg.logging.log_every:
            continue
        losses += read_and_check(step)
        rate = molecules / max(time.perf_counter() - epoch_start, 1e-9)
        shown = {k: f"{v:.4f}" for k, v in task.training_metrics().items()}
        bar.set_postfix(loss=f"{losses[-1]:.4f}", mol_s=f"{rate * replica.world_size:.0f}", **shown)
        if runlog is not None:
            runlog.write(
                "step",
                epoch=epoch,
                call=calls,
                step=step,
                loss=losses[-1],
                lr=float(scheduler.optimizer.param_groups[0]["lr"]),
                molecules_per_s=rate * replica.world_size,
                data_seconds=data_seconds,
                step_seconds=step_seconds,
                replicas=cfg.backend.replicas,
                collectives_per_step=records[-1]["collectives"],
            )
    end = (epoch * len(loader) + calls) * steps_per_call
    if pending and guard is not None and not stop.requested:  # every replica has some
        losses += read_and_check(end)
    losses += read_losses(pending, epoch, end, refuse_non_finite=guard is None)
    bar.close()
    if seen is not None:
        write_seen(Path(cfg.logging.run_dir), epoch, first_call, replica.rank, seen)
    seconds = time.perf_counter() - epoch_start
    finite = [loss for loss in losses if math.isfinite(loss)]
    return {
        "loss": float(np.mean(finite)) if finite else math.nan,
        "molecules_per_s": molecules * replica.world_size / max(seconds, 1e-9),
        "data_seconds": data_seconds,
        "step_seconds": step_seconds,
        "seconds": seconds,
        "calls": calls,
    }


def read_losses(
    pending: list, epoch: int, end_step: int, refuse_non_finite: bool = True
) -> list[float]:
    """Read the step losses (device tensors or floats) of the ``len(pending)`` steps before
    ``end_step`` at once, empty ``pending``, and (``refuse_non_finite``) raise on the first
    non-finite one."""
    if not pending:
        return []
    values = torch.stack([torch.as_tensor(loss) for loss in pending]).tolist()
    first = end_step - len(values)
    pending.clear()
    for i, value in enumerate(values if refuse_non_finite else []):
        if not math.isfinite(value):
            raise TrainingError(
                f"non-finite loss ({value}) at epoch {epoch}, step {first + i} (read after "
                f"steps {first}-{end_step - 1}); the last checkpoint is kept. Lower optim.lr "
                "or set optim.grad_clip."
            )
    return values


def mean_or_inf(losses: list[float]) -> float:
    """The mean of a read's step losses; inf when one is not finite (a spike to any guard)."""
    return float(np.mean(losses)) if all(map(math.isfinite, losses)) else math.inf


def roll_back(
    guard: SpikeGuard, spike: Spike, runlog: RunLog | None, epoch: int, call: int
) -> None:
    """The guard's rollback, and its record in metrics.jsonl."""
    record = guard.roll_back(spike)
    if runlog is not None:
        runlog.write("rollback", epoch=epoch, call=call, **record)


@contextmanager
def averaged(average: WeightAverage | None, backend: Backend):
    """The averaged weights in the model (and on the device) inside the block."""
    if average is None:
        yield
        return
    with average.swapped_in():
        backend.after_host_weight_load()
        yield
    backend.after_host_weight_load()


@dataclass
class StopFlag:
    """Ctrl-C as a stop request, honoured between host calls so the checkpoint is exact.
    ``seen``: this process got one (:meth:`request` is the run's Ctrl-C handler). Replicas
    see a Ctrl-C at different host calls (or only one of them gets a ``kill -INT``) but must
    stop at the same one, so with several a request counts once :meth:`agree` found it on
    any of them; alone, at once."""

    world_size: int = 1
    seen: bool = False
    agreed: bool = False

    def request(self) -> None:
        self.seen = True

    @property
    def requested(self) -> bool:
        return self.seen if self.world_size == 1 else self.agreed

    def agree(self, budget: Budget, shared: Sequence[float] = ()) -> list[float]:
        """The budget's agreement (every replica at the same point), carrying this flag
        beside ``shared``, whose maxima over the replicas it returns."""
        seen_anywhere, *maxima = budget.agree([float(self.seen), *shared])
        self.agreed = seen_anywhere > 0
        return maxima
