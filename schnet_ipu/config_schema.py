"""The configuration's keys: one dataclass per section, with every default and the values a
key may take (:data:`CHOICES`, :data:`POSITIVE`, :data:`NON_NEGATIVE`).

Reading a YAML file, overrides and the checks live in :mod:`schnet_ipu.config`, which
re-exports these names; this module only declares. ``device in IPU_DEVICES`` is the one test
for a ``backend.device`` (or a resolved device) that runs through PopTorch or its emulation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from schnet_ipu.errors import UserError

IPU_DEVICES = ("ipu", "ipu-model")  # backend.device values for PopTorch (or its emulation)

# keys that were removed: user input naming one is refused with what to set instead
REMOVED_KEYS = {
    "logging.wandb": "set logging.wandb_mode=offline (or online) to log to wandb",
    "loader.cache": "remove it: the feed reads the store's whole arrays and caches nothing",
}


class ConfigError(UserError, ValueError):
    """A configuration that cannot run, with a message saying what to change."""


@dataclass
class DataConfig:
    source: str = "qm9"  # qm9 (from qm9pack) | qm9-raw (PyG raw files) | hydronet | water | ase
    path: str = "data/qm9.h5"  # the HDF5 molecule store; imported from `source` if missing
    raw_dir: str = ""  # folder of raw files for qm9-raw and hydronet
    hydronet_subset: str = "small"  # small (500k sample) | medium (W3-W25) | large (W3-W30)
    water_clusters: int = 2000  # synthetic water: number of clusters
    water_sizes: list[int] = field(default_factory=lambda: [3, 30])  # min, max waters
    water_distribution: str = "uniform"  # sizes: uniform | hydronet (HydroNet's shares)
    water_templates: int = 0  # 0: relax every cluster; N: sample around N relaxed per size
    files: list[str] = field(default_factory=list)  # ase: files ase.io.read reads (extxyz, db)
    energy_key: str = "energy"  # ase: atoms.info key (or calculator result) of the energy
    forces_key: str = "forces"  # ase: atoms.arrays key (or calculator result) of the forces
    target: str = "U0"  # target name in the store
    atomrefs: bool = True  # subtract per-element reference energies (atomization energy)
    subset: int = 0  # use only this many molecules (random, from the seed); 0 = all
    val: float = 0.1  # validation share: a fraction (< 1) or a count (>= 1)
    test: float = 0.1  # test share: a fraction (< 1) or a count (>= 1)
    split_seed: int = -1  # seed of the split (and subset); -1 = the run's seed. Members of an
    # ensemble: different seeds, one split_seed, so that no member trains on the others' test set


@dataclass
class PackingConfig:
    algorithm: str = "tuple"  # tuple (atoms and edges) | lpfhp (atoms) | pad_to_max
    max_nodes: int = 0  # atoms per pack; 0 = smallest limit reaching target_efficiency
    max_edges: int = 0  # directed edges per pack (radius graphs); 0 = search
    max_graphs: int = 0  # molecules per pack; 0 = derived from the data
    packs_per_batch: int = 8  # B: packs in one micro-batch
    target_efficiency: float = 0.97  # for the automatic limit search
    heuristic: str = "sum"  # tuple packing: sum | product | max | min | nodes | edges
    replica_balance: str = "none"  # none | cost_model (group micro-batches of like cost per step)


@dataclass
class LoaderConfig:
    workers: int = 0  # threads assembling batch chunks ahead; 0 = only while the step waits
    prefetch: int = 4  # chunks assembled ahead (threads), batches copied ahead (CUDA)
    device_resident: str = "auto"  # auto | true | false: assemble batches on the device
    # each replica reads and trains on a fixed share of every split (whole packs; its atoms
    # only: less memory per host); false: all read the store, packs dealt anew each epoch
    shard: bool = False


@dataclass
class ModelConfig:
    hidden_channels: int = 100
    num_filters: int = 100
    num_interactions: int = 4
    num_gaussians: int = 25
    cutoff: float = 6.0
    graph: str = "radius"  # radius (precomputed edges) | knn (on device, per pack)
    k: int = 24  # neighbours per atom for knn graphs
    readout: str = "sum"  # sum | mean
    pair_symmetric: bool = True  # radius graphs: one filter per unordered pair
    stable_softplus: bool = True  # False = naive log(1 + exp(x)) - log 2, for the ablation
    ops: str = "torch"  # op flavour: torch (CPU/CUDA) | ipu (PopTorch-mapped; ipu devices force it)
    message_passing: str = "sparse"  # sparse (edge lists) | dense ([M, M] pair blocks per pack)
    filter: str = "table"  # table (per block on a grid, cubic Hermite) | exact (network per edge)
    filter_points: int = 256  # grid points K of filter=table on [0, cutoff]


@dataclass
class OptimConfig:
    epochs: int = 100
    lr: float = 1e-3  # peak learning rate; > 0 lr_reference_minutes: at budgets up to those
    lr_reference_minutes: float = 0.0  # longer budgets peak at lr * sqrt(ref / max_minutes)
    schedule: str = "plateau"  # plateau | cosine | constant
    warmup_steps: int = 0  # cosine: linear warmup steps
    plateau_patience: int = 5  # plateau: epochs without improvement before decay
    plateau_factor: float = 0.5
    min_lr: float = 1e-5
    grad_clip: float = 10.0  # max gradient norm; 0 = off
    weight_decay: float = 0.0
    adam_beta2: float = 0.999  # decay of Adam's second moments (its memory: ~1 / (1 - beta2) steps)
    forces_weight: float = 0.0  # weight of the standardised force loss; 0 = energies only
    stress_weight: float = 0.0  # weight of the standardised stress loss (stores with stress)
    max_minutes: float = 0.0  # wall-clock budget of the training loop; 0 = off (epochs only)
    energy_loss: str = "mse"  # mse | l1: the energy term of the loss (the metric is the MAE)
    ema_decay: float = 0.0  # average of the weights for validation, test and model files; 0 = off
    # divergence guard (training/guard.py): a read of the step losses (every logging.log_every
    # host calls) above spike_factor x the median of the last spike_window reads, or a
    # validation loss above spike_factor x the median of the last spike_window validations,
    # rolls back to the last good weights and optimiser state (kept in memory) and multiplies
    # the lr by spike_lr_factor, which climbs back over spike_lr_recovery_steps (after the
    # k-th rollback to spike_lr_factor^(k-1) of the schedule; 0 = lowered for good); a spike
    # after spike_rollbacks rollbacks stops the run (exit 2, best.pt kept)
    spike_guard: bool = True
    spike_factor: float = 10.0
    spike_window: int = 20
    spike_lr_factor: float = 0.5
    spike_lr_recovery_steps: int = 1000
    spike_rollbacks: int = 4
    beat_baseline: bool = True  # exit 2 unless the test MAE beats the dressed-atom baseline


@dataclass
class BackendConfig:
    device: str = "auto"  # auto | cpu | cuda | ipu | ipu-model
    replicas: int = 1  # data-parallel replicas (processes)
    device_iterations: int = 1  # optimiser steps per host call
    gradient_accumulation: int = 1  # micro-batches per optimiser step
    merge_allreduce: bool = True  # one all-reduce over a flat buffer per step
    shared_memory_allreduce: bool = True  # CPU replicas spawned on one host: no gloo
    compile: bool = False  # torch.compile the step for the fixed batch signature
    threads: int = 0  # CPU threads per training process; 0 = torch's default
    dist_backend: str = "auto"  # auto (gloo on cpu, nccl on cuda) | gloo | nccl
    executable_cache: str = ""  # PopTorch executable cache; "" = <run_dir>/executables
    cuda_graphs: str = "auto"  # whole step as one CUDA graph: auto (on for cuda) | true | false
    precision: str = "fp32"  # fp32 | tf32 (CUDA matmuls) | bf16 (autocast, fp32 weights)
    # | auto (bf16 on a CPU with bf16 dot products, else fp32)


@dataclass
class LoggingConfig:
    run_dir: str = "runs/qm9"
    log_every: int = 20  # steps between step records in metrics.jsonl
    progress: bool = True  # tqdm bars
    wandb_mode: str = "disabled"  # disabled | offline | online: mirror the records to wandb
    plot: bool = True  # learning-curve PNG at the end
    # every rank writes the store indices it trained on to <run_dir>/seen/ (epoch E from
    # host call C: eE.cC.rR.npy): to check which molecules each host read
    seen_molecules: bool = False


@dataclass
class Config:
    seed: int = 0
    # auto: the measured recipe for the data fills every key the config leaves unset
    # (schnet_ipu/recipes.py); energies | forces | periodic: that recipe; none: bare defaults
    recipe: str = "auto"
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


CHOICES: dict[str, tuple[str, ...]] = {
    "recipe": ("auto", "none", "energies", "forces", "periodic"),
    "data.source": ("qm9", "qm9-raw", "hydronet", "water", "ase"),
    "data.hydronet_subset": ("small", "medium", "large"),
    "data.water_distribution": ("uniform", "hydronet"),
    "packing.algorithm": ("lpfhp", "tuple", "pad_to_max"),
    "packing.heuristic": ("product", "sum", "max", "min", "nodes", "edges"),
    "packing.replica_balance": ("none", "cost_model"),
    "model.graph": ("knn", "radius"),
    "model.readout": ("sum", "mean"),
    "model.ops": ("torch", "ipu", "triton"),
    "loader.device_resident": ("auto", "true", "false"),
    "model.message_passing": ("sparse", "dense"),
    "model.filter": ("exact", "table"),
    "optim.schedule": ("plateau", "cosine", "constant"),
    "optim.energy_loss": ("mse", "l1"),
    "backend.device": ("auto", "cpu", "cuda", *IPU_DEVICES),
    "backend.dist_backend": ("auto", "gloo", "nccl"),
    "backend.cuda_graphs": ("auto", "true", "false"),
    "backend.precision": ("fp32", "tf32", "bf16", "auto"),
    "logging.wandb_mode": ("disabled", "offline", "online"),
}

POSITIVE = (
    "packing.packs_per_batch",
    "model.hidden_channels",
    "model.num_filters",
    "model.num_interactions",
    "model.num_gaussians",
    "model.cutoff",
    "model.k",
    "model.filter_points",
    "optim.epochs",
    "optim.lr",
    "optim.spike_window",
    "backend.replicas",
    "backend.device_iterations",
    "backend.gradient_accumulation",
    "logging.log_every",
)

NON_NEGATIVE = (
    "data.subset",
    "data.water_clusters",
    "data.water_templates",
    "data.val",
    "data.test",
    "packing.max_nodes",
    "packing.max_edges",
    "packing.max_graphs",
    "loader.workers",
    "optim.warmup_steps",
    "optim.min_lr",
    "optim.grad_clip",
    "optim.weight_decay",
    "optim.forces_weight",
    "optim.stress_weight",
    "optim.max_minutes",
    "optim.lr_reference_minutes",
    "optim.ema_decay",
    "optim.spike_rollbacks",
    "optim.spike_lr_recovery_steps",
    "backend.threads",
)
