"""What a run carries from one process to the next: its checkpoint state and the resume.

    resume = read_resume(cfg, last_path, fresh, replica)           # None for a new run
    state = RunState(cfg, model, optimizer, scheduler, spec, budget, average)
    progress = state.restore(resume, last_path) if resume else Progress()
    save_checkpoint(path, state.checkpoint(progress))

A checkpoint holds the model (the average of the weights when ``optim.ema_decay`` keeps
one: what evaluation and model files use), the optimiser, schedule and RNG states, the
position (epoch, host call), the best validation MAE, the config, the model spec, the
budget's seconds, with an average also the weights training goes on from, and in ``last.pt``
the divergence guard's state (:mod:`schnet_ipu.training.guard`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from schnet_ipu.backends.distributed import ReplicaInfo, from_rank0
from schnet_ipu.checkpoint import (
    check_same_run,
    load_checkpoint,
    restoring,
    rng_state,
    set_rng_state,
)
from schnet_ipu.config import Config
from schnet_ipu.errors import TrainingError
from schnet_ipu.training.budget import Budget, WeightAverage
from schnet_ipu.training.guard import SpikeGuard


@dataclass
class Progress:
    """Where a run stands: the next epoch, host calls done in it, the best validation MAE."""

    epoch: int = 0
    call: int = 0
    best_mae: float = math.inf


def read_resume(
    cfg: Config, last_path: Path, fresh: bool, replica: ReplicaInfo
) -> dict[str, Any] | None:
    """The checkpoint to resume from (rank 0 reads it, every rank gets it), checked to be
    this config's run; None for a new run or with ``fresh``."""
    main = replica.is_main
    resume = load_checkpoint(last_path) if main and last_path.exists() and not fresh else None
    resume = from_rank0(resume, replica)  # instances on other hosts may not see the run dir
    if resume is not None:
        check_same_run(resume["config"], cfg.to_dict(), last_path.parent.parent)
    return resume


@dataclass
class RunState:
    """Everything of a run that a checkpoint saves and a resume restores."""

    cfg: Config
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # a torch lr_scheduler (LambdaLR or ReduceLROnPlateau)
    spec: dict[str, Any]  # ModelSpec.to_dict()
    budget: Budget
    average: WeightAverage | None
    guard: SpikeGuard | None = None

    def restore(self, resume: dict[str, Any], path: Path) -> Progress:
        with restoring(path):
            self.model.load_state_dict(resume["model"])  # the saved model must fit, averaged too
            self.model.load_state_dict(resume.get("train_model", resume["model"]))
            if self.average is not None:  # a run from before averaging starts one afresh
                self.average.load(resume["model"], resume.get("ema", {"updates": 0}))
            self.optimizer.load_state_dict(resume["optimizer"])
            self.scheduler.load_state_dict(resume["scheduler"])
            set_rng_state(resume["rng"])
            if self.guard is not None and "guard" in resume:  # else it starts afresh here
                self.guard.load(resume["guard"])
        return Progress(int(resume["epoch"]), int(resume["call"]), float(resume["best_mae"]))

    def checkpoint(self, progress: Progress, resumable: bool = True) -> dict[str, Any]:
        """The state to save at ``progress``; refuses non-finite weights. ``resumable``
        (``last.pt``, not ``best.pt``): with the divergence guard's state."""
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            raise TrainingError(
                f"non-finite weights at epoch {progress.epoch}; no checkpoint written"
            )
        average = self.average
        state = {
            "model": self.model.state_dict() if average is None else average.averaged_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "epoch": progress.epoch,
            "call": progress.call,
            "best_mae": progress.best_mae,
            "config": self.cfg.to_dict(),
            "model_spec": self.spec,
            "budget_seconds": self.budget.seconds,
        }
        if average is not None:  # the weights training goes on from, for an exact resume
            state.update(train_model=self.model.state_dict(), ema=average.state())
        if resumable and self.guard is not None:
            state["guard"] = self.guard.state()
        return state
