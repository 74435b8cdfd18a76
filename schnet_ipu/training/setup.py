"""A run's components from its config and data: model, optimiser, schedule, task, backend.

    model, optimizer, backend, task = make_trainer(cfg, data, replica, device)
    task = make_task(cfg, data)     # the objective, its scales from the training split

The training loop (:mod:`schnet_ipu.training.loop`), evaluation
(:mod:`schnet_ipu.training.evaluation`)
and the benchmarks build their components here, so they all train the same thing.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from schnet_ipu.backends import Backend, TorchBackend, make_backend, select_device
from schnet_ipu.backends.distributed import ReplicaInfo
from schnet_ipu.config import IPU_DEVICES, Config, ConfigError, OptimConfig, config_from_dict
from schnet_ipu.data import MoleculeStore
from schnet_ipu.errors import CheckpointError
from schnet_ipu.inference.model_file import ModelSpec
from schnet_ipu.model import SchNet
from schnet_ipu.task import EnergyForceTask, EnergyTask, TargetTransform, Task
from schnet_ipu.training.budget import Budget
from schnet_ipu.training.data import PreparedData

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])  # (2, 13)


def make_trainer(
    cfg: Config, data: PreparedData, replica: ReplicaInfo | None = None, device: str = "cpu"
) -> tuple[SchNet, torch.optim.Optimizer, Backend, EnergyTask | EnergyForceTask]:
    """Model (initialised from ``cfg.seed``), optimiser, backend with the task's loss, and
    the task: the trainer's own setup, which the benchmarks reuse."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, data)
    optimizer = make_optimizer(cfg, model, device)
    task = make_task(cfg, data)
    backend = make_backend(
        cfg.backend,
        model,
        optimizer,
        task.loss,
        cfg.optim.grad_clip,
        replica,
        device,
        seed=cfg.seed,
        prefetch=cfg.loader.prefetch,
        cache_dir=cfg.backend.executable_cache or str(Path(cfg.logging.run_dir) / "executables"),
    )
    if cfg.optim.forces_weight > 0 and not isinstance(backend, TorchBackend):
        raise ConfigError("optim.forces_weight > 0 needs a cpu or cuda backend (no PopTorch)")
    return model, optimizer, backend, task


def build_model(cfg: Config, data: PreparedData) -> SchNet:
    """SchNet whose atom reference is the dressed-atom fit, scaled to the residual spread;
    the ipu op flavour on ``ipu`` and ``ipu-model`` devices."""
    atom_scale = data.residual_std / math.sqrt(data.mean_atoms())
    model_cfg = cfg.model
    on_ipu = cfg.backend.device in IPU_DEVICES
    if on_ipu or (cfg.backend.device == "auto" and select_device("auto") == "ipu"):
        # the IPU (also when auto finds one) and its emulator: mapped ops only
        model_cfg = dataclasses.replace(model_cfg, ops="ipu")
    return SchNet.from_config(
        model_cfg,
        max_nodes_per_pack=data.train_plan.max_nodes,
        mean=0.0,
        std=atom_scale,
        atomref=torch.tensor(data.dressed_atoms, dtype=torch.float32),
    )


def model_spec(cfg: Config, data: PreparedData, model: SchNet, task: Task) -> ModelSpec:
    """The :class:`~schnet_ipu.inference.model_file.ModelSpec` every checkpoint of this run
    holds."""
    plan = data.train_plan
    model_cfg = dataclasses.replace(cfg.model, ops=model.ops.name)
    seen = data.counts[data.split["train"]].totals()
    return ModelSpec(
        model=dataclasses.asdict(model_cfg),
        max_nodes_per_pack=int(model.max_nodes_per_pack or plan.max_nodes),
        mean=float(model.mean),
        std=float(model.std),
        task=task.to_dict(),
        unit=data.unit,
        forces_unit=data.store.forces_unit or f"{data.unit}/Angstrom",
        target=cfg.data.target,
        pack={
            "max_nodes": int(plan.max_nodes),
            "max_graphs": int(plan.max_graphs),
            "max_edges": None if plan.max_edges is None else int(plan.max_edges),
            "packs_per_batch": cfg.packing.packs_per_batch,
        },
        elements=[int(z) for z in np.flatnonzero(seen)],
    )


