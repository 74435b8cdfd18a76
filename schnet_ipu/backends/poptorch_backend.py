"""IPU backend through PopTorch (Graphcore Poplar SDK); imported only when an IPU is used.

PopTorch compiles the whole step once for the fixed batch signature and runs D x A x R
micro-batches per host call on the device: the host tensors are the micro-batches
concatenated along dim 0 (PopTorch splits dim 0 back into micro-batches), so every tensor
must have its batch dimension first; ``edge_index`` [2, E] travels as [E, 2]. Gradients are
averaged over the A micro-batches and the R replicas (PopTorch's default Mean reduction),
and the replicas' all-reduces are merged into one collective per step.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import poptorch
import torch
from torch import Tensor, nn

from schnet_ipu.backends.distributed import ReplicaInfo
from schnet_ipu.backends.torch_backend import LossFn, ShapeGuard
from schnet_ipu.batch import Batch
from schnet_ipu.config import BackendConfig

log = logging.getLogger(__name__)

OVERLAP_CYCLE_OPTIMIZED = 2  # popart.AccumulateOuterFragmentSchedule.OverlapCycleOptimized


def make_options(
    backend_cfg: BackendConfig, prefetch: int, seed: int, training: bool = True
) -> poptorch.Options:
    """PopTorch options for ``backend_cfg``; ``prefetch`` is the host buffering depth P."""
    if _under_poprun():
        import popdist.poptorch

        options = popdist.poptorch.Options()  # replicas and instance index from PopRun
    else:
        options = poptorch.Options()
        options.replicationFactor(backend_cfg.replicas)
    options.deviceIterations(backend_cfg.device_iterations if training else 1)
    options.randomSeed(seed)
    options.outputMode(poptorch.OutputMode.All)  # one loss per micro-batch, not only the last
    if backend_cfg.device == "ipu-model":
        options.useIpuModel(True)
    if training:
        options.Training.gradientAccumulation(backend_cfg.gradient_accumulation)
    options._Popart.set("defaultBufferingDepth", prefetch)
    if training and backend_cfg.merge_allreduce:
        options._Popart.set(
            "replicatedCollectivesSettings.prepareScheduleForMergingCollectives", True
        )
        options._Popart.set("replicatedCollectivesSettings.mergeAllReduceCollectives", True)
        options._Popart.set("accumulateOuterFragmentSettings.schedule", OVERLAP_CYCLE_OPTIMIZED)
    return options


def _under_poprun() -> bool:
    try:
        import popdist
    except ImportError:
        return False
    return popdist.isPopdistEnvSet()


def to_device_tuple(micro_batches: list[Batch]) -> tuple[Tensor, ...]:
    """Concatenate micro-batches along dim 0 (no re-offsetting: PopTorch splits them again).

    Each field becomes [K * n, ...] for K micro-batches; ``edge_index`` is sent as [K * E, 2].
    """
    tuples = [_batch_first(b).as_tuple() for b in micro_batches]
    return tuple(torch.cat(parts) for parts in zip(*tuples))


def _batch_first(batch: Batch) -> Batch:
    if batch.edge_index is None:
        return batch
    return replace(batch, edge_index=batch.edge_index.t().contiguous())


def from_device_tuple(tensors: tuple[Tensor, ...]) -> Batch:
    """Inverse of :func:`to_device_tuple` for one micro-batch, inside the compiled model."""
    batch = Batch.from_tuple(tensors)
    if batch.edge_index is None:
        return batch
    return replace(batch, edge_index=batch.edge_index.t())


class TrainStep(nn.Module):
    """``forward(*tensors) -> (pred [G], loss [])``: the model and loss on one micro-batch."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *tensors: Tensor) -> tuple[Tensor, Tensor]:
        batch = from_device_tuple(tensors)
        pred = self.model(batch)
        loss = self.loss_fn(lambda _batch: pred, batch)
        return pred, poptorch.identity_loss(loss, reduction="none")


