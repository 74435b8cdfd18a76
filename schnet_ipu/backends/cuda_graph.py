"""One whole optimiser step recorded once as a CUDA graph and replayed for every batch.

Fixed batch shapes (the backend's ShapeGuard) make this possible: the forward passes,
losses and backward passes of a step's A micro-batches, the replica reduction, gradient
clipping and the Adam update are captured once, and every later step is one
``graph.replay()`` after copying its batches into the static input buffers. This follows
PyTorch's "whole network capture" recipe: warm-up iterations on a side stream, a capturable
optimiser whose learning rate is a device tensor, and no host synchronisation in the step.

With ``backend.compile=true`` the step's forward + loss is a ``torch.compile`` function
(inductor's default mode): dynamo and AOTAutograd compile it, forward and backward, in the
first warm-up step, so the capture records inductor's fused kernels and a replay runs them
with no Python at all; the fixed shapes keep dynamo's guards passing, so nothing recompiles
(``TorchBackend.compiled_graphs`` stays at its warm-up count; ``bench gpu`` reports it).
``mode="reduce-overhead"`` is not used: it records CUDA graphs of its own, which cannot
nest inside this capture, and this one also covers the reduction, clipping and Adam.

    step = CapturedStep(run_step, model, optimizer, device)
    loss = step(device_batches).clone()  # [] on the device, the step's mean loss
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import fields

import torch
from torch import Tensor, nn

from schnet_ipu.batch import Batch
from schnet_ipu.config import ConfigError

WARMUP_STEPS = 3  # the PyTorch docs warm up a few iterations before capturing


def use_cuda_graphs(setting: str, device: str | torch.device) -> bool:
    """Resolve ``backend.cuda_graphs``: ``auto`` is on for CUDA devices and off elsewhere;
    ``true`` on a device that is not CUDA is a configuration error."""
    is_cuda = torch.device(device).type == "cuda"
    if setting == "true" and not is_cuda:
        raise ConfigError(
            f"backend.cuda_graphs=true needs a CUDA device, but the step runs on {device}; "
            "use backend.cuda_graphs=auto (on for CUDA only) or false"
        )
    return is_cuda and setting != "false"


class CapturedStep:
    """``run_step(batches) -> loss []`` captured as one CUDA graph on its first call.

    Args:
        run_step: one optimiser step on device batches (zero_grad, forward, backward,
            reduction, clipping, ``optimizer.step()``), free of host synchronisation.
        model: the module whose parameters ``run_step`` updates.
        optimizer: an Adam-family optimiser; its groups are made capturable with a device
            learning rate (schedulers then update that tensor in place).
        device: the CUDA device the step runs on.

    ``captures`` counts graph captures: 1 after the first step, and it never grows, because
    the backend rejects any batch whose shapes differ from the first one.
    """

    def __init__(
        self,
        run_step: Callable[[list[Batch]], Tensor],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
    ) -> None:
        self.run_step = run_step
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.captures = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[Batch] = []
        self.loss: Tensor | None = None

    def __call__(self, batches: list[Batch]) -> Tensor:
        """Copy ``batches`` (host, pinned or not) into the static inputs and replay the step.

        Returns the step's loss [] as a static device tensor that the next call overwrites.
        """
        if self.graph is None:
            self._capture(batches)
        for i, batch in enumerate(batches):
            copy_batch_(self.inputs[i], batch)
        self.graph.replay()
        return self.loss

    def _capture(self, batches: list[Batch]) -> None:
        """Warm up on a side stream, restore the weights and optimiser state, then capture."""
        make_capturable(self.optimizer, self.device)
        saved = self._snapshot()
        self.inputs = [batch.to(self.device) for batch in batches]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            for _ in range(WARMUP_STEPS):
                self.run_step(self.inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._restore(saved)
        self.graph = torch.cuda.CUDAGraph()
        # captured on the warm-up stream, whose library handles and workspaces exist now;
        # thread_local: loader threads may pin host memory while this thread captures
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            self.loss = self.run_step(self.inputs)
        self.captures += 1

    def _snapshot(self) -> tuple[list[Tensor], dict[Tensor, dict[str, Tensor]]]:
        params = [p.detach().clone() for p in self.model.parameters()]
        state = {
            p: {k: v.clone() for k, v in s.items() if isinstance(v, Tensor)}
            for p, s in self.optimizer.state.items()
        }
        return params, state

    @torch.no_grad()
    def _restore(self, saved: tuple[list[Tensor], dict[Tensor, dict[str, Tensor]]]) -> None:
        """Undo the warm-up steps in place (the graph keeps these tensors): weights back to
        the snapshot, optimiser state back to it, or to zeros (Adam's fresh state: step 0,
        zero moments) where the warm-up created it."""
        params, state = saved
        for i, param in enumerate(self.model.parameters()):
            param.copy_(params[i])
        for param, entries in self.optimizer.state.items():
            for key, value in entries.items():
                if not isinstance(value, Tensor):
                    continue
                if key in state.get(param, {}):
                    value.copy_(state[param][key])
                else:
                    value.zero_()


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Let ``optimizer.step()`` be captured: ``capturable`` groups whose learning rate is a
    tensor on ``device`` (a float would be frozen into the graph; LR schedulers fill the
    tensor in place)."""
    for group in optimizer.param_groups:
        group["capturable"] = True
        group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device)
    for state in optimizer.state.values():  # a resumed state: its step counters on the device
        for key, value in state.items():
            if isinstance(value, Tensor):
                state[key] = value.to(device)


def copy_batch_(static: Batch, batch: Batch) -> None:
    """Copy every tensor of ``batch`` into the device buffers of ``static`` (same
    signature), asynchronously: from pinned memory, or on the device (device-resident)."""
    batch = batch.pin_memory()
    for f in fields(batch):
        source = getattr(batch, f.name)
        if source is not None:
            getattr(static, f.name).copy_(source, non_blocking=True)
