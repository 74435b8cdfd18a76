"""``backend.device=ipu-model`` without PopTorch: PopTorch 3.4.0's execution model on the CPU.

Like PopTorch, ONE process drives all R replicas (the IPU Model allows up to 64). A host call
takes D x A x R micro-batches: device iteration outermost, then accumulation, then replica,
because PopART hands consecutive micro-batches to the replicas in rotation
(willow/src/stepiosplitter.cpp in github:graphcore/popart at sdk/poplar/3.4.0): replica r
of a step gets micro-batches r, r + R, r + 2R, ... Each optimiser step runs the fixed-shape
forward and backward of every replica on its A micro-batches, adds each replica's gradients
into one flat buffer (the merged all-reduce: one collective per step) and divides by R x A
(PopTorch's Mean reduction, python/options.py ``accumulationAndReplicationReductionType``).
Then it updates as PopART's Adam does (:func:`popart_adam_step`): L2 weight decay added to
the gradient first (willow/src/patterns/adamdecompose.cpp), the global norm clipped after
that (willow/src/transforms/clipweightgradientsbynorm.cpp clips the tensor that enters the
first moment), then Adam without decay.

What else it reproduces, so a run that would fail on PopTorch fails here too:

* ops: the first step's forward + loss and the first prediction are checked against the aten
  ops PopTorch 3.4.0 lowers (:func:`~schnet_ipu.backends.poptorch_ops.check_poptorch_ops`);
* buffers: ``poptorch.trainingModel`` re-types every buffer of the wrapped model
  (python/_poplar_executor.py ``_install_state_hooks``) as a tensor subclass that survives
  ``detach()`` and pickles as a call to a PopTorch function (python/_impl.py
  ``registerWrapperType``: ``copyreg.pickle`` with ``_pickleUnwrapObject``), which
  ``torch.load(weights_only=True)`` refuses. :class:`WrappedBuffer` does the same (its
  pickle calls :func:`rewrap_buffer`); like PopTorch the forward runs on unwrapped buffers
  (``unwrapModelIfNecessary`` before tracing; the IPU never runs Python);
* no host device: like ``PoptorchBackend`` it has no ``device`` attribute, so host-side code
  must not take one from the backend;
* replicas: more than 64 per process is refused (popart_compiler/source/CompilerImpl.cpp
  ``assertSingleInstanceMaxNumIPUs``, which applies to the IPU Model too).

``predict`` computes a batch once (no replica copies), like the one-IPU inference model.
"""

from __future__ import annotations

import copyreg
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch
from torch import Tensor, nn

from schnet_ipu.backends.distributed import trainable_grads, unflatten_into
from schnet_ipu.backends.poptorch_ops import check_poptorch_ops
from schnet_ipu.backends.torch_backend import LossFn, ShapeGuards
from schnet_ipu.batch import Batch
from schnet_ipu.config import ConfigError

MAX_REPLICAS_PER_PROCESS = 64  # CompilerImpl.cpp assertSingleInstanceMaxNumIPUs


class WrappedBuffer(Tensor):
    """A buffer of a model held by the (emulated) PopTorch training executable.

    A plain ``torch.Tensor`` subclass: torch's default ``__torch_function__`` keeps the
    subclass through ``detach()`` and arithmetic, as PopTorch's ``PoptorchBuffer`` does.
    """


def rewrap_buffer(tensor: Tensor) -> Tensor:
    """What a pickled :class:`WrappedBuffer` calls on load (PopTorch's
    ``_restoreWrapperIfNecessary``); a global ``weights_only`` loading refuses."""
    return tensor


def _reduce_wrapped(buffer: WrappedBuffer):
    return rewrap_buffer, (buffer.as_subclass(Tensor),)  # same storage, plain type


copyreg.pickle(WrappedBuffer, _reduce_wrapped)


def wrap_buffers(model: nn.Module) -> None:
    """Re-type every buffer of ``model`` as :class:`WrappedBuffer`, in place."""
    for buffer in model.buffers():
        if type(buffer) not in (Tensor, WrappedBuffer):
            raise TypeError(f"All buffers must be an instance of torch.Tensor (got {type(buffer)})")
        buffer.__class__ = WrappedBuffer


@contextmanager
def unwrapped_buffers(model: nn.Module) -> Iterator[None]:
    """Plain buffers inside (PopTorch traces and runs the model unwrapped), wrapped after."""
    wrapped = [b for b in model.buffers() if type(b) is WrappedBuffer]
    for buffer in wrapped:
        buffer.__class__ = Tensor
    try:
        yield
    finally:
        for buffer in wrapped:
            buffer.__class__ = WrappedBuffer


