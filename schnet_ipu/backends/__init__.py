"""Backends: turn a model, optimiser and loss into fixed-shape training and prediction steps.

    device = select_device(cfg.backend.device)
    replica = init_replica(cfg.backend, device)
    backend = make_backend(cfg.backend, model, optimizer, loss_fn, cfg.optim.grad_clip, replica)
    records = backend.train_call(micro_batches)  # D x A batches -> D step records
    pred = backend.predict(batch)  # [G]

``ipu`` and ``ipu-model`` (with PopTorch) run through :mod:`.poptorch_backend`; ``ipu-model``
without PopTorch through :mod:`.ipu_emulator` (the CPU emulation of PopTorch's execution
model: one process drives R replicas, fixed shapes, device iterations, accumulation, one
merged gradient reduction; its first training step and first prediction refuse, by name, any
aten op PopTorch 3.4.0 cannot lower, :mod:`.poptorch_ops`); ``cpu`` and ``cuda`` through
:class:`TorchBackend` (one process per replica).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Protocol

import torch
from torch import Tensor, nn

from schnet_ipu.backends.cuda_graph import use_cuda_graphs
from schnet_ipu.backends.distributed import (
    ReplicaInfo,
    init_replica,
    launch_replicas,
    processes_for,
    replicas_in_call,
)
from schnet_ipu.backends.torch_backend import LossFn, RecompilationError, TorchBackend
from schnet_ipu.batch import Batch
from schnet_ipu.config import IPU_DEVICES, BackendConfig, ConfigError
from schnet_ipu.errors import UserError

log = logging.getLogger(__name__)

__all__ = [
    "Backend",
    "DeviceError",
    "RecompilationError",
    "ReplicaInfo",
    "TorchBackend",
    "init_replica",
    "launch_replicas",
    "make_backend",
    "poptorch_available",
    "processes_for",
    "replicas_in_call",
    "select_device",
]


class Backend(Protocol):
    """What the training loop, evaluation and the benchmarks use of a backend
    (:class:`TorchBackend`, ``IpuEmulatorBackend``, ``PoptorchBackend``)."""

    model: nn.Module  # the host model (its weights are the trained ones between host calls)
    device: torch.device  # where host-side autograd (forces) runs the model: CPU for PopTorch

    def train_call(self, micro_batches: list[Batch]) -> list[dict]:
        """D x A micro-batches of this replica -> D step records (loss, molecules, ...)."""

    def predict(self, batch: Batch) -> Tensor:
        """Predictions [G] of one batch."""

    def optimizer_changed(self) -> None:
        """The learning rate changed on the host (PopTorch: setOptimizer)."""

    def after_host_weight_load(self) -> None:
        """Weights were loaded on the host (PopTorch: copy them to the device)."""

    @property
    def recompilations(self) -> int:
        """Batches refused for a shape change (each would have cost a recompilation)."""

    @property
    def collectives_per_step(self) -> int | None:
        """Gradient all-reduces per optimiser step (None where PopTorch decides)."""

    @property
    def graph_captures(self) -> int:
        """CUDA graph captures so far (more than one means a re-capture); 0 elsewhere."""


class DeviceError(UserError, RuntimeError):
    """The requested device cannot be used here."""


def poptorch_available() -> bool:
    """True when the Graphcore Poplar SDK's PopTorch can be imported."""
    return importlib.util.find_spec("poptorch") is not None


def select_device(name: str) -> str:
    """Resolve ``backend.device`` to what will run: "ipu", "ipu-model", "cuda" or "cpu".

    ``auto`` prefers IPU hardware (PopTorch importable and an IPU attached), then CUDA, then
    CPU. ``ipu-model`` without PopTorch becomes "cpu", the CPU emulation, with a notice.
    """
    if name == "auto":
        if poptorch_available():
            import poptorch

            if poptorch.ipuHardwareIsAvailable():
                return "ipu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "ipu" and not poptorch_available():
        raise DeviceError(
            "backend.device=ipu needs PopTorch, which ships with the Graphcore Poplar SDK and "
            "is not on PyPI: enable the SDK and install its poptorch wheel, or use "
            "backend.device=ipu-model (CPU emulation) / cpu / cuda"
        )
    if name == "ipu-model" and not poptorch_available():
        log.warning(
            "backend.device=ipu-model: PopTorch not installed, emulating the IPU execution "
            "model on CPU (fixed shapes, replicas, device iterations, accumulation, merged "
            "all-reduce)"
        )
        return "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("backend.device=cuda but torch sees no CUDA device; use cpu or auto")
    return name


