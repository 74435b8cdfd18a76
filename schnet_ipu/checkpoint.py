"""Checkpoints: written atomically, checked against the run's config on resume.

A checkpoint holds everything an exact resume needs: model, optimiser and scheduler state,
the RNG states, the epoch and the number of host calls done in it (pack assignment is a
pure function of the seed and the epoch, so those two fix it), and the config it ran with.
All of it is plain data (tensors, numbers, strings, lists, dicts), and only plain data is
loaded back (``torch.load(weights_only=True)``): reading a checkpoint never runs code.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from schnet_ipu.config import ConfigError, config_from_dict
from schnet_ipu.errors import CheckpointError
from schnet_ipu.files import append_whole, write_failed

# Keys that may change between an interrupted run and its resume without changing results.
RESUMABLE_CHANGES = (
    "recipe",  # names where unset keys came from; the keys themselves are compared
    "optim.epochs",
    "optim.max_minutes",  # a budget may be extended
    "optim.beat_baseline",  # checked after the run
    "logging.",
    "loader.workers",
    "loader.prefetch",
)

# What every checkpoint of this program holds (see the training loop's ``checkpoint``).
CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "rng", "epoch", "call", "best_mae", "config")


def plain_tensors(state: Any) -> Any:
    """``state`` with every tensor of a ``torch.Tensor`` subclass as a plain tensor (same
    storage), through dicts, lists and tuples. ``poptorch.trainingModel`` re-types a model's
    buffers as ``PoptorchBuffer``, which ``detach()`` keeps and which pickles as a call to
    PopTorch (python/_poplar_executor.py, python/_impl.py at sdk/poptorch/3.4.0): saved as
    is, ``weights_only`` loading would refuse the file."""
    if isinstance(state, torch.Tensor):
        return state if type(state) is torch.Tensor else state.as_subclass(torch.Tensor)
    if isinstance(state, dict):
        plain = type(state)((key, plain_tensors(value)) for key, value in state.items())
        if hasattr(state, "_metadata"):  # a module state_dict's versions
            plain._metadata = state._metadata
        return plain
    if isinstance(state, (list, tuple)):
        return type(state)(plain_tensors(value) for value in state)
    return state


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` as plain data (:func:`plain_tensors`) to a temporary file beside
    ``path``, flush it to disk, then rename: never a half-written file, even after a power
    cut. The state is serialised in memory first and written as plain bytes, so a full
    disk, a file-size limit or a read-only folder is an OS error of this function
    (``torch.save``'s own writer names no file): it raises
    :class:`~schnet_ipu.errors.RunDirError` naming ``path``, and the previous ``path`` stays
    as it was."""
    buffer = io.BytesIO()
    torch.save(plain_tensors(state), buffer)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        append_whole(tmp, buffer.getbuffer())
        os.replace(tmp, path)
    except OSError as err:
        raise write_failed(path, err) from err
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by this program. Only tensors, numbers, strings, lists and
    dicts are unpickled (``weights_only``), so no file can run code; anything else, or a
    file without this program's keys, raises :class:`CheckpointError` naming it."""
    if is_torchscript(path):
        raise CheckpointError(
            f"{path}: an exported TorchScript model (train.py export writes these), not a "
            "checkpoint; load it with torch.jit.load, and give a checkpoint (RUN/checkpoints/"
            "best.pt) or run folder here"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        unsupported = [line for line in str(err).splitlines() if "global" in line.lower()]
        if not unsupported:
            raise CheckpointError(
                f"{path}: unreadable checkpoint (not a file this program wrote); delete it to "
                "start over"
            ) from err
        raise CheckpointError(
            f"{path}: refused to load: it holds Python objects other than tensors, numbers, "
            f"strings, lists and dicts ({unsupported[0].strip()}), which could run code; it "
            "is not a checkpoint of this program. Delete it or train again"
        ) from err
    except Exception as err:  # the unpickler fails on foreign bytes in many ways (a text
        # file: IndexError from its stack); whatever it raises, the file is no checkpoint
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({type(err).__name__}: {err}); delete it to start over"
        ) from err
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if not missing and not isinstance(state["config"], dict):
        missing = ["config mapping"]
    if missing:
        raise CheckpointError(
            f"{path}: not a checkpoint of this program (no {', '.join(missing)}); "
            "delete it or choose another run directory"
        )
    return state


def is_torchscript(path: Path) -> bool:
    """True for a TorchScript archive (a zip holding compiled ``code/``), which torch.load
    cannot read with ``weights_only``."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any("/code/" in name for name in archive.namelist())


def load_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """``model.load_state_dict(state)``, where a parameter listed under several names takes
    the value under the name ``named_parameters`` gives it (``interactions.i.mlp``, not its
    alias ``interactions.i.conv.nn``). Files written with weight averaging before the average
    covered the alias hold the averaged filter weights there and the raw ones under the
    alias: this loads the model their validation measured."""
    model.load_state_dict(state)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(state[name])


@contextmanager
def restoring(path: Path) -> Iterator[None]:
    """Around ``load_state_dict`` calls: a state that does not fit (keys, shapes, types)
    raises :class:`CheckpointError` naming ``path`` instead of a deep traceback."""
    try:
        yield
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path}: does not fit this model or optimiser ({first_line}); delete it or choose "
            "another run directory"
        ) from err


def rng_state() -> dict[str, Any]:
    """The python, numpy and torch RNG states as plain lists, numbers and tensors."""
    version, python_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "state": list(python_state), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    python, numpy = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
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
    """ConfigError unless ``current`` is the config ``saved`` in ``run_dir``'s checkpoint. Keys
    added to the config since that run started (absent from ``saved``) take their defaults, so
    a run resumes across an upgrade that only adds keys."""
    differences = config_differences(config_from_dict(saved).to_dict(), current)
    if differences:
        listed = "; ".join(differences[:5])
        raise ConfigError(
            f"run directory {run_dir} holds a checkpoint of another config ({listed}). "
            "Choose another logging.run_dir, or pass --fresh to discard that run."
        )