def popart_adam_step(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """One update as PopART 3.4 lowers ``poptorch.optim.Adam`` (L2 mode) with clipping.

    For ``torch.optim.Adam``: g <- g + wd * w (adamdecompose.cpp ``regularizeL2``), then
    g <- g * c / max(c, ||g||) over all weights (clipweightgradientsbynorm.cpp
    ``createClipFactor``), then Adam's step with its decay set to 0 for the call. Other
    optimisers (SGD: PopART decays inside the weight update, after clipping) clip first and
    decay in their own step, as torch does. ``max_norm`` 0 disables clipping.
    """
    adam = isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW)
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if adam and group["weight_decay"]:
                param.grad.add_(param.detach(), alpha=group["weight_decay"])
            grads.append(param.grad)
    if max_norm > 0 and grads:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        factor = max_norm / torch.clamp(norm, min=max_norm)
        torch._foreach_mul_(grads, factor)
    if not adam:
        optimizer.step()
        return
    decays = [group["weight_decay"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["weight_decay"] = 0.0
        optimizer.step()
    finally:
        for group, decay in zip(optimizer.param_groups, decays):
            group["weight_decay"] = decay


class IpuEmulatorBackend:
    """R replicas of the fixed-shape step in this process, one merged gradient sum per step.

    Args:
        model, optimizer, loss_fn: the model (its buffers get wrapped), a torch optimiser and
            ``loss_fn(model, batch) -> Tensor []``; all stay on the CPU.
        replicas: R, replicas driven by this process (at most 64).
        device_iterations: D, optimiser steps per ``train_call``.
        gradient_accumulation: A, micro-batches per replica per optimiser step.
        grad_clip: max global gradient norm after the reduction; 0 disables clipping.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None,
        replicas: int = 1,
        device_iterations: int = 1,
        gradient_accumulation: int = 1,
        grad_clip: float = 0.0,
    ) -> None:
        if replicas > MAX_REPLICAS_PER_PROCESS:
            raise ConfigError(
                f"backend.replicas: {replicas} IPUs in one process; PopTorch reserves at most "
                "64 per process: use scripts/poprun.py with more instances"
            )
        self.model = model
        self.device = torch.device("cpu")  # host-side autograd (forces), as PoptorchBackend's
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.replicas = replicas
        self.device_iterations = device_iterations
        self.gradient_accumulation = gradient_accumulation
        self.grad_clip = grad_clip
        self._shapes = ShapeGuards()
        self._unchecked = {"train", "predict"}  # the first of each runs under the op check
        wrap_buffers(model)

    @property
    def recompilations(self) -> int:
        return self._shapes.recompilations

    @property
    def graph_captures(self) -> int:
        return 0  # no CUDA graphs here

    @property
    def collectives_per_step(self) -> int:
        """One merged gradient reduction per step when replicated, as PopART merges them."""
        return 1 if self.replicas > 1 else 0

    def train_call(self, micro_batches: list[Batch]) -> list[dict]:
        """D optimiser steps over exactly D x A x R micro-batches; one record per step:
        ``loss`` (mean over the step's A x R micro-batches) and ``molecules`` (their count)."""
        steps, accum, replicas = self.device_iterations, self.gradient_accumulation, self.replicas
        per_step = replicas * accum
        factors = {"device_iterations": steps, "replicas": replicas, "gradient_accumulation": accum}
        self._shapes.check_train_call(micro_batches, factors)
        self.model.train()
        records = []
        for step in range(steps):
            group = micro_batches[step * per_step : (step + 1) * per_step]
            merged = 0.0  # becomes [P], the all-reduce buffer
            step_loss = 0.0
            with unwrapped_buffers(self.model):
                for replica in range(replicas):
                    step_loss += self._replica_grads(group[replica::replicas])  # in rotation
                    grads = trainable_grads(self.model)
                    merged = merged + torch.cat([g.reshape(-1) for g in grads])
                unflatten_into(trainable_grads(self.model), merged / per_step)
                popart_adam_step(self.optimizer, self.grad_clip)
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
            loss = self._run("train", lambda batch=batch: self.loss_fn(self.model, batch), batch)
            loss.backward()
            total += loss.detach()
        return float(total)

    @torch.no_grad()
    def predict(self, batch: Batch) -> Tensor:
        """Predictions [G] for one batch, computed once, in eval mode."""
        self._shapes.prediction.check(batch)
        self.model.eval()
        with unwrapped_buffers(self.model):
            return self._run("predict", lambda: self.model(batch), batch)

    def _run(self, kind: str, fn: Callable[[], Tensor], batch: Batch) -> Tensor:
        """``fn()``; the first ``kind`` ("train" / "predict") call runs under the op check,
        with ``batch`` and the model's weights and buffers as the tensors on the IPU."""
        if kind not in self._unchecked:
            return fn()
        self._unchecked.discard(kind)
        on_ipu = [*batch.as_tuple(), *self.model.parameters(), *self.model.buffers()]
        return check_poptorch_ops(fn, on_ipu)

    def optimizer_changed(self) -> None:
        """PopTorch's ``setOptimizer``: the host optimiser is the one used here already."""

    def after_host_weight_load(self) -> None:
        """PopTorch's ``copyWeightsToDevice``: the host weights are the ones used here."""
