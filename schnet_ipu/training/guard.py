"""The divergence guard (``optim.spike_guard``): a blow-up of the loss is undone, not trained on.

    guard = SpikeGuard(cfg.optim, Trainee(model, optimizer, scheduler, average, backend), best_pt)
    guard.begin(step)                         # after any resume: the first rollback target
    spike = guard.check_read(loss, first, step)  # every logging.log_every host calls
    spike = guard.check_validation(val_loss, step)
    if spike is not None:
        record = guard.roll_back(spike)       # restore, lower the lr, log; or TrainingError

**What is a spike.** The loop reads the step losses every ``logging.log_every`` host calls
(its one synchronisation); their mean is a *read*. With replicas each contributes its own
and all take the largest (:meth:`~schnet_ipu.training.budget.Budget.agree`, the budget clock's
collective), so every replica decides alike and all roll back at the same call. A read is a
spike when it is not finite or above ``optim.spike_factor`` x the median of the last
``optim.spike_window`` clean reads; before the first, above that factor x the *start loss*:
the run's first step loss (the initial weights'; a wide network starts well above the
trivial prediction), or the trivial prediction's standardised loss (1 per loss term: the
dressed-atom energies, zero forces and stress) if that is larger. A validation is a spike
when its loss (``val_loss``: the training objective on the validation split, force and
stress terms included, :meth:`~schnet_ipu.task.Task.objective`) is not finite or above the
factor x the median of the last ``optim.spike_window`` clean validations; the first finite
one sets that reference (a wide network's first validations, a step or two in, can be 40x
its start loss and recover). Two yardsticks failed on force training, each stopping the
EMT force config after 4 rollbacks: the energy term alone (with forces it is a small part
of what is trained: 1.8e-3 against a best of 9.9e-5, 5-minute run), then the best clean
validation (an epoch-to-epoch swing of 6-17x is usual there at the config's learning
rate: 0.0116, 0.0838, 0.0211, 0.00498, 0.0291; 15-minute run).

**What it keeps.** In memory, copies of the training weights, the optimiser state and the
average of the weights (:class:`Snapshot`, ~4 copies of the parameters, taken once per
read, never per step): ``validated`` at the last clean validation; ``pending`` at the last
clean read; ``good``, the previous ``pending`` once a later read was clean too (the last
step before a read may damage the weights without its loss showing until the next read).
A spike in the reads restores ``good``, unless ``good`` is what the last rollback restored
(training from it diverged again: it may be damaged already), and a spike in validation
restores ``validated``; the learning rate
is multiplied by ``optim.spike_lr_factor`` (the scheduler's base rate, so checkpoints keep
it), one line is logged, and training goes on from where the data stood (the data order and
the schedule's clock are not rewound).

**Recovery.** The lowered rate climbs back linearly over ``optim.spike_lr_recovery_steps``
(moved at each clean read): after the first rollback to the schedule's own rate, after the
k-th to ``spike_lr_factor^(k - 1)`` of it, so a rate that spikes again is lowered for good.
1,000 steps is about the memory of Adam's second moments at beta2 0.999 (configs/qm9.yaml's
0.99 remembers ~100), whose catching up after a quiet stretch is a usual cause of a spike.
A lowering for the rest of the run cost the one 30-minute QM9 run it happened to (rollback
at step 3,380 of ~57,000: ahead of three others until minute 15 at half the rate, 0.7-1.3
meV behind at the end); 0 keeps it for good. The plateau schedule keeps every lowering (its
own reductions set the rate).

A spike after ``optim.spike_rollbacks`` rollbacks stops the run with
:class:`~schnet_ipu.errors.TrainingError` naming the step and the learning rate; ``best.pt``
stays. At the end, :func:`check_beats_baseline` fails a run
whose test MAE does not beat the dressed-atom baseline (``optim.beat_baseline``).

**Resume.** :meth:`SpikeGuard.state` (reads, rollbacks, the lr scale and the recovery's start,
recent validation losses, snapshots) goes
into ``last.pt``, so a resumed run decides and rolls back exactly as the uninterrupted one.

Why one module of ~410 lines: 80 of them are this docstring, the measurements behind each
threshold; the code is one state machine (detect, snapshot, roll back, recover, resume) whose
parts read and write the same fields, kept together.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from schnet_ipu.config import OptimConfig
from schnet_ipu.errors import TrainingError
from schnet_ipu.training.budget import WeightAverage

log = logging.getLogger("schnet_ipu")


class WeightsOnDevice(Protocol):
    """What a rollback needs of the backend (:class:`~schnet_ipu.backends.Backend`)."""

    def optimizer_changed(self) -> None: ...

    def after_host_weight_load(self) -> None: ...


@dataclass
class Trainee:
    """What a rollback restores and slows down."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # LambdaLR or ReduceLROnPlateau
    average: WeightAverage | None
    backend: WeightsOnDevice

    def parameters(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


@dataclass
class Snapshot:
    """A copy of the training state at optimiser step ``step`` (plain data, for checkpoints)."""

    step: int
    model: dict[str, Tensor]
    optimizer: dict[int, dict[str, Any]]  # parameter index -> its optimiser state
    average: dict[str, Tensor] | None
    average_updates: int

    @classmethod
    @torch.no_grad()
    def take(cls, trainee: Trainee, step: int) -> Snapshot:
        optimizer_state = trainee.optimizer.state
        saved = {}
        for index, param in enumerate(trainee.parameters()):
            if param in optimizer_state:
                saved[index] = {k: _copy(v) for k, v in optimizer_state[param].items()}
        average = trainee.average
        return cls(
            step=step,
            model={k: v.detach().clone() for k, v in trainee.model.state_dict().items()},
            optimizer=saved,
            average=None if average is None else {k: _copy(v) for k, v in average.shadow.items()},
            average_updates=0 if average is None else average.updates,
        )

    @torch.no_grad()
    def restore(self, trainee: Trainee) -> None:
        """Copy the state back in place: compiled steps and CUDA graphs keep their tensors.
        Optimiser state made since the snapshot goes back to Adam's fresh state (zeros)."""
        trainee.model.load_state_dict(self.model)  # copies into the existing parameters
        optimizer_state = trainee.optimizer.state
        for index, param in enumerate(trainee.parameters()):
            saved = self.optimizer.get(index, {})
            if param not in optimizer_state:
                if saved:
                    optimizer_state[param] = {k: _copy(v) for k, v in saved.items()}
                continue
            state = optimizer_state[param]
            for key, value in state.items():
                if isinstance(value, Tensor) and key in saved:
                    value.copy_(saved[key])
                elif isinstance(value, Tensor):
                    value.zero_()
                else:
                    state[key] = saved.get(key, value)
        average = trainee.average
        if average is not None and self.average is not None:
            for name, shadow in average.shadow.items():
                shadow.copy_(self.average[name])
            average.updates = self.average_updates
        trainee.backend.after_host_weight_load()

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.model,
            "optimizer": self.optimizer,
            "average": self.average,
            "average_updates": self.average_updates,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Snapshot:
        return cls(
            step=int(raw["step"]),
            model=raw["model"],
            optimizer={int(k): v for k, v in raw["optimizer"].items()},
            average=raw["average"],
            average_updates=int(raw["average_updates"]),
        )


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


@dataclass(frozen=True)
class Spike:
    """A read or validation the guard refuses: ``value`` above ``factor`` x ``reference``."""

    what: str  # "training loss" or "validation loss"
    step: int
    value: float
    reference: float
    reference_name: str  # what ``reference`` is, for the log line


def scale_learning_rate(trainee: Trainee, factor: float) -> None:
    """Multiply the learning rate by ``factor``: a cosine/constant schedule's base rate
    (LambdaLR recomputes the rate from it at every step) and the rate in use (a tensor on
    the device for CUDA graphs: changed in place)."""
    scheduler = trainee.scheduler
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in trainee.optimizer.param_groups:
        if isinstance(group["lr"], Tensor):
            group["lr"].mul_(factor)
        else:
            group["lr"] = group["lr"] * factor
    trainee.backend.optimizer_changed()


class SpikeGuard:
    """Detects loss spikes and rolls back (see the module docstring). ``trivial_loss``: the
    standardised loss of the trivial prediction, the reference before any clean read;
    ``where``: this replica, for the log line (empty without replicas)."""

    def __init__(
        self,
        optim: OptimConfig,
        trainee: Trainee,
        best_path: Path,
        trivial_loss: float = 1.0,
        where: str = "",
    ) -> None:
        self.factor = optim.spike_factor
        self.lr_factor = optim.spike_lr_factor
        self.recovery_steps = optim.spike_lr_recovery_steps
        if not isinstance(trainee.scheduler, torch.optim.lr_scheduler.LambdaLR):
            self.recovery_steps = 0  # plateau: its reductions set the rate
        self.max_rollbacks = optim.spike_rollbacks
        self.trainee = trainee
        self.best_path = best_path
        self.trivial_loss = trivial_loss
        self.where = where
        self.reads: deque[float] = deque(maxlen=optim.spike_window)
        self.validations: deque[float] = deque(maxlen=optim.spike_window)
        self.rollbacks = 0
        self.lr_scale = 1.0  # of the schedule's own rate, set by rollbacks and recovery
        self.recovery_start: int | None = None  # the step of the rollback being recovered from
        self.start_loss: float | None = None  # set by the first read
        self.validated: Snapshot | None = None
        self.good: Snapshot | None = None
        self.pending: Snapshot | None = None
        self.restored: Snapshot | None = None  # what the last rollback restored

    def begin(self, step: int) -> None:
        """A new run's (or an old checkpoint's) rollback target: the state it starts from."""
        if self.good is None:
            self.validated = self.good = Snapshot.take(self.trainee, step)

    def check_read(self, loss: float, first: float, step: int) -> Spike | None:
        """A read (mean step loss since the last, and the first of those step losses, each
        agreed over replicas): a spike, or None after keeping it and moving the snapshots on."""
        if self.start_loss is None:
            start = first if math.isfinite(first) else self.trivial_loss
            self.start_loss = max(start, self.trivial_loss)
        reference, name = self.start_loss, "start loss"
        if self.reads:
            reference, name = statistics.median(self.reads), f"median of {len(self.reads)} reads"
        if not math.isfinite(loss) or loss > self.factor * reference:
            return Spike("training loss", step, loss, reference, name)
        self.reads.append(loss)
        if self.pending is not None:
            self.good = self.pending
        self.pending = Snapshot.take(self.trainee, step)
        self.recover(step)
        return None

    def recover(self, step: int) -> None:
        """Move the rate lowered by the last rollback back toward its ceiling (see the
        module docstring): linear in the steps since that rollback."""
        if self.recovery_start is None:
            return
        progress = min((step - self.recovery_start) / self.recovery_steps, 1.0)
        self.set_lr_scale(self.ceiling() * (self.lr_factor + (1.0 - self.lr_factor) * progress))
        if progress >= 1.0:
            self.recovery_start = None

    def ceiling(self) -> float:
        """The scale a recovery climbs back to: 1 after the first rollback, then
        ``lr_factor^(rollbacks - 1)``."""
        return self.lr_factor ** (self.rollbacks - 1)

    def set_lr_scale(self, scale: float) -> None:
        scale_learning_rate(self.trainee, scale / self.lr_scale)
        self.lr_scale = scale

    def check_validation(self, val_loss: float, step: int) -> Spike | None:
        """A validation's loss (the training objective on the split): a spike, or None after
        making the state the target of later rollbacks."""
        reference, name = math.inf, "no validation yet"
        if self.validations:
            reference = statistics.median(self.validations)
            name = f"median of {len(self.validations)} validations"
        if not math.isfinite(val_loss) or val_loss > self.factor * reference:
            return Spike("validation loss", step, val_loss, reference, name)
        self.validations.append(val_loss)
        self.validated = self.good = Snapshot.take(self.trainee, step)
        self.pending = None
        return None

    def roll_back(self, spike: Spike) -> dict[str, float]:
        """Restore the last good state, lower the learning rate and log one line; returns
        the rollback's record. Raises :class:`TrainingError` after too many rollbacks."""
        lr = self.trainee.lr
        if self.rollbacks >= self.max_rollbacks:
            kept = f"{self.best_path} (best validation) is kept"
            if not self.best_path.exists():
                kept = "no validation passed, so there is no best.pt"
            raise TrainingError(
                f"the {spike.what} diverged at step {spike.step} ({spike.value:.4g} > "
                f"{self.factor:g} x {spike.reference:.4g}, {spike.reference_name}) after "
                f"{self.rollbacks} rollback(s) of the divergence guard, at learning rate "
                f"{lr:.3g}; stopped. {kept}: lower optim.lr, or allow more rollbacks with "
                "optim.spike_rollbacks"
            )
        self.rollbacks += 1
        target = self.good
        if spike.what == "validation loss" or target is self.restored:
            target = self.validated
        target.restore(self.trainee)
        self.good, self.pending, self.restored = target, None, target
        self.set_lr_scale(self.lr_factor**self.rollbacks)
        recovery = "for the rest of the run"
        if self.recovery_steps > 0:
            self.recovery_start = spike.step
            recovery = f"back to {self.ceiling():g} x the schedule over {self.recovery_steps} steps"
        log.warning(
            "divergence guard%s: step %d: %s %.4g > %g x %.4g (%s); rolled back to step %d, "
            "learning rate %.3g -> %.3g, %s (rollback %d of %d)",
            self.where,
            spike.step,
            spike.what,
            spike.value,
            self.factor,
            spike.reference,
            spike.reference_name,
            target.step,
            lr,
            self.trainee.lr,
            recovery,
            self.rollbacks,
            self.max_rollbacks,
        )
        return {
            "step": spike.step,
            "what": spike.what,
            "loss": spike.value,
            "reference": spike.reference,
            "to_step": target.step,
            "lr": self.trainee.lr,
            "rollbacks": self.rollbacks,
        }

    def state(self) -> dict[str, Any]:
        """Plain data for ``last.pt``: each snapshot once, named by what holds it."""
        held = {
            "validated": self.validated,
            "good": self.good,
            "pending": self.pending,
            "restored": self.restored,
        }
        snapshots: list[Snapshot] = []
        for snapshot in held.values():
            if snapshot is not None and not any(snapshot is s for s in snapshots):
                snapshots.append(snapshot)
        index = {id(s): i for i, s in enumerate(snapshots)}
        return {
            "reads": list(self.reads),
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "recovery_start": self.recovery_start,
            "validations": list(self.validations),
            "start_loss": self.start_loss,
            "snapshots": [s.to_dict() for s in snapshots],
            **{name: None if s is None else index[id(s)] for name, s in held.items()},
        }

    def load(self, state: dict[str, Any]) -> None:
        self.reads.clear()
        self.reads.extend(float(v) for v in state["reads"])
        self.rollbacks = int(state["rollbacks"])
        # a checkpoint from before recovery lowered for good
        self.lr_scale = float(state.get("lr_scale", self.lr_factor**self.rollbacks))
        start = state.get("recovery_start")
        self.recovery_start = None if start is None else int(start)
        self.validations.clear()
        if "validations" in state:
            self.validations.extend(float(v) for v in state["validations"])
        elif math.isfinite(state["best_val_loss"]):  # a checkpoint of the best-validation rule
            self.validations.append(float(state["best_val_loss"]))
        start_loss = state["start_loss"]
        self.start_loss = None if start_loss is None else float(start_loss)
        snapshots = [Snapshot.from_dict(raw) for raw in state["snapshots"]]
        picked = {name: state[name] for name in ("validated", "good", "pending", "restored")}
        self.validated, self.good, self.pending, self.restored = (
            None if i is None else snapshots[i] for i in picked.values()
        )


def check_beats_baseline(final: dict, run_dir: Path) -> None:
    """A run whose network does no better than the dressed-atom fit learned nothing usable
    (it diverged, or trained far too briefly): an error, not exit 0."""
    mae, baseline, unit = final["test_mae"], final["baseline_test_mae"], final["unit"]
    if not mae < baseline:  # NaN too
        raise TrainingError(
            f"{run_dir}: test MAE {mae:.4g} {unit} does not beat the dressed-atom baseline "
            f"({baseline:.4g} {unit}): the network learned nothing usable (it diverged, or "
            "trained too briefly); lower optim.lr or train longer (optim.beat_baseline=false "
            "accepts such a run)"
        )