def make_task(cfg: Config, data: PreparedData) -> EnergyTask | EnergyForceTask:
    """The run's task: references and scales from the training split (force and stress
    scales from its frames that carry them); forces scored when the store has them, trained
    with ``optim.forces_weight > 0``. A force or stress weight > 0 with no training frame
    carrying that label is a ConfigError."""
    atomref = data.store.atomref(cfg.data.target)
    reference = np.zeros_like(data.dressed_atoms)  # [119], indexed by atomic number
    if cfg.data.atomrefs and atomref is not None:
        reference[: len(atomref)] = atomref
    transform = TargetTransform(tuple(reference.tolist()), data.residual_std)
    if cfg.optim.stress_weight > 0 and not data.store.has_stress:
        raise ConfigError(
            f"optim.stress_weight > 0, but {data.store.path} holds no stress; import frames "
            "with stress (atoms.info['stress'] or the calculator's) or set optim.stress_weight=0"
        )
    if not data.store.has_forces:
        for key in ("forces_weight", "stress_weight"):
            if getattr(cfg.optim, key) > 0:
                raise ConfigError(f"optim.{key} > 0, but {data.store.path} holds no forces")
        return EnergyTask(transform, cfg.optim.energy_loss)
    train = data.split["train"]
    forces_frames = train[data.store.forces_mask()[train]]
    _check_labelled(cfg.optim.forces_weight, "forces", forces_frames, data)
    scale = force_rms(data.store, forces_frames)  # forces are scored even at weight 0
    stress_scale = None
    if data.store.has_stress:
        stress_frames = train[data.store.stress_mask()[train]]
        _check_labelled(cfg.optim.stress_weight, "stress", stress_frames, data)
        stress = data.store.stress()[stress_frames]
        stress_scale = float(np.sqrt(np.mean(stress**2))) if len(stress) else 0.0
        stress_scale = stress_scale or 1.0  # no training frame with stress, or all zero
    return EnergyForceTask(
        transform,
        scale,
        cfg.optim.forces_weight,
        stress_scale,
        cfg.optim.stress_weight,
        cfg.optim.energy_loss,
    )


def _check_labelled(weight: float, label: str, frames: np.ndarray, data: PreparedData) -> None:
    """ConfigError when ``weight`` > 0 trains ``label`` but no training frame carries it
    (``frames``: those that do)."""
    if weight > 0 and not len(frames):
        key = "forces_weight" if label == "forces" else "stress_weight"
        raise ConfigError(
            f"optim.{key} > 0, but no frame of the training split of {data.store.path} "
            f"carries {label} ({len(data.split['train'])} frames); set optim.{key}=0 or "
            f"import frames with {label}"
        )


def force_rms(store: MoleculeStore, molecules: np.ndarray) -> float:
    """RMS force component over the atoms of ``molecules`` [M] (the force loss scale; those
    that carry forces); 1 when there are none."""
    if not len(molecules):
        return 1.0
    atoms = np.concatenate(
        [np.arange(store.offsets[i], store.offsets[i + 1]) for i in molecules.tolist()]
    )
    forces = store.forces()[atoms].astype(np.float64)
    return float(np.sqrt(np.mean(forces**2))) or 1.0


def peak_lr(oc: OptimConfig) -> float:
    """The run's peak learning rate: ``optim.lr``, or for a budget longer than
    ``optim.lr_reference_minutes`` (the budget ``optim.lr`` was measured best at) ``optim.lr *
    sqrt(reference / max_minutes)``: longer runs stay near the peak for more steps, and a peak
    that is best for 10 minutes diverges or overshoots over 30 (``configs/qm9.yaml``)."""
    reference, budget = oc.lr_reference_minutes, oc.max_minutes
    if reference <= 0 or budget <= reference:
        return oc.lr
    return oc.lr * math.sqrt(reference / budget)


def make_optimizer(cfg: Config, model: torch.nn.Module, device: str) -> torch.optim.Adam:
    """Adam, as in the paper; on CPU and CUDA its fused kernel (the same update in one pass
    over the parameters, 5x faster than the per-tensor loop for SchNet on a CPU; torch
    before 2.4, the Poplar SDK's 2.0.1, has no fused CPU kernel and raises if asked); on the
    IPU PopTorch's, which keeps its state on the device and clips there."""
    if device in IPU_DEVICES:
        from schnet_ipu.backends.poptorch_backend import make_optimizer as make_ipu_optimizer

        oc = cfg.optim
        return make_ipu_optimizer(
            model.parameters(), peak_lr(oc), oc.weight_decay, oc.grad_clip, oc.adam_beta2
        )
    return torch.optim.Adam(
        model.parameters(),
        lr=peak_lr(cfg.optim),
        betas=(0.9, cfg.optim.adam_beta2),
        weight_decay=cfg.optim.weight_decay,
        fused=device == "cuda" or (device == "cpu" and TORCH_VERSION >= (2, 4)),
    )


def make_scheduler(
    cfg: Config,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    budget: Budget | None = None,
):
    """plateau: decay on validation MAE per epoch; cosine: warmup (steps) then cosine over
    the epochs' steps, or over the budget's time when ``optim.max_minutes`` is set."""
    oc = cfg.optim
    if oc.schedule == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, factor=oc.plateau_factor, patience=oc.plateau_patience, min_lr=oc.min_lr
        )
    total = max(oc.epochs * steps_per_epoch, 1)
    floor = min(oc.min_lr / peak_lr(oc), 1.0)

    def factor(step: int) -> float:
        if oc.schedule == "constant":
            return 1.0
        if step < oc.warmup_steps:
            return (step + 1) / oc.warmup_steps
        if budget is not None and budget.total > 0:
            progress = budget.fraction()
        else:
            progress = min((step - oc.warmup_steps) / max(total - oc.warmup_steps, 1), 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def restore_config(state: dict[str, Any], path: Path) -> Config:
    """The training config a checkpoint holds, for one process (evaluation, prediction)."""
    try:
        cfg = config_from_dict(state["config"])
    except ConfigError as err:
        raise CheckpointError(f"{path}: the config it holds is not valid here: {err}") from err
    cfg.backend.replicas = 1
    cfg.loader.workers = 0
    return cfg
