"""The training loop: data -> packed batches -> steps -> validation -> checkpoints -> test.

    result = train(load_config("configs/qm9_quickstart.yaml"))

With ``backend.replicas > 1`` the loop runs in R processes (or under torchrun); rank 0
writes the logs and checkpoints. Re-running in the same run directory resumes from the
last checkpoint and ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import csv
import dataclasses
import errno
import functools
import logging
import math
import os
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from schnet_ipu.backends import TorchBackend, make_backend, select_device
from schnet_ipu.backends.distributed import (
    ReplicaInfo,
    broadcast_parameters,
    from_rank0,
    init_replica,
    launch_replicas,
    prepare_once,
    processes_for,
    replicas_in_call,
    shutdown_replica,
)
from schnet_ipu.checkpoint import (
    check_same_run,
    load_checkpoint,
    restoring,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from schnet_ipu.config import Config, ConfigError, config_from_dict
from schnet_ipu.errors import CheckpointError, UserError
from schnet_ipu.forces import (
    EnergyForceLoss,
    error_sums,
    evaluate_forces,
    force_predictions,
    force_rms,
    metrics_from_sums,
    trivial_baselines,
)
from schnet_ipu.loader import PackedLoader
from schnet_ipu.model import SchNet, masked_mse
from schnet_ipu.pipeline import PreparedData, make_loader, prepare_data
from schnet_ipu.plots import evaluation_plots
from schnet_ipu.runlock import hold_run_lock, launcher_rank
from schnet_ipu.runlog import RunLog, plot_learning_curve, read_records, truncate_after

log = logging.getLogger("schnet_ipu")
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])  # (2, 13)


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (a non-finite loss, say); the last good checkpoint is kept."""


@dataclass
class Metrics:
    """Errors over the real molecules of one split, in the target's unit."""

    mae: float
    rmse: float
    loss: float  # mean standardised squared error, comparable with the training loss
    molecules: int


def train(cfg: Config, fresh: bool = False) -> dict:
    """Train as configured (spawning replicas when asked) and return the final record.
    ``fresh`` discards an existing run directory, once the data has been checked."""
    run_dir = Path(cfg.logging.run_dir)
    device = select_device(cfg.backend.device)
    with hold_run_lock(run_dir, holder=launcher_rank() == 0):  # one writer per run folder
        launch_replicas(_run_replica, processes_for(cfg.backend, device), cfg, fresh)
        finals = read_records(run_dir / "metrics.jsonl", "final")
    return finals[-1] if finals else {}


def _run_replica(rank: int, cfg: Config, fresh: bool) -> None:
    run(cfg, fresh)


