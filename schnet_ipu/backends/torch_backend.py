"""Training and prediction steps on CPU or CUDA with the IPU's execution model.

One ``train_call`` takes D x A micro-batches of this replica, like one PopTorch host call:
D optimiser steps, each accumulating A micro-batches (loss divided by A: a mean), then a
mean all-reduce of gradients over replicas, gradient clipping, and the optimiser step.
Every batch must have the signature of the first one; a change raises
:class:`RecompilationError` instead of silently recompiling.

On CUDA the whole optimiser step is captured once as a CUDA graph and replayed
(:mod:`.cuda_graph`). Nothing in a step waits for the device: each step's loss stays a
device tensor until the caller reads it.

``precision``: ``fp32``; ``tf32`` (CUDA matmuls in TensorFloat-32; the same as fp32 on a CPU);
``bf16`` (``torch.autocast`` to bfloat16 around the training forward pass and loss, fp32 master
weights and optimiser; the model keeps distances, softplus, sums, filter tables and the
readout in fp32). Predictions (validation, test) always run in fp32.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator  # LossFn is a runtime alias: typing's form on Python 3.8

import torch
from torch import Tensor, nn

from schnet_ipu.backends.cuda_graph import CapturedStep
from schnet_ipu.backends.distributed import (
    ReplicaInfo,
    broadcast_parameters,
    merged_allreduce,
    per_parameter_allreduce,
    shared_memory_reduction,
    trainable_grads,
)
from schnet_ipu.backends.poptorch_ops import check_poptorch_ops
from schnet_ipu.batch import Batch

LossFn = Callable[[nn.Module, Batch], Tensor]
PRECISIONS = ("fp32", "tf32", "bf16")


class RecompilationError(RuntimeError):
    """A batch whose shapes differ from the first one: fixed-shape runs never recompile."""


class ShapeGuard:
    """Remembers the first batch signature and rejects any other one.

    ``recompilations`` counts the rejected batches (each would have cost a recompilation).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.signature: tuple | None = None
        self.recompilations = 0

    def check(self, batch: Batch) -> None:
        signature = batch.signature()
        if self.signature is None:
            self.signature = signature
            return
        if signature == self.signature:
            return
        self.recompilations += 1
        changes = [
            f"{field} {_describe(old)} -> {_describe(new)}"
            for (field, old), (_, new) in zip(self.signature, signature)
            if old != new
        ]
        raise RecompilationError(
            f"{self.name} batch shape changed ({'; '.join(changes)}); the step is compiled for "
            "fixed shapes, so every batch must keep the packing limits and packs_per_batch of "
            "the first one"
        )


class ShapeGuards:
    """A backend's two guards: one for training steps, one for predictions (each compiled
    once for its own shape)."""

    def __init__(self) -> None:
        self.training = ShapeGuard("training")
        self.prediction = ShapeGuard("prediction")

    @property
    def recompilations(self) -> int:
        return self.training.recompilations + self.prediction.recompilations

    def check_train_call(self, micro_batches: list[Batch], factors: dict[str, int]) -> None:
        """Refuses a host call whose micro-batch count is not the product of ``factors``
        (their names and values make the message) or whose batches change shape."""
        expected = math.prod(factors.values())
        if len(micro_batches) != expected:
            sizes = " x ".join(str(value) for value in factors.values())
            raise ValueError(
                f"train_call needs {' x '.join(factors)} = {sizes} = {expected} micro-batches, "
                f"got {len(micro_batches)}"
            )
        for batch in micro_batches:
            self.training.check(batch)


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "absent"
    shape, dtype = entry
    return f"{list(shape)} {str(dtype).replace('torch.', '', 1)}"


