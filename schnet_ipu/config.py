"""Typed configuration: dataclasses loaded from YAML, with dotted ``key=value`` overrides.

    cfg = load_config("configs/qm9.yaml", ["optim.lr=5e-4", "data.subset=20000"])

Every mistake is reported before anything runs: an unknown key names the closest valid
key, a wrong type names the key, the expected type and the value, and impossible values
say what to change. Checks that need the data (a pack limit below the largest molecule,
more replicas than packs) live beside the data and raise :class:`ConfigError` too.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from schnet_ipu.errors import UserError

# Field annotations are strings (``from __future__ import annotations``); resolving them with
# these names keeps ``list[int]`` readable on Python 3.8 (the Poplar SDK's), where the builtin
# ``list`` cannot be subscripted.
_GENERICS = {"list": typing.List, "tuple": typing.Tuple, "dict": typing.Dict}


def _field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of every field of dataclass ``cls``."""
    return typing.get_type_hints(cls, localns=_GENERICS)


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
    cache: bool = True  # store.molecule() cache (benchmarks); the feed reads whole arrays


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
    lr: float = 1e-3
    schedule: str = "plateau"  # plateau | cosine | constant
    warmup_steps: int = 0  # cosine: linear warmup steps
    plateau_patience: int = 5  # plateau: epochs without improvement before decay
    plateau_factor: float = 0.5
    min_lr: float = 1e-5
    grad_clip: float = 10.0  # max gradient norm; 0 = off
    weight_decay: float = 0.0
    forces_weight: float = 0.0  # weight of the standardised force loss; 0 = energies only
    stress_weight: float = 0.0  # weight of the standardised stress loss (stores with stress)
    max_minutes: float = 0.0  # wall-clock budget of the training loop; 0 = off (epochs only)
    ema_decay: float = 0.0  # average of the weights for validation, test and model files; 0 = off
    # divergence guard (schnet_ipu/guard.py): a read of the step losses (every logging.log_every
    # host calls) above spike_factor x the median of the last spike_window reads, or a
    # validation loss above spike_factor x the best, rolls back to the last good weights and
    # optimiser state (kept in memory) and multiplies the lr by spike_lr_factor; a spike after
    # spike_rollbacks rollbacks stops the run (exit 2, best.pt kept)
    spike_guard: bool = True
    spike_factor: float = 10.0
    spike_window: int = 20
    spike_lr_factor: float = 0.5
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


@dataclass
class LoggingConfig:
    run_dir: str = "runs/qm9"
    log_every: int = 20  # steps between step records in metrics.jsonl
    progress: bool = True  # tqdm bars
    wandb: bool = False
    wandb_mode: str = "offline"  # offline | online | disabled
    plot: bool = True  # learning-curve PNG at the end


@dataclass
class Config:
    seed: int = 0
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
    "backend.device": ("auto", "cpu", "cuda", "ipu", "ipu-model"),
    "backend.dist_backend": ("auto", "gloo", "nccl"),
    "backend.cuda_graphs": ("auto", "true", "false"),
    "backend.precision": ("fp32", "tf32", "bf16"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
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
    "optim.ema_decay",
    "optim.spike_rollbacks",
    "backend.threads",
)


def load_config(
    path: str | Path | None = None, overrides: list[str] = (), instances: int | None = None
) -> Config:
    """Read a YAML file (or the defaults), apply ``a.b=value`` overrides, and validate; for
    ``ipu`` devices also the replicas one process reserves (:func:`check_ipu_replicas`):
    ``backend.replicas`` / ``instances`` (PopRun instances, scripts/poprun.py), this PopRun
    instance's share when run under poprun, else all. A stored config
    (:func:`config_from_dict`) is read, not launched, so it skips that check."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, not {type(raw).__name__}")
    cfg = _build(Config, raw, prefix="")
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    if cfg.backend.device in ("ipu", "ipu-model"):  # a run to launch: the IPUs to reserve
        where = "backend.replicas" if instances is None else "backend.replicas per instance"
        check_ipu_replicas(_replicas_per_process(cfg.backend, instances), cfg.backend.device, where)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Rebuild a validated config from ``Config.to_dict()`` output (checkpoints, run dirs)."""
    cfg = _build(Config, raw, prefix="")
    validate(cfg)
    return cfg


