"""Typed configuration: dataclasses loaded from YAML, with dotted ``key=value`` overrides.

    cfg = load_config("configs/qm9.yaml", ["optim.lr=5e-4", "data.subset=20000"])
    cfg, recipe = resolve_config("configs/emt_forces.yaml")   # and the recipe it got

Keys the file and the overrides leave unset take the measured recipe for the data
(:mod:`schnet_ipu.recipes`, ``recipe: auto``), then the bare defaults.

Every mistake is reported before anything runs: an unknown key names the closest valid
key (a removed key what replaced it), a wrong type names the key, the expected type and the
value, and impossible values say what to change. Checks that need the data (a pack limit
below the largest molecule, more replicas than packs) live beside the data and raise
:class:`ConfigError` too. The keys and their defaults are declared in
:mod:`schnet_ipu.config_schema` and re-exported here.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import math
import typing
from pathlib import Path
from typing import Any

import yaml

from schnet_ipu.config_schema import (
    CHOICES,
    IPU_DEVICES,
    NON_NEGATIVE,
    POSITIVE,
    REMOVED_KEYS,
    BackendConfig,
    Config,
    ConfigError,
    DataConfig,
    LoaderConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    PackingConfig,
)
from schnet_ipu.recipes import AppliedRecipe, apply_recipe

__all__ = [
    "IPU_DEVICES",
    "BackendConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoaderConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "PackingConfig",
    "apply_override",
    "check_ipu_replicas",
    "config_from_dict",
    "global_batch",
    "load_config",
    "resolve_config",
    "resolved_yaml",
    "validate",
]

# Field annotations are strings (``from __future__ import annotations``); resolving them with
# these names keeps ``list[int]`` readable on Python 3.8 (the Poplar SDK's), where the builtin
# ``list`` cannot be subscripted.
_GENERICS = {"list": typing.List, "tuple": typing.Tuple, "dict": typing.Dict}


def _field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of every field of dataclass ``cls``."""
    return typing.get_type_hints(cls, localns=_GENERICS)


def load_config(
    path: str | Path | None = None, overrides: list[str] = (), instances: int | None = None
) -> Config:
    """The config of :func:`resolve_config`."""
    return resolve_config(path, overrides, instances)[0]


def resolve_config(
    path: str | Path | None = None, overrides: list[str] = (), instances: int | None = None
) -> tuple[Config, AppliedRecipe]:
    """Read a YAML file (or the defaults), apply ``a.b=value`` overrides, fill the keys left
    unset from the data's recipe, and validate; for ``ipu`` devices also the replicas one
    process reserves (:func:`check_ipu_replicas`): ``backend.replicas`` / ``instances``
    (PopRun instances, scripts/poprun.py), this PopRun instance's share when run under
    poprun, else all. A stored config (:func:`config_from_dict`) is read, not launched, so it
    skips that check and takes no recipe (it holds every key)."""
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
    validate(cfg)  # the user's own keys first: their mistakes name them
    explicit = _dotted_keys(raw) | {item.split("=", 1)[0].strip() for item in overrides}
    recipe = apply_recipe(cfg, explicit)
    validate(cfg)
    if cfg.backend.device in IPU_DEVICES:  # a run to launch: the IPUs to reserve
        where = "backend.replicas" if instances is None else "backend.replicas per instance"
        check_ipu_replicas(_replicas_per_process(cfg.backend, instances), cfg.backend.device, where)
    return cfg, recipe


def _dotted_keys(raw: dict[str, Any], prefix: str = "") -> set[str]:
    """Every key a YAML mapping sets, dotted (``optim.lr``); sections themselves are not keys."""
    keys = set()
    for key, value in raw.items():
        if isinstance(value, dict):
            keys |= _dotted_keys(value, f"{prefix}{key}.")
        else:
            keys.add(prefix + str(key))
    return keys


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Rebuild a validated config from ``Config.to_dict()`` output (checkpoints, run dirs),
    also one saved before the keys of ``REMOVED_KEYS`` went."""
    cfg = _build(Config, _without_removed_keys(raw), prefix="")
    validate(cfg)
    return cfg


def _without_removed_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A stored config with the removed keys translated: ``logging.wandb`` (false: no wandb
    whatever ``wandb_mode`` said) and ``loader.cache`` (no effect) go."""
    raw = copy.deepcopy(raw)
    logging_section, loader = raw.get("logging"), raw.get("loader")
    wandb_on = logging_section.pop("wandb", True) if isinstance(logging_section, dict) else True
    if not wandb_on:
        logging_section["wandb_mode"] = "disabled"
    if isinstance(loader, dict):
        loader.pop("cache", None)
    return raw


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
    if not 0 < cfg.optim.adam_beta2 < 1:
        raise ConfigError(f"optim.adam_beta2 must be in (0, 1), got {cfg.optim.adam_beta2}")
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
    if cfg.loader.shard and cfg.packing.replica_balance == "cost_model":
        raise ConfigError(
            "packing.replica_balance=cost_model groups the micro-batches of a step over all "
            "replicas, but loader.shard=true gives each replica packs of its own share; "
            "turn one of them off"
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


def global_batch(cfg: Config) -> str:
    """What one optimiser step averages its gradient over, in words: every replica's
    micro-batches of ``packing.packs_per_batch`` packs. It grows with the replicas (all nodes
    together under torchrun), and an epoch has as many times fewer steps; ``optim.lr`` is per
    step and stays as set (see docs/guide/multi-host.md)."""
    b = cfg.backend
    packs = b.replicas * b.gradient_accumulation * cfg.packing.packs_per_batch
    return (
        f"global batch: backend.replicas {b.replicas} x backend.gradient_accumulation "
        f"{b.gradient_accumulation} x packing.packs_per_batch {cfg.packing.packs_per_batch} "
        f"= {packs} packs per optimiser step; optim.lr {cfg.optim.lr:g} is per step, "
        "not scaled with the replicas"
    )


def resolved_yaml(cfg: Config) -> str:
    """The config as YAML, ending with its global batch as a comment (``--print-config``,
    a run folder's config.yaml)."""
    return f"{cfg.to_yaml()}# {global_batch(cfg)}\n"


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
    if prefix + name in REMOVED_KEYS:
        raise ConfigError(f"config key {prefix}{name} was removed: {REMOVED_KEYS[prefix + name]}")
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
