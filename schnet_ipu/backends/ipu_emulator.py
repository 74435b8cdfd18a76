"""``backend.device=ipu-model`` without PopTorch: PopTorch's execution model on the CPU.

Like PopTorch, ONE process drives all R replicas (R up to 64 and beyond): a host call takes
D x R x A micro-batches, device iteration outermost, then replica, then accumulation (the
order PopTorch splits dim 0 of its inputs). Each optimiser step runs the fixed-shape forward
and backward of every replica on its own A micro-batches, adds each replica's gradients into
one flat buffer (the merged all-reduce: one collective per step), divides by R x A
(PopTorch's Mean reduction over accumulation and replicas, python/options.py
``accumulationAndReplicationReductionType``), clips the global norm as
``poptorch.optim.Adam(max_grad_norm=...)`` does on the device (popart ClipNormSettings::
clipAllWeights over all weights, after the reduction) and steps the optimiser once. The
result equals one replica on the concatenated batch of the step, to float tolerance.

The first step's forward + loss is checked against the aten ops PopTorch 3.4.0 maps
(:func:`~schnet_ipu.backends.poptorch_ops.check_poptorch_ops`), so the emulator fails where
the IPU compiler would. ``predict`` computes a batch once (no replica copies).
"""

from __future__ import annotations

import torch
from torch import nn

from schnet_ipu.backends.distributed import trainable_grads, unflatten_into
from schnet_ipu.backends.torch_backend import LossFn, TorchBackend
from schnet_ipu.batch import Batch


class IpuEmulatorBackend(TorchBackend):
    """R replicas of the fixed-shape step in this process, one merged gradient sum per step.

    Args:
        model, optimizer, loss_fn: as for :class:`TorchBackend` (CPU).
        replicas: R, replicas driven by this process.
        device_iterations: D, optimiser steps per ``train_call``.
        gradient_accumulation: A, micro-batches per replica per optimiser step.
        grad_clip: max global gradient norm after the reduction; 0 disables clipping.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        replicas: int = 1,
        device_iterations: int = 1,
        gradient_accumulation: int = 1,
        grad_clip: float = 0.0,
    ) -> None:
        super().__init__(
            model,
            optimizer,
            loss_fn,
            device="cpu",
            device_iterations=device_iterations,
            gradient_accumulation=gradient_accumulation,
            grad_clip=grad_clip,
            check_ops=True,  # the first step and prediction refuse ops PopTorch cannot lower
        )
        self.replicas = replicas

    @property
    def collectives_per_step(self) -> int:
        """One merged gradient reduction per step when replicated, as PopART merges them."""
        return 1 if self.replicas > 1 else 0

    def train_call(self, micro_batches: list[Batch]) -> list[dict]:
        """D optimiser steps over exactly D x R x A micro-batches; one record per step:
        ``loss`` (mean over the step's R x A micro-batches) and ``molecules`` (their count)."""
        steps, accum = self.device_iterations, self.gradient_accumulation
        per_step = self.replicas * accum
        if len(micro_batches) != steps * per_step:
            raise ValueError(
                f"train_call needs device_iterations x replicas x gradient_accumulation = "
                f"{steps} x {self.replicas} x {accum} = {steps * per_step} micro-batches, "
                f"got {len(micro_batches)}"
            )
        for batch in micro_batches:
            self._train_guard.check(batch)
        self.model.train()
        records = []
        for step in range(steps):
            group = micro_batches[step * per_step : (step + 1) * per_step]
            merged = 0.0  # becomes [P], the all-reduce buffer
            step_loss = 0.0
            for replica in range(self.replicas):
                replica_loss = self._replica_grads(group[replica * accum : (replica + 1) * accum])
                merged = merged + torch.cat([g.reshape(-1) for g in trainable_grads(self.model)])
                step_loss += replica_loss
            unflatten_into(trainable_grads(self.model), merged / per_step)
            if self.grad_clip > 0:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            records.append(
                {
                    "loss": step_loss / per_step,
                    "molecules": sum(b.num_molecules for b in group),
                    "collectives": self.collectives_per_step,
                }
            )
        return records

    def _replica_grads(self, batches: list[Batch]) -> float:
        """One replica's gradient sum over its A micro-batches (in ``.grad``); its loss sum."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for batch in batches:
            loss = self._run("train", lambda model, batch=batch: self.loss_fn(model, batch))
            loss.backward()
            total += loss.detach()
        return float(total)