def run(cfg: Config, fresh: bool = False) -> None:
    """One replica's whole run. Rank 0 logs; every rank steps."""
    wall_start = time.perf_counter()
    device = select_device(cfg.backend.device)
    replica = init_replica(cfg.backend, device)
    main = replica.is_main
    run_dir = Path(cfg.logging.run_dir)
    last_path, best_path = run_dir / "checkpoints/last.pt", run_dir / "checkpoints/best.pt"
    resume = load_checkpoint(last_path) if main and last_path.exists() and not fresh else None
    resume = from_rank0(resume, replica)  # instances on other hosts may not see the run dir
    if resume is not None:
        check_same_run(resume["config"], cfg.to_dict(), run_dir)

    if cfg.backend.threads:
        torch.set_num_threads(cfg.backend.threads)
    np.random.seed(cfg.seed)
    # rank 0 imports and caches the data; the others wait for it, then read its caches
    data = prepare_once(lambda: prepare_data(cfg), replica, Path(cfg.data.path).parent)
    model, optimizer, backend = make_trainer(cfg, data, replica, device)
    pin = device.startswith("cuda")
    # PopTorch (and its emulator) replicates inside one process, which feeds its replicas
    in_call = replicas_in_call(cfg.backend, device, replica)
    train_loader = make_loader(
        cfg, data, "train", replica.rank, replica.world_size, pin, in_call, device
    )
    val_loader = make_loader(cfg, data, "val", replica.rank, replica.world_size, pin, 1, device)
    steps_per_epoch = len(train_loader) * cfg.backend.device_iterations
    scheduler = make_scheduler(cfg, optimizer, steps_per_epoch)

    start_epoch, start_call, best_mae = 0, 0, math.inf
    if resume is not None:
        with restoring(last_path):
            model.load_state_dict(resume["model"])
            optimizer.load_state_dict(resume["optimizer"])
            scheduler.load_state_dict(resume["scheduler"])
            set_rng_state(resume["rng"])
            start_epoch, start_call = int(resume["epoch"]), int(resume["call"])
            best_mae = float(resume["best_mae"])
        backend.after_host_weight_load()
        log.info("resuming %s at epoch %d, host call %d", run_dir, start_epoch, start_call)
    if main:  # bad data or a bad checkpoint stopped the run above, before any write here
        if fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        if resume is None:  # records of a run that crashed before its first checkpoint
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        else:  # records after the checkpoint will be written again; a torn line goes
            truncate_after(run_dir / "metrics.jsonl", start_epoch, start_call)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    runlog = RunLog(run_dir, cfg) if main else None
    if runlog is not None and resume is None:
        runlog.write("stage", **{f"{k}_seconds": v for k, v in data.timings.items()})

    def checkpoint(path: Path, epoch: int, call: int) -> None:
        if not main:
            return
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise TrainingError(f"non-finite weights at epoch {epoch}; {path} was not written")
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "epoch": epoch,
            "call": call,
            "best_mae": best_mae,
            "config": cfg.to_dict(),
        }
        save_checkpoint(path, state)

    stop = StopFlag()
    # Ctrl-C anywhere in an epoch (training, validation, checkpoints) is a stop request:
    # inside the training loop it stops at the next host call, later at the epoch's end
    with ctrl_c_requests_stop(stop):
        for epoch in range(start_epoch, cfg.optim.epochs):
            first_call = start_call if epoch == start_epoch else 0
            train_stats = train_epoch(
                cfg, backend, scheduler, train_loader, epoch, first_call, runlog, replica, stop
            )
            if stop.requested:
                checkpoint(last_path, epoch, train_stats["calls"])
                log.info("interrupted: saved %s at epoch %d; re-run to resume", last_path, epoch)
                raise SystemExit(130)
            val = evaluate(backend, val_loader, data, "val", replica)
            if cfg.optim.schedule == "plateau":
                scheduler.step(val.mae)
                backend.optimizer_changed()
            val_forces = (
                evaluate_forces(backend, val_loader, replica) if data.store.has_forces else {}
            )
            improved = val.mae < best_mae
            best_mae = min(best_mae, val.mae)
            if runlog is not None:
                runlog.write(
                    "epoch",
                    epoch=epoch,
                    train_loss=train_stats["loss"],
                    val_loss=val.loss,
                    val_mae=val.mae,
                    val_rmse=val.rmse,
                    lr=float(optimizer.param_groups[0]["lr"]),
                    molecules_per_s=train_stats["molecules_per_s"],
                    data_seconds=train_stats["data_seconds"],
                    step_seconds=train_stats["step_seconds"],
                    epoch_seconds=train_stats["seconds"],
                    data_wait_fraction=train_stats["data_seconds"]
                    / max(train_stats["seconds"], 1e-9),
                    unit=data.unit,
                    **{f"val_{k}": v for k, v in val_forces.items()},
                    **_loss_progress(backend),
                )
                log.info(
                    "epoch %d: train loss %.4f, val MAE %.4f %s, %.0f molecules/s",
                    epoch,
                    train_stats["loss"],
                    val.mae,
                    data.unit,
                    train_stats["molecules_per_s"],
                )
            # the record is on disk before a checkpoint claims the epoch, and best.pt before
            # last.pt, so a crash between any two writes loses nothing on resume
            if improved:
                checkpoint(best_path, epoch + 1, 0)
            checkpoint(last_path, epoch + 1, 0)
            if stop.requested:
                log.info("interrupted: saved %s after epoch %d; re-run to resume", last_path, epoch)
                raise SystemExit(130)

    if main:  # rank 0 wrote best.pt; the others get its weights through the group
        model.load_state_dict(load_checkpoint(best_path)["model"])
    if replica.world_size > 1:
        broadcast_parameters(model)
    backend.after_host_weight_load()
    test_loader = make_loader(cfg, data, "test", replica.rank, replica.world_size)
    test = evaluate(backend, test_loader, data, "test", replica)
    baseline_mae = float(np.abs(data.baseline_errors("test")).mean())
    test_forces = {}
    if data.store.has_forces:
        test_forces = {
            f"test_{k}": v for k, v in evaluate_forces(backend, test_loader, replica).items()
        }
        test_forces.update(
            trivial_baselines(data.store, data.targets, data.split["train"], data.split["test"])
        )
    if runlog is not None:
        runlog.write(
            "final",
            **test_forces,
            test_mae=test.mae,
            test_rmse=test.rmse,
            baseline_test_mae=baseline_mae,
            best_val_mae=best_mae,
            unit=data.unit,
            test_molecules=test.molecules,
            recompilations=backend.recompilations,
            cuda_graph_captures=getattr(backend, "graph_captures", 0),  # > 1: a re-capture
            wall_seconds=time.perf_counter() - wall_start,
        )
        log.info(
            "test MAE %.4f %s (RMSE %.4f); dressed-atom baseline MAE %.4f %s",
            test.mae,
            data.unit,
            test.rmse,
            baseline_mae,
            data.unit,
        )
        if cfg.logging.plot:
            plot_learning_curve(
                run_dir / "metrics.jsonl", run_dir / "learning_curve.png", data.unit
            )
        runlog.close()
    shutdown_replica()