def resolve_precision(setting: str, device: str) -> str:
    """``backend.precision`` as run on ``device`` ("cpu", "cuda", or an IPU one): ``auto`` is
    bf16 on a CPU with bf16 dot-product instructions (:func:`cpu_multiplies_bf16`), where
    its matmuls run ~3x faster than fp32 (a QM9 step 1.6x), and fp32 elsewhere: on a CPU
    without them bf16 is emulated, GPUs have not measured it against fp32 yet, and PopTorch
    takes fp32 only."""
    if setting != "auto":
        return setting
    precision = "bf16" if device == "cpu" and cpu_multiplies_bf16() else "fp32"
    log.info("backend.precision=auto: %s on %s", precision, device)
    return precision


def cpu_multiplies_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has bf16 dot-product instructions: x86 AVX512-BF16 or AMX-BF16, or
    Arm's BF16, by the flags of ``cpuinfo`` (Linux's /proc/cpuinfo when None; False where
    there is none to read)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as file:
                cpuinfo = file.read()
        except OSError:
            return False
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def make_backend(
    backend_cfg: BackendConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    grad_clip: float = 0.0,
    replica: ReplicaInfo | None = None,
    device: str | None = None,
    seed: int = 0,
    prefetch: int = 4,
    cache_dir: str = "",
) -> Backend:
    """The backend for ``backend_cfg`` (device resolved with :func:`select_device` if not given).

    ``seed``, ``prefetch`` (the host-to-device buffering depth) and ``cache_dir`` (the
    executable cache) are used by PopTorch, which clips gradients in its optimiser.

    Returns a :class:`TorchBackend`, an ``IpuEmulatorBackend`` or a ``PoptorchBackend``: each
    a :class:`Backend`.
    """
    device = device or select_device(backend_cfg.device)
    emulated = backend_cfg.device == "ipu-model"  # PopTorch's rules on the CPU
    precision = resolve_precision(backend_cfg.precision, "ipu" if emulated else device)
    if precision != "fp32" and (device in IPU_DEVICES or emulated):
        raise ConfigError("backend.precision applies to cpu and cuda; use fp32 with PopTorch")
    if device in IPU_DEVICES:
        from schnet_ipu.backends.poptorch_backend import PoptorchBackend

        return PoptorchBackend(
            backend_cfg, model, optimizer, loss_fn, replica, prefetch, seed, cache_dir
        )
    if emulated:  # no PopTorch: emulate it on the CPU
        from schnet_ipu.backends.ipu_emulator import IpuEmulatorBackend

        return IpuEmulatorBackend(
            model,
            optimizer,
            loss_fn,
            replicas=backend_cfg.replicas // (replica or ReplicaInfo()).world_size,
            device_iterations=backend_cfg.device_iterations,
            gradient_accumulation=backend_cfg.gradient_accumulation,
            grad_clip=grad_clip,
        )
    return TorchBackend(
        model,
        optimizer,
        loss_fn,
        device=device,
        device_iterations=backend_cfg.device_iterations,
        gradient_accumulation=backend_cfg.gradient_accumulation,
        merge_allreduce=backend_cfg.merge_allreduce,
        shared_memory_allreduce=backend_cfg.shared_memory_allreduce,
        compile=backend_cfg.compile,
        grad_clip=grad_clip,
        replica=replica,
        precision=precision,
        cuda_graphs=use_cuda_graphs(backend_cfg.cuda_graphs, device),
    )