def apply_override(cfg: Config, item: str) -> None:
    """Apply one ``section.key=value`` override; the value is parsed as YAML, then type-checked."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, text = item.split("=", 1)
    *parents, leaf = dotted.strip().split(".")
    node: Any = cfg
    walked = ""
    for name in parents:
        node = getattr(node, _known_field(node, name, walked))
        walked += name + "."
        if not dataclasses.is_dataclass(node):
            raise ConfigError(f"{walked.rstrip('.')} is a value, not a section")
    leaf = _known_field(node, leaf, walked)
    if dataclasses.is_dataclass(getattr(node, leaf)):
        raise ConfigError(f"{walked}{leaf} is a section; override one of its keys instead")
    value = yaml.safe_load(text) if text.strip() else ""
    hint = _field_types(type(node))[leaf]
    setattr(node, leaf, _convert(value, hint, walked + leaf))


def validate(cfg: Config) -> None:
    """Checks that need no data: finite numbers, choices, signs, and combinations that
    cannot work."""
    for dotted, value in _numbers(cfg, ""):
        if not math.isfinite(value):
            raise ConfigError(f"{dotted} = {value!r} is not a finite number; give a real value")
    for dotted, choices in CHOICES.items():
        value = _get(cfg, dotted)
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{dotted} = {value!r} is not one of {', '.join(choices)}{hint}")
    for dotted in POSITIVE:
        if _get(cfg, dotted) <= 0:
            raise ConfigError(f"{dotted} must be > 0, got {_get(cfg, dotted)!r}")
    for dotted in NON_NEGATIVE:
        if _get(cfg, dotted) < 0:
            raise ConfigError(f"{dotted} must be >= 0, got {_get(cfg, dotted)!r}")
    if cfg.model.filter_points < 2:
        raise ConfigError(f"model.filter_points must be >= 2, got {cfg.model.filter_points}")
    lo_hi = cfg.data.water_sizes
    if len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1]:
        raise ConfigError(f"data.water_sizes must be [min, max] with 1 <= min <= max, got {lo_hi}")
    if not 0 <= cfg.optim.ema_decay < 1:
        raise ConfigError(f"optim.ema_decay must be in [0, 1) (0 = off), got {cfg.optim.ema_decay}")
    if cfg.optim.spike_factor <= 1:
        raise ConfigError(f"optim.spike_factor must be > 1, got {cfg.optim.spike_factor}")
    if not 0 < cfg.optim.spike_lr_factor < 1:
        raise ConfigError(
            f"optim.spike_lr_factor must be in (0, 1), got {cfg.optim.spike_lr_factor}"
        )
    if not 0 < cfg.packing.target_efficiency <= 1:
        raise ConfigError("packing.target_efficiency must be in (0, 1]")
    fractions = [v for v in (cfg.data.val, cfg.data.test) if v < 1]
    if sum(fractions) >= 1:
        raise ConfigError(
            f"data.val + data.test = {sum(fractions)} leaves no training data; lower them"
        )
    if cfg.packing.algorithm == "tuple" and cfg.model.graph != "radius":
        raise ConfigError(
            "packing.algorithm=tuple packs (nodes, edges) for radius graphs; "
            "set model.graph=radius or use packing.algorithm=lpfhp"
        )
    if cfg.packing.max_edges and cfg.packing.max_edges % 2:
        raise ConfigError(
            f"packing.max_edges={cfg.packing.max_edges} must be even (edges come in pairs)"
        )
    if cfg.model.graph == "knn" and cfg.packing.max_nodes and cfg.model.k >= cfg.packing.max_nodes:
        raise ConfigError(
            f"model.k={cfg.model.k} needs packs of more than k atoms, but packing.max_nodes="
            f"{cfg.packing.max_nodes}; lower model.k or raise packing.max_nodes"
        )
    for key in ("forces_weight", "stress_weight"):
        if getattr(cfg.optim, key) > 0 and cfg.backend.compile:
            raise ConfigError(
                f"optim.{key} > 0 trains by double backward, which torch.compile does not "
                "support; set backend.compile=false"
            )
    if cfg.data.source == "ase" and not cfg.data.files:
        raise ConfigError("data.source=ase needs data.files: a list of ASE-readable files")
    if cfg.backend.dist_backend == "nccl" and cfg.backend.device == "cpu":
        raise ConfigError("backend.dist_backend=nccl needs CUDA; use gloo with backend.device=cpu")
    if cfg.backend.cuda_graphs == "true" and cfg.backend.device not in ("auto", "cuda"):
        raise ConfigError(
            f"backend.cuda_graphs=true needs CUDA, but backend.device={cfg.backend.device}; "
            "use backend.cuda_graphs=auto (on for CUDA only) or false"
        )


MAX_IPUS_PER_PROCESS = 64


def check_ipu_replicas(replicas: int, device: str, where: str = "backend.replicas") -> None:
    """Refuse a replica count PopTorch 3.4.0 cannot reserve in one process (one IPU per
    replica): at most 64 (``assertSingleInstanceMaxNumIPUs``, IPU Model too) and, on
    hardware, a power of two (``roundUpNumIPUs``), in popart_compiler/source/CompilerImpl.cpp
    of github:graphcore/poptorch at sdk/poptorch/3.4.0."""
    if replicas > MAX_IPUS_PER_PROCESS:
        raise ConfigError(
            f"{where}={replicas}: PopTorch reserves at most {MAX_IPUS_PER_PROCESS} IPUs per "
            "process; run more replicas as several instances through scripts/poprun.py"
        )
    if device == "ipu" and replicas & (replicas - 1):
        raise ConfigError(
            f"{where}={replicas}: PopTorch reserves a power of two of IPUs per process; use "
            "1, 2, 4, 8, 16, 32 or 64 replicas per process"
        )


def _replicas_per_process(backend: BackendConfig, instances: int | None) -> int:
    """``backend.replicas`` / ``instances``, or this instance's share under PopRun."""
    if instances is not None:
        return backend.replicas // instances
    if backend.device != "ipu" or importlib.util.find_spec("popdist") is None:
        return backend.replicas
    import popdist

    return popdist.getNumLocalReplicas() if popdist.isPopdistEnvSet() else backend.replicas