def train_epoch(
    cfg: Config,
    backend,
    scheduler,
    loader: PackedLoader,
    epoch: int,
    first_call: int,
    runlog: RunLog | None,
    replica: ReplicaInfo,
    stop: StopFlag,
) -> dict:
    """One epoch of host calls; returns its mean loss, throughput and time split.

    The step losses stay on the device: they are read (one synchronisation) every
    ``logging.log_every`` host calls and at the end of the epoch, and checked then.
    """
    steps_per_call = cfg.backend.device_iterations
    losses, molecules = [], 0
    pending: list = []  # losses of the steps since the last read, on the device
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
    force_loss = getattr(backend, "loss_fn", None)
    if isinstance(force_loss, EnergyForceLoss):
        force_loss.reset()
    epoch_start = time.perf_counter()
    while not stop.requested:
        tick = time.perf_counter()
        micro_batches = next(batches, None)
        if micro_batches is None:
            break
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
        calls += 1
        step = (epoch * len(loader) + calls) * steps_per_call  # steps done so far
        bar.update(1)
        if calls % cfg.logging.log_every:
            continue
        losses += read_losses(pending, epoch, step)
        rate = molecules / max(time.perf_counter() - epoch_start, 1e-9)
        bar.set_postfix(
            loss=f"{losses[-1]:.4f}",
            mol_s=f"{rate * replica.world_size:.0f}",
            **(force_loss.progress() if isinstance(force_loss, EnergyForceLoss) else {}),
        )
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
    losses += read_losses(pending, epoch, (epoch * len(loader) + calls) * steps_per_call)
    bar.close()
    seconds = time.perf_counter() - epoch_start
    return {
        "loss": float(np.mean(losses)) if losses else math.nan,
        "molecules_per_s": molecules * replica.world_size / max(seconds, 1e-9),
        "data_seconds": data_seconds,
        "step_seconds": step_seconds,
        "seconds": seconds,
        "calls": calls,
    }


def read_losses(pending: list, epoch: int, end_step: int) -> list[float]:
    """Read the step losses (device tensors or floats) of the ``len(pending)`` steps before
    ``end_step`` at once, empty ``pending``, and raise on the first non-finite one."""
    if not pending:
        return []
    values = torch.stack([torch.as_tensor(loss) for loss in pending]).tolist()
    first = end_step - len(values)
    pending.clear()
    for i, value in enumerate(values):
        if not math.isfinite(value):
            raise TrainingError(
                f"non-finite loss ({value}) at epoch {epoch}, step {first + i} (read after "
                f"steps {first}-{end_step - 1}); the last checkpoint is kept. Lower optim.lr "
                "or set optim.grad_clip."
            )
    return values


def evaluate(
    backend, loader: PackedLoader, data: PreparedData, split: str, replica: ReplicaInfo
) -> Metrics:
    """MAE/RMSE over the real molecules of a split (each replica its share, then summed)."""
    sums = torch.zeros(4, dtype=torch.float64)  # |error|, error^2, standardised error^2, count
    scale = data.residual_std
    for _, prediction, target in predictions(backend, loader):
        error = prediction - target
        sums += torch.tensor(
            [np.abs(error).sum(), (error**2).sum(), ((error / scale) ** 2).sum(), len(error)]
        )
    if replica.world_size > 1:  # on the replica's device: NCCL reduces CUDA tensors only
        sums = sums.to(getattr(backend, "device", "cpu"))
        dist.all_reduce(sums)
    abs_sum, sq_sum, loss_sum, count = sums.tolist()
    if count == 0:
        raise ConfigError(f"the {split} split has no molecules to evaluate")
    return Metrics(abs_sum / count, math.sqrt(sq_sum / count), loss_sum / count, int(count))


