"""What a training run writes in its folder besides checkpoints: the folder made ready
(``--fresh`` empties it, a resume drops the records after its checkpoint), the record of each
epoch with its log line, the final record (test errors beside the trivial baselines)
with the learning-curve plot, and (``logging.seen_molecules``) which molecules each rank
trained on. The loop that calls them is :mod:`schnet_ipu.training.loop`; the
record format and its writes are :mod:`schnet_ipu.training.log`.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.backends.distributed import ReplicaInfo
from schnet_ipu.config import Config, resolved_yaml
from schnet_ipu.task import Task
from schnet_ipu.training.data import PreparedData
from schnet_ipu.training.evaluation import trivial_baselines
from schnet_ipu.training.log import RunLog, plot_learning_curve, truncate_after
from schnet_ipu.training.state import Progress

log = logging.getLogger("schnet_ipu")


def open_run_dir(
    cfg: Config,
    run_dir: Path,
    fresh: bool,
    resumed: Progress | None,
    timings: dict[str, float],
    replica: ReplicaInfo,
) -> RunLog | None:
    """Rank 0: make the run directory ready (``fresh`` empties it; a resume drops the records
    after its checkpoint) and return its log; None on other ranks. Runs after the data and
    any checkpoint were checked, so a bad input stops the run before any write here."""
    if not replica.is_main:
        return None
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    if resumed is None:  # records of a run that crashed before its first checkpoint
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    else:  # records after the checkpoint will be written again; a torn line goes
        truncate_after(run_dir / "metrics.jsonl", resumed.epoch, resumed.call)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(resolved_yaml(cfg))
    runlog = RunLog(run_dir, cfg, resumed=resumed is not None)
    if resumed is None:
        runlog.write("stage", **{f"{k}_seconds": v for k, v in timings.items()})
    return runlog


def write_seen(run_dir: Path, epoch: int, first_call: int, rank: int, seen: list[Tensor]) -> Path:
    """``logging.seen_molecules``: the store indices (``seen``: int64 tensors, a micro-batch's
    real molecules each) rank ``rank`` trained on in ``epoch`` from host call ``first_call``,
    as ``<run_dir>/seen/e<epoch>.c<first_call>.r<rank>.npy`` (every rank writes its own)."""
    folder = run_dir / "seen"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"e{epoch}.c{first_call}.r{rank}.npy"
    molecules = [ids.cpu().numpy() for ids in seen]
    np.save(path, np.concatenate(molecules) if molecules else np.zeros(0, dtype=np.int64))
    return path


def write_epoch(
    runlog: RunLog,
    epoch: int,
    stats: dict[str, float],
    val: dict[str, float],
    optimizer: torch.optim.Optimizer,
    task: Task,
    unit: str,
) -> None:
    """The epoch's record in metrics.jsonl, and one log line."""
    runlog.write(
        "epoch",
        epoch=epoch,
        call=stats["calls"],
        train_loss=stats["loss"],
        **{f"val_{k}": v for k, v in val.items() if k != "molecules"},
        lr=float(optimizer.param_groups[0]["lr"]),
        budget_seconds=stats["budget_seconds"],
        epoch_fraction=stats["epoch_fraction"],
        molecules_per_s=stats["molecules_per_s"],
        data_seconds=stats["data_seconds"],
        step_seconds=stats["step_seconds"],
        epoch_seconds=stats["seconds"],
        data_wait_fraction=stats["data_seconds"] / max(stats["seconds"], 1e-9),
        unit=unit,
        **{f"train_{k}": v for k, v in task.training_metrics().items()},
    )
    log.info(
        "epoch %d: train loss %.4f, val MAE %.4f %s, %.0f molecules/s",
        epoch,
        stats["loss"],
        val["mae"],
        unit,
        stats["molecules_per_s"],
    )


def write_final(
    runlog: RunLog,
    cfg: Config,
    data: PreparedData,
    task: Task,
    test: dict[str, float],
    extra: dict[str, float],
    wall_seconds: float,
) -> None:
    """The final record (test errors beside the trivial baselines), the log line, the plot."""
    final = {f"test_{k}": v for k, v in test.items() if k != "molecules"}
    baselines = trivial_baselines(data, "test", task.with_forces, task.with_stress)
    final["baseline_test_mae"] = baselines.pop("baseline_mae")
    runlog.write(
        "final",
        **final,
        **baselines,
        **extra,
        unit=data.unit,
        test_molecules=test["molecules"],
        wall_seconds=wall_seconds,
    )
    log.info(
        "test MAE %.4f %s (RMSE %.4f); dressed-atom baseline MAE %.4f %s",
        test["mae"],
        data.unit,
        test["rmse"],
        final["baseline_test_mae"],
        data.unit,
    )
    run_dir = runlog.path.parent
    if cfg.logging.plot:
        plot_learning_curve(run_dir / "metrics.jsonl", run_dir / "learning_curve.png", data.unit)
    runlog.close()
