"""Checkpoints: written atomically, checked against the run's config on resume.

A checkpoint holds everything an exact resume needs: model, optimiser and scheduler state,
the RNG states, the epoch and the number of host calls done in it (pack assignment is a
pure function of the seed and the epoch, so those two fix it), and the config it ran with.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from schnet_ipu.config import ConfigError

# Keys that may change between an interrupted run and its resume without changing results.
RESUMABLE_CHANGES = ("optim.epochs", "logging.", "loader.workers", "loader.prefetch")


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary file beside ``path``, then rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ConfigError(
            f"checkpoint {path} cannot be read ({err}); delete it to start over"
        ) from err


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], prefix: str = ""
) -> list[str]:
    """Dotted keys whose values differ, ignoring keys a resume may change."""
    differences = []
    for key in sorted(set(saved) | set(current)):
        dotted = prefix + key
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differences += config_differences(a, b, dotted + ".")
        elif a != b and not dotted.startswith(RESUMABLE_CHANGES):
            differences.append(f"{dotted}: {a!r} in the run directory, {b!r} now")
    return differences


def check_same_run(saved: dict[str, Any], current: dict[str, Any], run_dir: Path) -> None:
    differences = config_differences(saved, current)
    if differences:
        listed = "; ".join(differences[:5])
        raise ConfigError(
            f"run directory {run_dir} holds a checkpoint of another config ({listed}). "
            "Choose another logging.run_dir, or pass --fresh to discard that run."
        )