def predictions(backend, loader: PackedLoader):
    """Yields (store indices, predictions, targets) per batch, real molecules only, float64."""
    for call in loader.epoch(0):
        for batch in call:
            mask = batch.graph_mask.cpu().numpy()  # (device-resident batches live on the GPU)
            prediction = backend.predict(batch).double().cpu().numpy()
            yield (
                batch.molecule_index.cpu().numpy()[mask],
                prediction[mask],
                batch.y.double().cpu().numpy()[mask],
            )


def make_trainer(
    cfg: Config, data: PreparedData, replica: ReplicaInfo | None = None, device: str = "cpu"
) -> tuple[SchNet, torch.optim.Optimizer, object]:
    """Model (initialised from ``cfg.seed``), optimiser and backend with the standardised
    loss: the trainer's own setup, which the benchmarks reuse."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, data)
    optimizer = make_optimizer(cfg, model, device)
    loss_fn = functools.partial(standardised_loss, scale=data.residual_std)
    if cfg.optim.forces_weight > 0:
        if not data.store.has_forces:
            raise ConfigError(f"optim.forces_weight > 0, but {data.store.path} holds no forces")
        scale = force_rms(data.store, data.split["train"])
        loss_fn = EnergyForceLoss(data.residual_std, scale, cfg.optim.forces_weight)
    backend = make_backend(
        cfg.backend,
        model,
        optimizer,
        loss_fn,
        cfg.optim.grad_clip,
        replica,
        device,
        seed=cfg.seed,
        prefetch=cfg.loader.prefetch,
        cache_dir=cfg.backend.executable_cache or str(Path(cfg.logging.run_dir) / "executables"),
    )
    if cfg.optim.forces_weight > 0 and not isinstance(backend, TorchBackend):
        raise ConfigError("optim.forces_weight > 0 needs a cpu or cuda backend (no PopTorch)")
    return model, optimizer, backend


def _loss_progress(backend) -> dict[str, float]:
    """The force loss's training energy MAE per atom and force MAE of the epoch, if any."""
    loss_fn = getattr(backend, "loss_fn", None)
    if not isinstance(loss_fn, EnergyForceLoss):
        return {}
    return {f"train_{k}": v for k, v in loss_fn.metrics().items()}


def build_model(cfg: Config, data: PreparedData) -> SchNet:
    """SchNet whose atom reference is the dressed-atom fit, scaled to the residual spread;
    the ipu op flavour on ``ipu`` and ``ipu-model`` devices."""
    atom_scale = data.residual_std / math.sqrt(data.mean_atoms())
    model_cfg = cfg.model
    on_ipu = cfg.backend.device in ("ipu", "ipu-model")
    if on_ipu or (cfg.backend.device == "auto" and select_device("auto") == "ipu"):
        # the IPU (also when auto finds one) and its emulator: mapped ops only
        model_cfg = dataclasses.replace(model_cfg, ops="ipu")
    return SchNet.from_config(
        model_cfg,
        max_nodes_per_pack=data.train_plan.max_nodes,
        mean=0.0,
        std=atom_scale,
        atomref=torch.tensor(data.dressed_atoms, dtype=torch.float32),
    )


def make_optimizer(cfg: Config, model: torch.nn.Module, device: str) -> torch.optim.Adam:
    """Adam, as in the paper; on CPU and CUDA its fused kernel (the same update in one pass
    over the parameters, 5x faster than the per-tensor loop for SchNet on a CPU; torch
    before 2.4, the Poplar SDK's 2.0.1, has no fused CPU kernel and raises if asked); on the
    IPU PopTorch's, which keeps its state on the device and clips there."""
    if device in ("ipu", "ipu-model"):
        from schnet_ipu.backends.poptorch_backend import make_optimizer as make_ipu_optimizer

        oc = cfg.optim
        return make_ipu_optimizer(model.parameters(), oc.lr, oc.weight_decay, oc.grad_clip)
    return torch.optim.Adam(
        model.parameters(),
        lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        fused=device == "cuda" or (device == "cpu" and TORCH_VERSION >= (2, 4)),
    )