class PredictStep(nn.Module):
    """``forward(*tensors) -> pred [G]`` for one micro-batch."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *tensors: Tensor) -> Tensor:
        return self.model(from_device_tuple(tensors))


class PoptorchBackend:
    """The TorchBackend interface over ``poptorch.trainingModel`` / ``inferenceModel``.

    One process drives all R' replicas of its instance (R' = R without PopRun);
    ``train_call`` takes its D x R' x A micro-batches, device iteration outermost, in the
    order PopTorch splits dim 0. PopART merges the collectives, so ``collectives_per_step``
    is 1 when merged and replicated, 0 without replicas, else None (not counted).
    """

    def __init__(
        self,
        backend_cfg: BackendConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        grad_clip: float = 0.0,
        replica: ReplicaInfo | None = None,
        prefetch: int = 4,
        seed: int = 0,
    ) -> None:
        if grad_clip > 0:
            log.warning(
                "grad_clip=%s is not applied by the PopTorch backend; clip with the "
                "optimizer (poptorch.optim max_grad_norm) instead",
                grad_clip,
            )
        self.replica = replica or ReplicaInfo()
        self.backend_cfg = backend_cfg
        self.options = make_options(backend_cfg, prefetch, seed)
        self.replicas = self.options.replication_factor
        self._train = poptorch.trainingModel(
            TrainStep(model, loss_fn), self.options, optimizer=optimizer
        )
        self._predict = poptorch.inferenceModel(
            PredictStep(model), make_options(backend_cfg, prefetch, seed, training=False)
        )
        self._train_guard = ShapeGuard("training")
        self._predict_guard = ShapeGuard("prediction")

    @property
    def recompilations(self) -> int:
        return self._train_guard.recompilations + self._predict_guard.recompilations

    @property
    def collectives_per_step(self) -> int | None:
        if self.replicas == 1:
            return 0
        return 1 if self.backend_cfg.merge_allreduce else None

    def train_call(self, micro_batches: list[Batch] | tuple[Tensor, ...]) -> list[dict]:
        """D optimiser steps on this instance's micro-batches; one record per step.

        Takes the D x R' x A micro-batches as a list, or already concatenated by
        :func:`to_device_tuple` (what :func:`make_poptorch_loader` yields).
        """
        steps = self.backend_cfg.device_iterations
        if isinstance(micro_batches, list):
            expected = steps * self.backend_cfg.gradient_accumulation * self.replicas
            if len(micro_batches) != expected:
                raise ValueError(
                    f"train_call needs device_iterations x replicas x gradient_accumulation = "
                    f"{expected} micro-batches, got {len(micro_batches)}"
                )
            micro_batches = to_device_tuple(micro_batches)
        host = Batch.from_tuple(micro_batches)  # every micro-batch, concatenated
        self._train_guard.check(host)
        _swap_onto_device(self._predict, self._train)
        _, losses = self._train(*micro_batches)
        per_step = losses.reshape(steps, -1).mean(dim=1).tolist()
        molecules = host.graph_mask.reshape(steps, -1).sum(dim=1).tolist()
        return [
            {"loss": loss, "molecules": count, "collectives": self.collectives_per_step}
            for loss, count in zip(per_step, molecules)
        ]

    def predict(self, batch: Batch) -> Tensor:
        """Predictions [G] for one batch (run on every replica; the first copy is returned)."""
        self._predict_guard.check(batch)
        _swap_onto_device(self._train, self._predict)
        pred = self._predict(*to_device_tuple([batch] * self.replicas))
        return pred.reshape(self.replicas, -1)[0]


def _swap_onto_device(leaving: poptorch.PoplarExecutor, coming: poptorch.PoplarExecutor) -> None:
    """Training and inference executables take turns on the same IPUs."""
    if leaving.isCompiled() and leaving.isAttachedToDevice():
        leaving.detachFromDevice()
    if coming.isCompiled() and not coming.isAttachedToDevice():
        coming.attachToDevice()


def make_poptorch_loader(
    options: poptorch.Options, dataset: torch.utils.data.Dataset, workers: int, prefetch: int
) -> poptorch.DataLoader:
    """``poptorch.DataLoader`` over a dataset whose items are single micro-batches (Batch).

    Each element is one host call's D x R x A items concatenated by :func:`to_device_tuple`
    (pass it to ``train_call``), loaded asynchronously with a buffer of ``prefetch`` calls.
    """
    return poptorch.DataLoader(
        options,
        dataset,
        batch_size=1,
        shuffle=False,  # the pack assignment already shuffles per epoch
        num_workers=workers,
        collate_fn=to_device_tuple,
        mode=poptorch.DataLoaderMode.Async,
        async_options={"buffer_size": prefetch, "early_preload": True},
    )