class TorchBackend:
    """D optimiser steps of A accumulated micro-batches per call, replicated over processes.

    Args:
        model: maps a Batch to predictions [G]; moved to ``device``.
        optimizer: built over ``model``'s parameters.
        loss_fn: ``loss_fn(model, batch) -> Tensor []``, a mean over the batch's molecules.
        device: "cpu", "cuda" or "cuda:i" (under replication, the replica's local GPU).
        device_iterations: D, optimiser steps per ``train_call``.
        gradient_accumulation: A, micro-batches per optimiser step.
        merge_allreduce: one all-reduce of a flat buffer per step instead of one per parameter.
        shared_memory_allreduce: with ``merge_allreduce``, CPU replicas that
            ``launch_replicas`` spawned on one host sum the buffer in shared memory.
        compile: ``torch.compile(loss_fn, dynamic=False)`` for training (forward, loss and,
            through AOTAutograd, their backward; inside the CUDA graph when ``cuda_graphs``)
            and ``torch.compile(model, dynamic=False)`` for prediction.
        compile_backend: the torch.compile backend ("aot_eager" skips code generation).
        grad_clip: max gradient norm after the replica reduction; 0 disables clipping.
        replica: this process's rank among the replicas (from ``init_replica``).
        precision: ``fp32``, ``tf32`` or ``bf16`` (see the module docstring).
        cuda_graphs: capture the optimiser step as a CUDA graph (CUDA devices only).
        check_ops: run the first training forward + loss and the first prediction under
            :func:`~schnet_ipu.backends.poptorch_ops.check_poptorch_ops`, refusing aten ops
            PopTorch 3.4.0 cannot lower (``backend.device=ipu-model`` without PopTorch).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        device: str = "cpu",
        device_iterations: int = 1,
        gradient_accumulation: int = 1,
        merge_allreduce: bool = True,
        shared_memory_allreduce: bool = True,
        compile: bool = False,
        compile_backend: str = "inductor",
        grad_clip: float = 0.0,
        replica: ReplicaInfo | None = None,
        precision: str = "fp32",
        cuda_graphs: bool = False,
        check_ops: bool = False,
    ) -> None:
        self.replica = replica or ReplicaInfo()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", self.replica.local_rank)
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.precision = precision
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device_iterations = device_iterations
        self.gradient_accumulation = gradient_accumulation
        self.merge_allreduce = merge_allreduce
        self.grad_clip = grad_clip
        self.compiled_graphs = 0
        self.compile_backend = compile_backend
        self._run_model: nn.Module = model
        self._compiled_loss: LossFn | None = None
        if compile:  # forward + loss as one graph; AOTAutograd compiles its backward with it
            self._compiled_loss = torch.compile(loss_fn, dynamic=False, backend=self._count_graphs)
            self._run_model = torch.compile(model, dynamic=False, backend=self._count_graphs)
        self._shapes = ShapeGuards()
        self._collectives = 0
        self._shared_reduction = None
        if self.replica.world_size > 1:
            broadcast_parameters(self.model)
            if merge_allreduce and shared_memory_allreduce and self.device.type == "cpu":
                self._shared_reduction = shared_memory_reduction(self.replica)
        self._unchecked = {"train", "predict"} if check_ops else set()
        self._captured = None
        if cuda_graphs:
            self._captured = CapturedStep(self._step, self.model, optimizer, self.device)

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured (1 once training started with graphs, else 0); more than one
        would be a re-capture, which fixed shapes rule out."""
        return 0 if self._captured is None else self._captured.captures

    @property
    def recompilations(self) -> int:
        """Batches rejected because their shapes differed from the first (train + predict)."""
        return self._shapes.recompilations

    @property
    def collectives_per_step(self) -> int:
        """Collective calls of the last optimiser step (0 with one replica)."""
        return self._collectives

    def train_call(self, micro_batches: list[Batch]) -> list[dict]:
        """Run D optimiser steps over exactly D x A micro-batches of this replica.

        Returns one record per step: ``loss`` (mean over its A micro-batches, this replica; a
        0-d tensor on the device, so reading it is the caller's one synchronisation),
        ``molecules`` (real molecules in them, this replica) and ``collectives``.
        """
        steps, accum = self.device_iterations, self.gradient_accumulation
        factors = {"device_iterations": steps, "gradient_accumulation": accum}
        self._shapes.check_train_call(micro_batches, factors)
        self.model.train()
        records = []
        for step in range(steps):
            group = micro_batches[step * accum : (step + 1) * accum]
            with self._matmul_precision():
                if self._captured is not None:
                    loss = self._captured(group).clone()  # the graph overwrites its output
                else:
                    loss = self._step([self._to_device(b) for b in group])
            molecules = sum(b.num_molecules for b in group)  # the loader's host counts: no sync
            records.append({"loss": loss, "molecules": molecules, "collectives": self._collectives})
        return records

    def _step(self, group: list[Batch]) -> Tensor:
        """One optimiser step over A device batches -> their mean loss [] (never read here)."""
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        for batch in group:
            with self._autocast():
                loss = self._train_loss(batch)
            (loss / len(group)).backward()
            step_loss += loss.detach()
        self._collectives = self.reduce_gradients()
        if self.grad_clip > 0:  # foreach, and no check of the norm: nothing waits for it
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, foreach=True)
        self.optimizer.step()
        return step_loss / len(group)

    def _autocast(self) -> torch.autocast:
        """bf16: autocast the forward pass (no weight-cast cache, which graph capture forbids)."""
        return torch.autocast(
            self.device.type,
            dtype=torch.bfloat16,
            enabled=self.precision == "bf16",
            cache_enabled=False if self._captured is not None else None,
        )

    @contextmanager
    def _matmul_precision(self) -> Iterator[None]:
        """tf32 on CUDA: TensorFloat-32 matmuls for this step only (the flag is global)."""
        if self.precision != "tf32" or self.device.type != "cuda":
            yield
            return
        matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn

    @torch.no_grad()
    def predict(self, batch: Batch) -> Tensor:
        """Predictions [G] for one batch, in eval mode, returned on the host. In fp32
        whatever ``precision`` trains: validation and test measure the model as the
        calculator and the export run it."""
        self._shapes.prediction.check(batch)
        self.model.eval()
        batch = self._to_device(batch)
        return self._run("predict", lambda model: model(batch)).cpu()

    def _train_loss(self, batch: Batch) -> Tensor:
        """Forward pass and loss [] of one device batch: with ``compile`` one compiled
        function (unless the first call is the PopTorch op check's)."""
        if self._compiled_loss is not None and "train" not in self._unchecked:
            return self._compiled_loss(self.model, batch)
        return self._run("train", lambda model: self.loss_fn(model, batch))

    def _run(self, kind: str, fn: Callable[[nn.Module], Tensor]) -> Tensor:
        """``fn(model)``; the first ``kind`` ("train" / "predict") call runs eagerly under the
        PopTorch op check when ``check_ops`` is set."""
        if kind not in self._unchecked:
            return fn(self._run_model)
        self._unchecked.discard(kind)
        return check_poptorch_ops(lambda: fn(self.model))

    def optimizer_changed(self) -> None:
        """Called after the host changed the optimiser (lr schedule): nothing to send here."""

    def after_host_weight_load(self) -> None:
        """Called after weights were loaded into the model: they are already in use here."""

    def _to_device(self, batch: Batch) -> Batch:
        if self.device.type != "cuda":
            return batch.to(self.device)
        return batch.pin_memory().to(self.device, non_blocking=True)

    def reduce_gradients(self) -> int:
        """Mean the gradients over the replicas, in place; returns the collectives used."""
        if self.replica.world_size == 1:
            return 0
        grads = trainable_grads(self.model)
        if self.merge_allreduce:
            return merged_allreduce(grads, self.replica.world_size, self._shared_reduction)
        return per_parameter_allreduce(grads, self.replica.world_size)

    def _count_graphs(self, graph: torch.fx.GraphModule, example_inputs: list[Tensor]):
        """torch.compile backend: ``compile_backend``, counting each graph dynamo hands over."""
        self.compiled_graphs += 1
        return torch._dynamo.lookup_backend(self.compile_backend)(graph, example_inputs)
