"""IPU backend through PopTorch (Graphcore Poplar SDK); imported only when an IPU is used.

PopTorch compiles the whole step once for the fixed batch signature and runs D x A x R'
micro-batches per host call on the device (R' = this instance's replicas): the host tensors
are the micro-batches concatenated along dim 0 (PopTorch splits dim 0 back into
micro-batches, and PopART hands consecutive ones to the replicas in rotation:
willow/src/stepiosplitter.cpp in github:graphcore/popart, so replica r of a step gets
micro-batches r, r + R', ...), so every tensor has its batch dimension first;
``edge_index`` [2, E] travels as [E, 2].

Semantics, each decided by PopTorch 3.4.0 (github:graphcore/poptorch, tag
sdk/poptorch/3.4.0):

* Gradients are the mean over the A micro-batches and the R replicas
  (``Training.accumulationAndReplicationReductionType(Mean)``, python/options.py), and the
  replicas' all-reduces are merged into one collective per step.
* The optimiser must be a ``poptorch.optim`` one: only those have their device state read
  back on ``detachFromDevice`` and written again on attach
  (``_read_optim_state_dict_if_needed`` / ``_on_device_attach`` in
  python/_poplar_executor.py); a ``torch.optim`` optimiser starts from zero state at every
  re-attach. ``poptorch.optim.Adam`` lowers to ``popart::Adam`` in ``AdamMode::Adam`` (bias
  corrected) with ``WeightDecayMode::L2Regularization`` (popart_compiler/source/
  CompilerImpl.cpp) and clips the global gradient norm with ``max_grad_norm``
  (``ClipNormSettings::clipAllWeights``, same file). PopART adds the L2 term to the
  gradient before it clips (popart willow/src/patterns/adamdecompose.cpp, then
  transforms/clipweightgradientsbynorm.cpp on the decayed gradient), where torch clips
  first: with both on, an IPU run's update differs from a CPU run's (docs/design.md).
* Host-side optimiser changes (the lr schedule) reach the device only through
  ``setOptimizer`` (python/_poplar_executor.py; docs/user_guide/pytorch_to_poptorch.rst):
  :meth:`PoptorchBackend.optimizer_changed` calls it, at most once per host call.
* The inference model is made from the training model (``inferenceModel(training_model)``),
  so PopTorch copies the trained weights to it before each inference call
  (``_host_weights_version`` in ``PoplarExecutor.__call__``;
  docs/user_guide/precompilation.py). Weights loaded on the host (best.pt) reach an attached
  executable only through ``copyWeightsToDevice`` (docs/user_guide/overview.rst, "you also
  need to explicitly copy the weights if you alter an already wrapped model parameter"):
  :meth:`PoptorchBackend.after_host_weight_load`.
* ``optimizer.state_dict()`` of a ``poptorch.optim`` optimiser reads the device state
  (``ipu_state``, ``ipu_param``) back first (``_get_optim_state_dict``), so checkpoints
  hold it; ``load_state_dict`` marks it to be written before the next run
  (python/optim.py ``set_state_dict``), so resume is exact.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import poptorch
import torch
import torch.distributed as dist
from torch import Tensor, nn

from schnet_ipu.backends.distributed import ReplicaInfo
from schnet_ipu.backends.torch_backend import LossFn, ShapeGuards
from schnet_ipu.batch import Batch
from schnet_ipu.config import BackendConfig

log = logging.getLogger(__name__)

OVERLAP_CYCLE_OPTIMIZED = 2  # popart.AccumulateOuterFragmentSchedule.OverlapCycleOptimized


def make_optimizer(
    params, lr: float, weight_decay: float, grad_clip: float, beta2: float
) -> poptorch.optim.Adam:
    """``poptorch.optim.Adam``: Adam with L2 weight decay and bias correction, float32
    gradients and moments, no loss scaling, and the global norm of the decayed gradient
    clipped to ``grad_clip`` on the device (0 = no clipping; PopART decays before it clips,
    torch after).

    Every value is passed explicitly: PopTorch compiles the ones left unset as constants
    (python/optim.py ``_parseArgs``), and a constant lr could not follow the schedule.
    """
    return poptorch.optim.Adam(
        params,
        lr=lr,
        betas=(0.9, beta2),
        weight_decay=weight_decay,
        loss_scaling=1.0,
        accum_type=torch.float32,
        first_order_momentum_accum_type=torch.float32,
        second_order_momentum_accum_type=torch.float32,
        max_grad_norm=grad_clip if grad_clip > 0 else float("inf"),
    )


def make_options(
    backend_cfg: BackendConfig,
    prefetch: int,
    seed: int,
    cache_dir: str = "",
    training: bool = True,
) -> poptorch.Options:
    """PopTorch options for ``backend_cfg``; ``prefetch`` is the host buffering depth P.

    Training replicates R' times (``popdist.poptorch.Options`` under PopRun: this instance's
    replicas, with the instance placed among the others). Inference runs on one IPU with one
    iteration per call, so a batch is computed once, not once per replica; under PopRun each
    instance predicts its own share on its own IPU, so distribution is disabled (a plain
    ``poptorch.Options`` would read OMPI_COMM_WORLD_SIZE/RANK, which poprun's mpirun sets,
    and join the instances: ``_DistributedOptions`` in python/options.py).
    """
    if training and _under_poprun():
        import popdist.poptorch

        options = popdist.poptorch.Options()  # local replicas and instance index from PopRun
    else:
        options = poptorch.Options()
        options.replicationFactor(backend_cfg.replicas if training else 1)
        if not training:
            options.Distributed.disable()
    options.deviceIterations(backend_cfg.device_iterations if training else 1)
    options.randomSeed(seed)
    options.outputMode(poptorch.OutputMode.All)  # one loss per micro-batch, not only the last
    if backend_cfg.device == "ipu-model":
        options.useIpuModel(True)
    if cache_dir:
        options.enableExecutableCaching(cache_dir)
    options._Popart.set("defaultBufferingDepth", prefetch)
    if not training:
        return options
    options.Training.gradientAccumulation(backend_cfg.gradient_accumulation)
    options.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
    if backend_cfg.merge_allreduce:
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


def from_device_tuple(tensors: tuple[Tensor, ...], names: tuple[str, ...]) -> Batch:
    """Inverse of :func:`to_device_tuple` for one micro-batch, inside the compiled model."""
    batch = Batch.from_tuple(tensors, names)
    if batch.edge_index is None:
        return batch
    return replace(batch, edge_index=batch.edge_index.t())


class Step(nn.Module):
    """One micro-batch: ``(pred [G], loss [])`` in training, ``pred [G]`` in eval mode.

    The training and inference executables wrap this one module (and so share its weights);
    ``names`` are the Batch fields the tensors carry, in :meth:`Batch.as_tuple` order.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.names = names

    def forward(self, *tensors: Tensor):
        batch = from_device_tuple(tensors, self.names)
        pred = self.model(batch)
        if not self.training:
            return pred
        loss = self.loss_fn(lambda _batch: pred, batch)
        return pred, poptorch.identity_loss(loss, reduction="none")


