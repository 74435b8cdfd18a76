"""Energies and forces of trained models on new structures: one model, or an ensemble.

    predictor = Predictor(["runs/a/checkpoints/best.pt", "runs/b"], dtype=torch.float64)
    result = predictor.predict(z, pos)            # Prediction: energy, forces, their spread
    predict_file(["model.pt"], Path("new.extxyz"), Path("out.extxyz"))
    export_model("runs/a", Path("a.torchscript.pt"))   # for LAMMPS, OpenMM-Torch, libtorch

Each model is a checkpoint file or a run folder (its best checkpoint); nothing else of the
run is read, so a model file copied to another machine works there alone. Every structure
is evaluated on its own by :class:`~schnet_ipu.portable.PortableSchNet` (no packing, its
own neighbour search), float32 as trained or float64 when asked. An ensemble's prediction
is the members' mean; ``energy_std`` and ``forces_std`` are their spread (population
standard deviation over members, 0 for one model).
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union  # typing's forms: a runtime alias on Python 3.8

import numpy as np
import torch

from schnet_ipu.data.ase_files import check_frame, read_frames
from schnet_ipu.errors import CheckpointError
from schnet_ipu.model_file import ModelSpec, load_trained
from schnet_ipu.portable import PortableSchNet

log = logging.getLogger("schnet_ipu")

ModelPaths = Union[str, Path, Sequence[Union[str, Path]]]  # one model file/run, or several


@dataclass
class Prediction:
    """One structure's prediction: energy in the model's unit, forces [n, 3] in its unit per
    Angstrom (float64), and their spread over an ensemble's members."""

    energy: float
    forces: np.ndarray
    energy_std: float
    forces_std: np.ndarray


def model_paths(models: ModelPaths) -> list[Path]:
    """One path, or several, as a list."""
    if isinstance(models, (str, Path)):
        return [Path(models)]
    paths = [Path(m) for m in models]
    if not paths:
        raise CheckpointError("no model given: pass a checkpoint file or run folder")
    return paths


class Predictor:
    """Trained models (checkpoint files or run folders) ready for new structures.

    ``checkpoint`` picks "best" or "last" in run folders; ``dtype=torch.float64`` evaluates
    in double precision (smooth energies for finite differences and long MD).
    """

    def __init__(
        self, models: ModelPaths, checkpoint: str = "best", dtype: torch.dtype = torch.float32
    ) -> None:
        members = [load_trained(path, checkpoint) for path in model_paths(models)]
        units = {m.spec.unit for m in members}
        if len(units) > 1:
            raise CheckpointError(f"an ensemble needs one energy unit; its members use {units}")
        self.specs: list[ModelSpec] = [m.spec for m in members]
        self.modules = [PortableSchNet.from_trained(m).to(dtype) for m in members]
        self.dtype = dtype
        self.unit = members[0].spec.unit
        self.forces_unit = members[0].spec.forces_unit

    def predict(self, z: np.ndarray, pos: np.ndarray, where: str = "structure") -> Prediction:
        """The prediction for atomic numbers ``z`` [n] and positions ``pos`` [n, 3] in
        Angstrom; an element a member never saw raises a ConfigError naming ``where``."""
        for spec in self.specs:
            spec.check_elements(np.asarray(z), where)
        z_t = torch.as_tensor(np.asarray(z, dtype=np.int64))
        pos_t = torch.as_tensor(np.asarray(pos), dtype=self.dtype)
        energies, forces = [], []
        for module in self.modules:
            energy, force = module(z_t, pos_t)
            energies.append(float(energy))
            forces.append(force.detach().double().numpy())
        stacked = np.stack(forces)
        return Prediction(
            energy=float(np.mean(energies)),
            forces=stacked.mean(axis=0),
            energy_std=float(np.std(energies)),
            forces_std=stacked.std(axis=0),
        )


def predict_file(models: ModelPaths, input_path: Path, out: Path) -> int:
    """Predict every frame of ``input_path`` (any ASE-readable file) and write them to ``out``
    (extxyz) with ``info["energy"]`` and ``arrays["forces"]``, plus ``info["energy_std"]``
    and ``arrays["forces_std"]`` for an ensemble. Returns the frame count."""
    import ase.io
    from ase import Atoms

    frames = read_frames(input_path)
    structures = [check_frame(atoms, f"{input_path}, frame {i}") for i, atoms in enumerate(frames)]
    predictor = Predictor(models)
    ensemble = len(predictor.modules) > 1
    written = []
    for i, (atoms, (z, pos)) in enumerate(zip(frames, structures)):
        result = predictor.predict(z, pos, f"{input_path}, frame {i}")
        copy = Atoms(atoms.numbers, atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
        copy.info.update({k: v for k, v in atoms.info.items() if k != "energy"})
        copy.info["energy"] = result.energy
        copy.arrays["forces"] = result.forces
        if ensemble:
            copy.info["energy_std"] = result.energy_std
            copy.arrays["forces_std"] = result.forces_std
        written.append(copy)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    ase.io.write(tmp, written, format="extxyz")
    tmp.replace(out)
    return len(written)


def export_model(
    model: str | Path, out: Path, checkpoint: str = "best", dtype: torch.dtype = torch.float32
) -> dict:
    """Write a checkpoint's model as a TorchScript file that plain torch loads
    (``torch.jit.load``) with no import of this package; returns its metadata, which the
    file also holds as ``schnet_ipu.json`` (``_extra_files``).

    TorchScript, not ``torch.export``: the forces are an autograd pass over a neighbour list
    whose length depends on the positions, and ``torch.export`` in torch 2.13 stops on that
    data-dependent size inside the backward (GuardOnDataDependentSymNode); TorchScript keeps
    both, and is what the OpenMM-Torch and LAMMPS plugins load today.
    """
    trained = load_trained(model, checkpoint)
    module = PortableSchNet.from_trained(trained).to(dtype)
    with warnings.catch_warnings():  # TorchScript's deprecation notice: chosen knowingly
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(module)
    meta = {
        "interface": "energy, forces = model(z, pos)",
        "z": "int64 [N] atomic numbers",
        "pos": f"{str(dtype).replace('torch.', '')} [N, 3] Angstrom",
        "energy": f"float64 [] {trained.spec.unit}",
        "forces": f"[N, 3] {trained.spec.forces_unit}",
        "cutoff": trained.spec.cutoff,
        "elements": trained.spec.elements,
        "source": str(trained.path),
        "model_spec": trained.spec.to_dict(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(scripted, str(tmp), _extra_files={"schnet_ipu.json": json.dumps(meta)})
    tmp.replace(out)
    return meta
