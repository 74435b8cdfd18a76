"""Minutes into accuracy: a wall-clock budget for training, and an average of the weights.

    budget = Budget(minutes=cfg.optim.max_minutes, spent=checkpoint_seconds)
    budget.start()                 # at each chunk of host calls
    budget.pause()                 # after its validation: the count a checkpoint records
    budget.agree()                 # replicas: all read the slowest one's clock from here on
    budget.agree([loss])           # ... and the largest of their values, in the same collective
    budget.next_validation()       # count at which to pause and validate (each 10% of it)
    budget.fraction()              # 0..1: what the learning-rate schedule follows
    budget.exhausted()             # the loop stops, validates, saves and tests
    average = WeightAverage(model, decay=cfg.optim.ema_decay)
    average.update()               # after every host call
    with average.swapped_in():     # validation, test and checkpoints' "model" use it
        ...

The budget counts the seconds of the training loop in every process of a run: steps (with
the first step's compilation) and validation; the seconds of earlier processes come back
from the checkpoint, so a resumed run ends at the same total. The clock pauses after each
validation, so the count a checkpoint records is the one the loop then decides on: a run
that stopped because its budget was spent is spent when resumed too. Data preparation,
checkpoint writes and the final test are not counted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

VALIDATE_SHARE = 0.1  # of the budget between validations, at most


class Budget:
    """``minutes`` of training loop (0: no budget), ``spent`` seconds of them already.

    Replicas (``world_size`` > 1) must stop at the same host call and follow the same
    learning rate, but their clocks start apart. So with replicas the budget reads an
    agreed clock: :meth:`agree`, called by every replica at the same host calls, sets it to
    the slowest replica's count (one scalar all-reduce); between agreements every replica
    sees the same value.
    """

    def __init__(
        self, minutes: float, spent: float = 0.0, world_size: int = 1, device: str = "cpu"
    ) -> None:
        self.total = 60.0 * minutes
        self.spent = spent
        self.world_size = world_size
        self.device = device  # where the replicas' collectives run (NCCL: a CUDA device)
        self._since: float | None = None
        self._agreed = spent

    def start(self) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    def pause(self) -> None:
        """Stop the clock until the next :meth:`start`; what ran so far joins ``spent``."""
        self.spent, self._since = self._own_seconds(), None

    def _own_seconds(self) -> float:
        running = 0.0 if self._since is None else time.perf_counter() - self._since
        return self.spent + running

    @property
    def seconds(self) -> float:
        """Seconds counted so far, earlier processes of the run included (with replicas:
        as of the last agreement)."""
        return self._own_seconds() if self.world_size == 1 else self._agreed

    def agree(self, shared: Sequence[float] = ()) -> list[float]:
        """With replicas, every replica takes the largest count among them (a collective:
        all replicas call it at the same point); without, nothing to do. ``shared``: values
        each replica contributes (the divergence guard's loss), returned as their maximum
        over the replicas, carried by the same collective."""
        if self.world_size == 1 or (self.total <= 0 and not shared):
            return list(shared)
        values = [self._own_seconds(), *shared]
        maxima = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        count, *agreed = maxima.cpu().tolist()
        if self.total > 0:
            self._agreed = count
        return agreed

    def next_validation(self) -> float:
        """The count at which training pauses to validate: every epoch's end, and with a
        budget also each 10% of it (a run of any data size gets a learning curve and a
        best checkpoint); never without a budget."""
        return self.seconds + VALIDATE_SHARE * self.total if self.total > 0 else math.inf

    def fraction(self) -> float:
        """Share of the budget used, 0 without a budget."""
        return min(self.seconds / self.total, 1.0) if self.total > 0 else 0.0

    def exhausted(self) -> bool:
        return self.total > 0 and self.seconds >= self.total


class WeightAverage:
    """Exponential moving average of a model's parameters (as MACE and NequIP keep one).

    Each :meth:`update` moves the average towards the weights by ``1 - d`` with
    ``d = min(decay, (1 + n) / (10 + n))`` after n updates (TensorFlow's
    ``ExponentialMovingAverage`` with ``num_updates``), so the first averages follow the
    weights instead of their initial values. Called once per host call: with
    ``backend.device_iterations`` D > 1 it sees every D-th step's weights.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.model = model
        self.decay = decay
        self.updates = 0
        self.shadow = {
            name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad
        }

    def _parameters(self) -> dict[str, Tensor]:
        return {name: p for name, p in self.model.named_parameters() if name in self.shadow}

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        weight = 1.0 - min(self.decay, (1 + self.updates) / (10 + self.updates))
        for name, p in self._parameters().items():
            self.shadow[name].lerp_(p.detach(), weight)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its own after it."""
        params = self._parameters()
        raw = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(raw[name])

    def averaged_state_dict(self) -> dict[str, Tensor]:
        """The model's state dict with the averaged parameters (what a model file holds). A
        parameter the state dict lists under several names (PyG's ``interactions.i.mlp`` is
        also ``interactions.i.conv.nn``) is averaged under every one of them."""
        averaged = {id(p): self.shadow[name] for name, p in self._parameters().items()}
        return {
            key: averaged.get(id(value), value).detach().clone()
            for key, value in self.model.state_dict(keep_vars=True).items()
        }

    def state(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates}

    def load(self, averaged: dict[str, Tensor], state: dict[str, Any]) -> None:
        """Restore from a checkpoint's averaged ``model`` state dict and :meth:`state`."""
        for name in self.shadow:
            self.shadow[name].copy_(averaged[name])
        self.updates = int(state["updates"])