def standardised_loss(model: torch.nn.Module, batch, scale: float) -> torch.Tensor:
    """Mean over real molecules of ((prediction - target) / scale)^2."""
    return masked_mse(model(batch), batch.y, batch.graph_mask, scale)


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    """plateau: decay on validation MAE per epoch; cosine: warmup then cosine per step."""
    oc = cfg.optim
    if oc.schedule == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, factor=oc.plateau_factor, patience=oc.plateau_patience, min_lr=oc.min_lr
        )
    total = max(oc.epochs * steps_per_epoch, 1)
    floor = min(oc.min_lr / oc.lr, 1.0)

    def factor(step: int) -> float:
        if oc.schedule == "constant":
            return 1.0
        if step < oc.warmup_steps:
            return (step + 1) / oc.warmup_steps
        progress = min((step - oc.warmup_steps) / max(total - oc.warmup_steps, 1), 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class StopFlag:
    requested: bool = False


@contextmanager
def ctrl_c_requests_stop(stop: StopFlag):
    """Turn Ctrl-C into a request honoured between host calls, so the checkpoint is exact."""

    def handle(signum, frame) -> None:
        stop.requested = True

    try:
        previous = signal.signal(signal.SIGINT, handle)
    except ValueError:  # not the main thread: leave Ctrl-C as it is
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


# --- evaluate and predict a finished run ----------------------------------------------------


def load_run(run_dir: Path, checkpoint: str = "best") -> tuple[Config, PreparedData, object]:
    """Config, data and a single-process backend holding a run's checkpoint."""
    config_path = run_dir / "config.yaml"
    ckpt_path = run_dir / f"checkpoints/{checkpoint}.pt"
    if not ckpt_path.exists():
        raise ConfigError(f"{run_dir} has no {checkpoint} checkpoint ({ckpt_path}); train first")
    state = load_checkpoint(ckpt_path)
    try:
        cfg = config_from_dict(state["config"])
    except ConfigError as err:
        raise CheckpointError(f"{ckpt_path}: the config it holds is not valid here: {err}") from err
    if not config_path.exists():
        log.warning("%s is missing; using the config stored in the checkpoint", config_path)
    cfg.backend.replicas = 1
    cfg.loader.workers = 0
    data = prepare_data(cfg)
    model = build_model(cfg, data)
    with restoring(ckpt_path):
        model.load_state_dict(state["model"])
    device = select_device(cfg.backend.device)
    optimizer = make_optimizer(cfg, model, device)
    backend = make_backend(cfg.backend, model, optimizer, None, 0.0, ReplicaInfo(), device)
    return cfg, data, backend


def evaluate_run(run_dir: Path, split: str = "test") -> dict:
    """Errors of a run's best weights on a split, and its parity plot and error histogram."""
    cfg, data, backend = load_run(run_dir)
    metrics = evaluate(backend, make_loader(cfg, data, split), data, split, ReplicaInfo())
    baseline = float(np.abs(data.baseline_errors(split)).mean())
    result = {
        "split": split,
        "mae": metrics.mae,
        "rmse": metrics.rmse,
        "molecules": metrics.molecules,
        "baseline_mae": baseline,
        "unit": data.unit,
    }
    loader = make_loader(cfg, data, split)
    if data.store.has_forces:  # energies and forces in one pass; forces by autograd
        parts = list(force_predictions(backend.model, loader, backend.device))
        result.update(metrics_from_sums(error_sums(parts)))
        result.update(
            trivial_baselines(data.store, data.targets, data.split["train"], data.split[split])
        )
        energy = tuple(
            np.concatenate([getattr(p, k) for p in parts]) for k in ("energy", "energy_true")
        )
        forces = tuple(
            np.concatenate([getattr(p, k) for p in parts]) for k in ("forces", "forces_true")
        )
    else:
        rows = list(predictions(backend, loader))
        energy = tuple(np.concatenate([r[k] for r in rows]) for k in (1, 2))
        forces = None
    pictures = evaluation_plots(run_dir, split, energy, data.unit, forces, data.store.forces_unit)
    result["pictures"] = [str(p) for p in pictures]
    return result


def predict_run(run_dir: Path, split: str, out: Path) -> int:
    """Write index, target, prediction, error per molecule (the store's own target) to CSV."""
    if not out.parent.is_dir():  # before the slow part, and naming ``out``, not a temp file
        raise FileNotFoundError(errno.ENOENT, "no such folder", str(out))
    cfg, data, backend = load_run(run_dir)
    raw = data.store.target(cfg.data.target)
    rows = 0
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # out appears whole or not at all
    try:
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", "target", "prediction", "error", "unit"])
            for index, prediction, target in predictions(backend, make_loader(cfg, data, split)):
                shift = raw[index] - target  # the atom references subtracted from the target
                for i, p, t in zip(index, prediction + shift, target + shift):
                    writer.writerow([int(i), f"{t:.6f}", f"{p:.6f}", f"{p - t:.6f}", data.unit])
                    rows += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return rows
