"""Measured recipes as defaults: what a config does not set comes from the recipe for its data.

The bare defaults of :mod:`schnet_ipu.config_schema` are the SchNet paper's setup. They train
far slower than the recipes measured here: a force config with only its data keys set trained
to 4x the force error of ``configs/emt_forces.yaml``. So the data picks a recipe
(``recipe: auto``, the default), and every key the user did not set (in the YAML file or as an
override) takes the recipe's value:

==========  ======================================  =========================================
recipe      chosen when the store has               measured in
==========  ======================================  =========================================
energies    energies only (or forces_weight: 0)     configs/qm9.yaml (QM9 U0, minutes)
forces      forces, no cells                        configs/emt_forces.yaml (EMT clusters)
periodic    forces and cells (stress)               configs/emt_bulk.yaml (EMT alloys, slabs)
==========  ======================================  =========================================

``recipe: none`` keeps the bare defaults; ``recipe: forces`` (etc.) picks one whatever the
data. A learning rate belongs to its schedule: a config that sets another ``optim.schedule``
than the recipe's keeps the bare learning-rate keys too. Keys that only pay off on a CPU
(replicas, threads) apply where training runs on one (``backend.device`` cpu, or auto
without CUDA). The numbers behind each recipe are in
docs/guide/budgets-and-recipes.md; this table is the one place that holds the recipes.

What the data holds is read without importing it: the store's header when it exists, else
the first frame of each ``data.files`` (``data.source: ase``); the other sources are
energies only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schnet_ipu.config_schema import Config

# The learning-rate keys of a schedule: applied only where the schedule is the recipe's.
SCHEDULE_KEYS = ("optim.lr", "optim.lr_reference_minutes", "optim.warmup_steps", "optim.min_lr")
CPU_KEYS = ("backend.replicas", "backend.threads")

FORCE_TRAINING = {
    "optim.forces_weight": 100.0,
    "optim.lr": 2e-3,
    "optim.schedule": "cosine",
    "optim.warmup_steps": 50,
    "optim.ema_decay": 0.0,
    "model.hidden_channels": 64,
    "model.num_filters": 64,
    "model.num_interactions": 3,
    "model.num_gaussians": 25,
    "model.cutoff": 5.0,
    "model.graph": "radius",
    "model.filter": "table",
    "packing.algorithm": "tuple",
    "packing.packs_per_batch": 4,
    "backend.threads": 1,
}

RECIPES: dict[str, dict[str, Any]] = {
    "energies": {
        "optim.lr": 4e-3,
        "optim.lr_reference_minutes": 10.0,
        "optim.schedule": "cosine",
        "optim.warmup_steps": 300,
        "optim.min_lr": 0.0,
        "optim.adam_beta2": 0.99,
        "optim.ema_decay": 0.999,
        "model.filter": "table",
        "model.filter_points": 128,
        "packing.packs_per_batch": 16,
        "backend.compile": True,
        "backend.precision": "auto",
        "backend.replicas": 2,
    },
    "forces": {**FORCE_TRAINING, "model.filter_points": 128},
    "periodic": FORCE_TRAINING,
}


@dataclass(frozen=True)
class DataLabels:
    """What a run's data carries, as far as choosing a recipe needs."""

    forces: bool
    periodic: bool
    source: str  # where that was read: the store, the first frames, or the source's kind


@dataclass(frozen=True)
class AppliedRecipe:
    """The recipe a config got, why, and the values it filled in (keys the user left unset)."""

    name: str
    why: str
    values: dict[str, Any]

    def line(self) -> str:
        """One line for the log and for ``--print-config``."""
        if not self.values:
            return f"recipe {self.name}: {self.why}; nothing left to fill in"
        filled = ", ".join(f"{key}={value}" for key, value in self.values.items())
        return f"recipe {self.name}: {self.why}; filled in {filled} (keys you set win)"


