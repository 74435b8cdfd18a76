"""Energies and forces of trained models on new structures: one model, or an ensemble.

    predictor = Predictor(["runs/a/checkpoints/best.pt", "runs/b"], dtype=torch.float64)
    result = predictor.predict(z, pos)            # Prediction: energy, forces, their spread
    predict_file(["model.pt"], Path("new.extxyz"), Path("out.extxyz"))

Each model is a checkpoint file or a run folder (its best checkpoint); nothing else of the
run is read, so a model file copied to another machine works there alone. Every structure
is evaluated on its own, float32 as trained or float64 when asked, molecules and periodic
frames (a cell and any ``pbc``) alike; periodic frames get the stress too (ASE's convention,
eV/Angstrom^3). Each member runs the :class:`~schnet_ipu.inference.force_paths.ForcePath`
its kind needs, chosen once when it is loaded (:func:`~schnet_ipu.inference.force_paths.
force_path`: numba's direct loops for ``model.filter=table``, the portable model over a half
list for ``exact``, knn models' own search); members with one cutoff share the structure's
half list. An ensemble's prediction is the members' mean; the ``*_std`` fields are their
spread (population standard deviation over members, 0 for one model).

:func:`predict_file` is ``train.py predict --model M --input FILE``: new structures in, extxyz
out. (``train.py predict --run RUN``, a run's own split to CSV, is
:func:`schnet_ipu.training.finished_runs.predict_split`.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union  # typing's forms: a runtime alias on Python 3.8

import numpy as np
import torch

from schnet_ipu.data.ase_files import check_frame, frame_cell, read_frames, write_extxyz
from schnet_ipu.errors import CheckpointError
from schnet_ipu.files import check_output
from schnet_ipu.inference.force_paths import ForcePath, Structure, force_path
from schnet_ipu.inference.model_file import ModelSpec, checkpoint_path, load_trained

log = logging.getLogger("schnet_ipu")

# Below this many atoms a structure is evaluated on one intra-op thread (the fused table
# loops always run on one). Float32 energy + forces (+ stress), 2-core box, one thread
# against two: 20-atom molecule 3.2 against 8.5 ms (quiet); 200-atom molecule 16.0 against
# 31.3 ms, 200-atom Cu cell 5.7 against 7.5, 1,000-atom Cu cell 19.8 against 28.5 (load
# 1.1-1.2); at load 8 the two-thread calls took 15-60x longer (torch's pool waits on its
# descheduled thread). 10,000 atoms keep torch's threads: not measured on a quiet box.
ONE_THREAD_ATOMS = 2000

ModelPaths = Union[str, Path, Sequence[Union[str, Path]]]  # one model file/run, or several


@dataclass
class Prediction:
    """One structure's prediction: energy in the model's unit, forces [n, 3] in its unit per
    Angstrom (float64), and their spread over an ensemble's members."""

    energy: float
    forces: np.ndarray
    energy_std: float
    forces_std: np.ndarray
    stress: np.ndarray | None = None  # [3, 3] periodic frames only
    stress_std: np.ndarray | None = None


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
        self.paths: list[ForcePath] = [force_path(m, dtype) for m in members]
        self.unit = members[0].spec.unit
        self.forces_unit = members[0].spec.forces_unit

    def predict(
        self,
        z: np.ndarray,
        pos: np.ndarray,
        where: str = "structure",
        cell: np.ndarray | None = None,
        pbc: np.ndarray | None = None,
    ) -> Prediction:
        """The prediction for atomic numbers ``z`` [n] and positions ``pos`` [n, 3] in
        Angstrom, periodic when ``cell`` [3, 3] (rows) and some ``pbc`` [3] are given; an
        element a member never saw raises a ConfigError naming ``where``."""
        for spec in self.specs:
            spec.check_elements(np.asarray(z), where)
        structure = Structure(z, pos, cell, pbc, where)
        results = []
        threads = 1 if len(structure.z) < ONE_THREAD_ATOMS else torch.get_num_threads()
        with intra_op_threads(threads):
            for path in self.paths:
                energy, force, virial = path.energy_forces(structure)
                periodic = structure.periodic and virial is not None  # (knn paths refuse cells)
                stress = -virial / abs(np.linalg.det(structure.box)) if periodic else None
                results.append((float(energy), force, stress))
        if len(results) == 1:  # one model: no spread to compute (np.std costs ~20 us)
            energy, force, stress = results[0]
            spread = None if stress is None else np.zeros_like(stress)
            return Prediction(energy, force, 0.0, np.zeros_like(force), stress, spread)
        energies = np.array([energy for energy, _, _ in results])
        forces = np.stack([force for _, force, _ in results])
        stress = np.stack([s for _, _, s in results]) if structure.periodic else None
        return Prediction(
            energy=float(energies.mean()),
            forces=forces.mean(axis=0),
            energy_std=float(energies.std()),
            forces_std=forces.std(axis=0),
            stress=None if stress is None else stress.mean(axis=0),
            stress_std=None if stress is None else stress.std(axis=0),
        )


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count is ``count`` inside the block (set back after)."""
    previous = torch.get_num_threads()
    if count != previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count != previous:
            torch.set_num_threads(previous)


def predict_file(models: ModelPaths, input_path: Path, out: Path) -> int:
    """``train.py predict --model M --input FILE``: every frame of ``input_path`` (any
    ASE-readable file) to ``out`` (extxyz) with ``info["energy"]`` and ``arrays["forces"]``,
    ``info["stress"]`` (Voigt) for periodic frames, plus ``info["energy_std"]`` and
    ``arrays["forces_std"]`` for an ensemble. Returns the frame count. ``out`` may not be a
    folder, the input or a model file (one line, nothing written). (A run's own split is
    :func:`schnet_ipu.training.finished_runs.predict_split`'s.)"""
    from ase import Atoms

    models_read = [("model checkpoint", checkpoint_path(m)) for m in model_paths(models)]
    check_output(out, [("input file", input_path), *models_read])
    frames = read_frames(input_path)
    places = [f"{input_path}, frame {i}" for i in range(len(frames))]
    structures = [(*check_frame(a, at), *frame_cell(a, at)) for a, at in zip(frames, places)]
    predictor = Predictor(models)
    ensemble = len(predictor.paths) > 1
    written = []
    for atoms, (z, pos, cell, pbc), at in zip(frames, structures, places):
        result = predictor.predict(z, pos, at, cell, pbc)
        written_atoms = Atoms(atoms.numbers, atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
        labels = ("energy", "stress")  # the file's own, replaced by the prediction
        written_atoms.info.update({k: v for k, v in atoms.info.items() if k not in labels})
        written_atoms.info["energy"] = result.energy
        written_atoms.arrays["forces"] = result.forces
        if result.stress is not None:
            written_atoms.info["stress"] = voigt(result.stress)
        if ensemble:
            written_atoms.info["energy_std"] = result.energy_std
            written_atoms.arrays["forces_std"] = result.forces_std
        written.append(written_atoms)
    write_extxyz(written, out)
    return len(written)


def voigt(stress: np.ndarray) -> np.ndarray:
    """A [3, 3] stress as ASE's Voigt [6]: xx, yy, zz, yz, xz, xy."""
    return stress[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