class PoptorchBackend:
    """The TorchBackend interface over ``poptorch.trainingModel`` / ``inferenceModel``.

    One process drives all R' replicas of its instance (R' = R without PopRun);
    ``train_call`` takes its D x A x R' micro-batches, device iteration outermost, in the
    order PopTorch splits dim 0. PopART merges the collectives, so ``collectives_per_step``
    is 1 when merged and replicated, 0 without replicas, else None (not counted). The two
    executables are built at the first call, from the first batch's fields. Like PopTorch
    it has no host ``device``: host-side code evaluates on a CPU model of its own.
    """

    def __init__(
        self,
        backend_cfg: BackendConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None,
        replica: ReplicaInfo | None = None,
        prefetch: int = 4,
        seed: int = 0,
        cache_dir: str = "",
    ) -> None:
        if not isinstance(optimizer, poptorch.optim.Optimizer):
            raise TypeError(
                f"the PopTorch backend needs a poptorch.optim optimiser, got "
                f"{type(optimizer).__name__}: a torch.optim one loses its state at every "
                "re-attach (python/_poplar_executor.py _on_device_attach); build it with "
                "schnet_ipu.backends.poptorch_backend.make_optimizer"
            )
        self.replica = replica or ReplicaInfo()
        self.backend_cfg = backend_cfg
        self.model = model
        # host-side autograd (forces in evaluation) runs the host model on the CPU: PopTorch
        # keeps the host copy in sync when it is read (python/_poplar_executor.py)
        self.device = torch.device("cpu")
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.options = make_options(backend_cfg, prefetch, seed, cache_dir)
        self._predict_options = make_options(backend_cfg, prefetch, seed, cache_dir, False)
        self.replicas = self.options.replication_factor  # this instance's replicas
        self._train: poptorch.PoplarExecutor | None = None
        self._predict: poptorch.PoplarExecutor | None = None
        self._shapes = ShapeGuards()

    @property
    def recompilations(self) -> int:
        return self._shapes.recompilations

    @property
    def graph_captures(self) -> int:
        return 0  # no CUDA graphs here

    @property
    def collectives_per_step(self) -> int | None:
        if self.replicas == 1:
            return 0
        return 1 if self.backend_cfg.merge_allreduce else None

    def _build(self, batch: Batch) -> None:
        """Both executables over one Step module, the inference one made from the other."""
        if self._train is not None:
            return
        step = Step(self.model, self.loss_fn, batch.present_fields())
        self._train = poptorch.trainingModel(step, self.options, optimizer=self.optimizer)
        self._predict = poptorch.inferenceModel(self._train, self._predict_options)
        self._predict.model.eval()  # the inference copy returns predictions only

    def train_call(self, micro_batches: list[Batch]) -> list[dict]:
        """D optimiser steps on this instance's D x A x R' micro-batches; one record per step:
        ``loss`` (mean over the step's micro-batches of every instance: under PopRun one
        gloo all-reduce per host call) and ``molecules`` (this instance's count)."""
        steps = self.backend_cfg.device_iterations
        factors = {"device_iterations": steps, "replicas": self.replicas,
                   "gradient_accumulation": self.backend_cfg.gradient_accumulation}  # fmt: skip
        self._shapes.check_train_call(micro_batches, factors)
        self._build(micro_batches[0])
        _swap_onto_device(self._predict, self._train)
        _, losses = self._train(*to_device_tuple(micro_batches))
        per_step = losses.reshape(steps, -1).mean(dim=1).float()
        if self.replica.world_size > 1:  # PopRun: the job's loss, not this instance's
            dist.all_reduce(per_step, op=dist.ReduceOp.SUM)
            per_step /= self.replica.world_size
        molecules = [b.num_molecules for b in micro_batches]
        per = len(micro_batches) // steps
        return [
            {
                "loss": loss,
                "molecules": sum(molecules[i * per : (i + 1) * per]),
                "collectives": self.collectives_per_step,
            }
            for i, loss in enumerate(per_step.tolist())
        ]

    def predict(self, batch: Batch) -> Tensor:
        """Predictions [G] for one batch, computed once on one IPU."""
        self._shapes.prediction.check(batch)
        self._build(batch)
        _swap_onto_device(self._train, self._predict)
        return self._predict(*to_device_tuple([batch]))

    def optimizer_changed(self) -> None:
        """Send the host optimiser's settings (the scheduled lr) to the device; PopTorch
        uploads only what changed, before the next run."""
        if self._train is not None:
            self._train.setOptimizer(self.optimizer)

    def after_host_weight_load(self) -> None:
        """Copy host weights (just loaded, e.g. best.pt) to every attached executable; a
        detached one copies them when it attaches (``_on_device_attach``)."""
        for executor in (self._train, self._predict):
            if executor is not None and executor.isAttachedToDevice():
                executor.copyWeightsToDevice()


def _swap_onto_device(leaving: poptorch.PoplarExecutor, coming: poptorch.PoplarExecutor) -> None:
    """Training and inference executables take turns on the same IPUs. Detaching the
    training one reads its weights and optimiser state back to the host; attaching one
    writes the host weights (and a poptorch optimiser's state) to the device."""
    if leaving.isCompiled() and leaving.isAttachedToDevice():
        leaving.detachFromDevice()
    if coming.isCompiled() and not coming.isAttachedToDevice():
        coming.attachToDevice()