def apply_recipe(cfg: Config, explicit: set[str]) -> AppliedRecipe:
    """Fill the keys of ``cfg`` that are not in ``explicit`` (dotted keys the user set) from
    the recipe ``cfg.recipe`` names, or that the data picks for ``auto``; ``cfg.recipe`` then
    holds the recipe's name."""
    if cfg.recipe == "none":
        return AppliedRecipe("none", "recipe: none keeps the bare defaults", {})
    if cfg.recipe == "auto":
        labels = data_labels(cfg)
        if labels is None:  # nothing to read yet: the import reports the missing file
            return AppliedRecipe("none", "the data cannot be read yet (data.files)", {})
        name, why = choose_recipe(cfg, labels, explicit)
    else:
        name, why = cfg.recipe, "named by the config"
    values = {}
    for key, value in RECIPES[name].items():
        if key in explicit or _skipped(key, cfg, explicit, name):
            continue
        if key in CPU_KEYS and not _trains_on_cpu(cfg):
            continue
        values[key] = value
    for key, value in values.items():
        _set(cfg, key, value)
    cfg.recipe = name
    return AppliedRecipe(name, why, values)


def choose_recipe(cfg: Config, labels: DataLabels, explicit: set[str]) -> tuple[str, str]:
    """The recipe's name for data with ``labels``, and why in a few words."""
    energies_only = "optim.forces_weight" in explicit and cfg.optim.forces_weight == 0
    if not labels.forces or energies_only:
        reason = "optim.forces_weight=0 is set" if labels.forces else "energies only"
        return "energies", f"{labels.source}: {reason}"
    if labels.periodic:
        return "periodic", f"{labels.source}: forces and cells"
    return "forces", f"{labels.source}: forces, no cells"


def data_labels(cfg: Config) -> DataLabels | None:
    """Forces and cells of the run's data, from the store's header if it exists, else from the
    first frame of each ASE file (None where none can be read); QM9, HydroNet and water stores
    hold energies only."""
    store = Path(cfg.data.path)
    if store.is_file():
        import h5py

        try:
            with h5py.File(store, "r") as f:
                return DataLabels("forces" in f, "cell" in f, str(store))
        except OSError:  # not an HDF5 store: opening it for training says so in one line
            return DataLabels(False, False, f"{store} (unreadable)")
    if cfg.data.source != "ase":
        return DataLabels(False, False, f"data.source={cfg.data.source}")
    frames = [_first_frame(Path(name)) for name in cfg.data.files]
    if any(frame is None for frame in frames):
        return None
    forces = periodic = False
    for first in frames:
        results = first.calc.results if first.calc is not None else {}
        forces |= cfg.data.forces_key in first.arrays or "forces" in results
        periodic |= bool(first.pbc.any())
    return DataLabels(forces, periodic, f"the first frame of {', '.join(cfg.data.files)}")


def _first_frame(path: Path):
    """The first structure ASE reads from ``path``, or None where it cannot (the import then
    reports the file in one line)."""
    if not path.is_file():
        return None
    from ase.io import read

    try:
        return read(path, index=0)
    except Exception:  # any reader error: the importer names the file and the cause
        return None


def _skipped(key: str, cfg: Config, explicit: set[str], name: str) -> bool:
    """Learning-rate keys stay bare where the user chose another schedule than the recipe's,
    the budget's reference where there is no budget, and a compiled step is not offered to a
    run that trains forces or stress (double backward, which torch.compile does not support)."""
    recipe_schedule = RECIPES[name].get("optim.schedule")
    own_schedule = "optim.schedule" in explicit and cfg.optim.schedule != recipe_schedule
    if key in SCHEDULE_KEYS and own_schedule:
        return True
    if key == "optim.lr_reference_minutes" and cfg.optim.max_minutes == 0:
        return True  # it scales the peak of a budget; a run of epochs has none
    response_loss = cfg.optim.forces_weight > 0 or cfg.optim.stress_weight > 0
    return key == "backend.compile" and response_loss


def _trains_on_cpu(cfg: Config) -> bool:
    """Whether ``backend.device`` is the CPU (``auto``: where CUDA is not available; torch is
    imported only then, when a CPU-only key is left to fill)."""
    if cfg.backend.device != "auto":
        return cfg.backend.device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _set(cfg: Config, dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    setattr(getattr(cfg, section), key, value)