# --- building dataclasses from plain data -------------------------------------------------


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = _field_types(cls)
    instance = cls()
    for key, value in raw.items():
        name = _known_field(instance, key, prefix)
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            setattr(instance, name, _build(hint, value, f"{prefix}{name}."))
        else:
            setattr(instance, name, _convert(value, hint, prefix + name))
    return instance


def _known_field(instance: Any, name: str, prefix: str) -> str:
    names = [f.name for f in dataclasses.fields(instance)]
    if name in names:
        return name
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(names)}"
    raise ConfigError(f"unknown config key {prefix}{name}{hint}")


def _convert(value: Any, hint: Any, dotted: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        (item_type,) = typing.get_args(hint)[:1]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{dotted} expects a list of {item_type.__name__}, got {value!r}")
        return [_convert(v, item_type, f"{dotted}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "5e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str and isinstance(value, str):
        return value
    elif hint is str and isinstance(value, bool):  # YAML reads true/false as booleans
        return str(value).lower()
    raise ConfigError(f"{dotted} expects {hint.__name__}, got {value!r} ({type(value).__name__})")


def _numbers(node: Any, prefix: str) -> list[tuple[str, float]]:
    """(dotted key, value) of every float in a config, nested sections included."""
    found = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            found += _numbers(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            found.append((prefix + f.name, value))
    return found


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for name in dotted.split("."):
        node = getattr(node, name)
    return node
